"""Plain data that crosses from vLLM's scheduler to the worker-side canary (the connector
metadata) and vLLM's KV cache groups as the canary sees them.

Light on purpose (no numba, no vLLM): vLLM imports the connector module while it builds
its config, before its worker scans every loaded module to rebind Triton kernels
(``vllm/triton_utils/dispatcher.py::_rebind_kernels``), and that scan trips over
llvmlite's objects; the numba-backed canary loads only when the KV caches register.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from kvcanary.canary.wire.constants import PoolKind


@dataclass(frozen=True)
class GroupSpec:
    """One vLLM KV cache group, as the canary needs it."""

    index: int
    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None  # None: full attention
    # The ISA vLLM's CPU attention lays this group's KV out for (vLLM's
    # cpu_attn._get_attn_isa; "unknown" where it could not be told): on vLLM's CPU layout
    # the canary fingerprints KV bytes only under the layouts it knows (.pool module doc).
    cpu_attn_isa: str = "vec"

    @property
    def kind(self) -> PoolKind:
        return PoolKind.FULL if self.sliding_window is None else PoolKind.SWA


# StepMeta.pack packs more token ids than this
PACK_MIN = 256
_pack_into = struct.pack_into

# StepMeta.cols: a request's values, in this order
COL_COMPUTED, COL_SCHEDULED, COL_START, COL_COUNT, COL_SLOT = range(5)
NUM_COLS = 5


@dataclass
class StepMeta:
    """One step's scheduled requests, from the scheduler side (plain data: it travels in
    the connector metadata, pickled between processes; flat columns rather than an object
    per request, whose making and reading cost ~2 us a request on each side of a step)::

        req_ids        request ids, in the scheduler's order
        cols           NUM_COLS values a request, in request order (int64 on the worker
                       side in one conversion):
          COL_COMPUTED   tokens already in the cache (vLLM's num_computed_tokens)
          COL_SCHEDULED  tokens this step computes
          COL_START      the request's token ids are those of positions
          COL_COUNT        [start, start + count)
          COL_SLOT       the key group's slot of position num_computed (-1: unallocated)
        tokens         every request's token ids, in request order (speculative
                       decoding: a draft's token id at its position; -1: not known to
                       the scheduler yet, async scheduling); a step with more than
                       PACK_MIN has them in ``packed`` instead (:meth:`pack`)
        packed         the token ids as native int64 (a bytearray), or None
        finished       requests finished since the previous step
        final_*        async scheduling: per finished request the token ids of positions
                       it computed that were sent as not known (-1) and are known at its
                       finish (final_req_ids, final_starts, final_computed: positions
                       [final_starts[i], final_computed[i]); final_tokens, in request
                       order), settled before its row is given up

    KV another connector loaded (external tokens: a KV offload tier, P/D disaggregation;
    :mod:`.connector`, "external loads"), empty unless one did::

        seal_req_ids   requests whose loaded positions are sealed (records written) this
        seal_starts      step: positions [seal_starts[i], seal_ends[i])
        seal_ends
        seal_slots     per KV cache group: every seal's slots, one per position, in seal
                       order (-1: the group holds no block there)
        invalid_slots  per KV cache group: slots whose records are cleared before this step
                       (a load in flight, or a load that failed): any read of them is
                       reported until something writes them
    """

    req_ids: list[str] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    packed: bytearray | None = None
    # (the rest are empty on nearly every step: an empty tuple until something is added,
    # no list made a step)
    final_req_ids: Sequence[str] = ()
    final_starts: Sequence[int] = ()
    final_computed: Sequence[int] = ()
    final_tokens: Sequence[int] = ()
    seal_req_ids: Sequence[str] = ()
    seal_starts: Sequence[int] = ()
    seal_ends: Sequence[int] = ()
    seal_slots: Sequence[list[int]] = ()
    invalid_slots: Sequence[list[int]] = ()

    def add(self, req_id: str, num_computed: int, num_scheduled: int, token_start: int,
            tokens: list[int], first_slot: int) -> None:  # fmt: skip
        """Append one request (its token ids: positions ``[token_start, + len(tokens))``)."""
        self.req_ids.append(req_id)
        self.cols.extend((num_computed, num_scheduled, token_start, len(tokens), first_slot))
        self.tokens.extend(tokens)

    def pack(self) -> None:
        """More than PACK_MIN token ids (a prefill's) into ``packed``, ``tokens`` emptied:
        one ``struct.pack_into`` (~6 ns an id; numpy converts each Python int on its own,
        ~11-14), read by the worker as it is (``np.frombuffer``), and pickled between
        processes (tensor parallelism) as bytes: 2048 ids ~1 against ~60 us as a list."""
        num = len(self.tokens)
        if num > PACK_MIN:
            self.packed = bytearray(8 * num)
            _pack_into(f"{num}q", self.packed, 0, *self.tokens)
            self.tokens = []

    def column(self, col: int) -> list[int]:
        """Every request's value ``col`` (``COL_*``), in request order."""
        return self.cols[col::NUM_COLS]

    def final(self, req_id: str, start: int, tokens: list[int]) -> None:
        """Finished request ``req_id``'s token ids of positions ``[start, start +
        len(tokens))``, which it computed with the token not known yet."""
        if not self.final_req_ids:
            self.final_req_ids, self.final_starts, self.final_computed = [], [], []
            self.final_tokens = []
        cast(list[str], self.final_req_ids).append(req_id)
        cast(list[int], self.final_starts).append(start)
        cast(list[int], self.final_computed).append(start + len(tokens))
        cast(list[int], self.final_tokens).extend(tokens)

    def seal(self, req_id: str, start: int, end: int, slots: list[list[int]]) -> None:
        """Seal request ``req_id``'s positions ``[start, end)``: ``slots[g]``, their slots in
        group g (-1 where the group holds no block)."""
        if not self.seal_req_ids:
            self.seal_req_ids, self.seal_starts, self.seal_ends = [], [], []
            self.seal_slots = [[] for _ in slots]
        cast(list[str], self.seal_req_ids).append(req_id)
        cast(list[int], self.seal_starts).append(start)
        cast(list[int], self.seal_ends).append(end)
        for mine, theirs in zip(self.seal_slots, slots, strict=True):
            mine.extend(theirs)
