"""The worker side of the vLLM host: vLLM's KV cache groups as canary pools, and each step's
attention metadata as the canary's forward batches. Nothing here imports vLLM (the
connector, :mod:`.connector`, hands plain tensors and duck-typed metadata in), so it is
tested without vLLM too.

What crosses (host contract: :mod:`kvcanary.canary.host`)::

    vLLM (worker)                                    canary
    KV cache group g (layers, block size, window) -> VllmGroupPool (attacher below): one
                                                     canary group, FULL or SWA (window W)
    slot = block_id * block_size + offset            the group's slot index space; block 0
                                                     (vLLM's null block) -> slot 0 (none)
    attn_metadata[first layer of g]                  ForwardBatchView of group g:
      block_table, seq_lens, query_start_loc,          req->token rows rebuilt every step
      slot_mapping                                      from the block table attention reads
    connector metadata (scheduler side)              token ids (input ids, token mirror) and
                                                     the request of each batch row

Records: one set of HEAD/TAIL record buffers per block size, shared by every group of
that block size. vLLM allocates all groups' blocks from one block pool over one storage,
so a block holds one group's KV at a time and its records describe whoever wrote it last:
a block reused by any group while still in some request's window is caught by that
request's next verify.

Sliding groups: vLLM frees the blocks that leave a window without telling the worker (its
block table keeps the stale ids), so rows keep only positions ``>= K - W + 1`` (K: tokens
already computed), exactly the ones the scheduler keeps (``SlidingWindowManager``); a hole
inside that range is ``verify_not_resident``.

Real KV (record field 3) of a layer tensor:

    CPU layout  [num_blocks, kv_heads, block_size, 2 * head_size]: per (block, head) K is
                stored transposed [head_size, block_size], then V [block_size, head_size];
                only V rows are contiguous per token, so the K records fingerprint V of KV
                head 0, the V records (v_half) V of the last KV head.
    NHD layout  [2, num_blocks, block_size, kv_heads, head_size] (GPU flash-attention):
                K records fingerprint the token's K row (all heads), V records its V row.
    other       records only (a warning says so).
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import numba
import numpy as np
import torch

from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.attach.registry import AttachOptions, register_pool_attacher
from kvcanary.canary.attach.splice import BufInfos
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.errors import KVCanaryViolation
from kvcanary.canary.install import install_canary
from kvcanary.canary.manager import CanaryManager
from kvcanary.canary.wire.constants import MAX_REAL_KV_SOURCES, RealKvHashMode
from kvcanary.canary.wire.real_kv import RealKvSource, resolve_read_bytes
from kvcanary.canary.wire.records import alloc_canary_buffer
from kvcanary.integrations.vllm.meta import GroupSpec, StepMeta

logger = logging.getLogger("kvcanary.canary")


# ---------------------------------------------------------------------------- the pool


@dataclass(frozen=True)
class SharedRecords:
    """HEAD/TAIL record buffers over ``num_slots`` slots (V half only with ``with_v``)."""

    k_head: torch.Tensor
    k_tail: torch.Tensor
    v_head: torch.Tensor | None
    v_tail: torch.Tensor | None

    @staticmethod
    def allocate(num_slots: int, device: torch.device, with_v: bool) -> SharedRecords:
        def a() -> torch.Tensor:
            return alloc_canary_buffer(num_slots, device)

        return SharedRecords(a(), a(), a() if with_v else None, a() if with_v else None)

    @property
    def num_slots(self) -> int:
        return int(self.k_head.shape[0])


class VllmGroupPool:
    """The :class:`~kvcanary.canary.host.KVPool` of one vLLM KV cache group."""

    def __init__(self, spec: GroupSpec, layers: Sequence[torch.Tensor], records: SharedRecords):
        self.spec = spec
        self.layers = list(layers)
        self.records = records

    def get_contiguous_buf_infos(self) -> BufInfos:
        """vLLM ships KV through its own connectors, never by these; given for the protocol."""
        ptrs = [t.data_ptr() for t in self.layers]
        lens = [t.nbytes for t in self.layers]
        items = [t.nbytes // max(1, self.records.num_slots // self.spec.block_size)
                 for t in self.layers]  # fmt: skip
        return ptrs, lens, items

    def get_state_buf_infos(self) -> BufInfos:
        return [], [], []


def layer_sources(kv: torch.Tensor, spec: GroupSpec, mode: RealKvHashMode,
                  ) -> tuple[RealKvSource | None, RealKvSource | None]:  # fmt: skip
    """(K-records source, V-records source) of one layer tensor (module doc), or Nones."""
    if mode == RealKvHashMode.NONE or not kv.is_contiguous():
        return None, None
    es, bs, hs, heads = kv.element_size(), spec.block_size, spec.head_size, spec.num_kv_heads
    if kv.dim() == 4 and tuple(kv.shape[1:]) == (heads, bs, 2 * hs):  # CPU layout
        nb = kv.shape[0]
        rows = kv.view(nb, -1).view(torch.uint8)

        def v_rows(head: int) -> RealKvSource:
            off = (head * bs * 2 * hs + hs * bs) * es
            view = rows[:, off : off + bs * hs * es]
            return RealKvSource(view, bs, hs * es, resolve_read_bytes(mode, hs * es))

        return v_rows(0), v_rows(heads - 1)
    if kv.dim() == 5 and kv.shape[0] == 2 and tuple(kv.shape[2:]) == (bs, heads, hs):  # NHD
        nb, per_token = kv.shape[1], heads * hs * es

        def half(i: int) -> RealKvSource:
            view = kv[i].reshape(nb, -1).view(torch.uint8)
            return RealKvSource(view, bs, per_token, resolve_read_bytes(mode, per_token))

        return half(0), half(1)
    logger.warning(
        "kv-canary (vLLM): KV cache layout %s of group %d is not one the canary can "
        "fingerprint; records only (no real-KV check)", tuple(kv.shape), spec.index,
    )  # fmt: skip
    return None, None


def _attach_vllm_group(pool: VllmGroupPool, options: AttachOptions) -> list[CanaryBufferGroup]:
    spec, rec = pool.spec, pool.records
    chosen = pool.layers[:1] if options.real_data_layers == "first" else pool.layers
    chosen = chosen[:MAX_REAL_KV_SOURCES]
    pairs = [layer_sources(kv, spec, options.real_kv_mode) for kv in chosen]
    k_src = tuple(k for k, _ in pairs if k is not None)
    v_src = tuple(v for _, v in pairs if v is not None)
    group = CanaryBufferGroup(
        spec.kind, f"vllm_kv_cache_group_{spec.index}", spec.block_size,
        rec.k_head, rec.k_tail, rec.v_head, rec.v_tail,
        real_kv_sources_k=k_src, real_kv_sources_v=v_src if rec.v_head is not None else (),
        window=spec.sliding_window,
    )  # fmt: skip
    return [group]


register_pool_attacher(VllmGroupPool, _attach_vllm_group)


# ---------------------------------------------------------------------------- tables


class StepTables:
    """The req->token tables (one per group) and the token mirror, all groups sharing rows:
    each live request keeps one row (1 and up; row 0 = padding) from the first step it runs
    until it finishes. Its token ids go into the host store (``tokens`` / ``lens``, numpy)
    as the scheduler sends them (:meth:`VllmCanaryWorker.on_meta`); its req->token rows are
    refilled from the block tables every step it runs. On the CPU the mirror the canary
    reads (``token_ids`` / ``token_lens``) is the store itself; on another device the rows
    of a step's batch are copied there. Grown on demand (token ids kept)."""

    def __init__(self, num_groups: int, device: torch.device):
        self.device = device
        self.r2t = [torch.zeros(1, 1, dtype=torch.int64, device=device)
                    for _ in range(num_groups)]  # fmt: skip
        self.r2t_host = self._r2t_host()
        self.tokens = np.full((1, 1), -1, dtype=np.int64)
        self.lens = np.zeros(1, dtype=np.int64)
        self.token_ids, self.token_lens = self._mirror()

    def _r2t_host(self) -> list[np.ndarray]:
        """The req->token tables as numpy views (on the CPU; empty elsewhere)."""
        return [t.numpy() for t in self.r2t] if self.device.type == "cpu" else []

    def _mirror(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, lens = torch.from_numpy(self.tokens), torch.from_numpy(self.lens)
        if self.device.type == "cpu":
            return ids, lens
        return torch.full_like(ids, -1, device=self.device), lens.to(self.device)

    def ensure(self, rows: int, cols: int) -> None:
        have_rows, have_cols = self.tokens.shape
        if rows <= have_rows and cols <= have_cols:
            return
        rows = max(rows, 2 * have_rows) if rows > have_rows else have_rows
        cols = max(cols, 2 * have_cols) if cols > have_cols else have_cols
        for g in range(len(self.r2t)):
            self.r2t[g] = torch.zeros(rows, cols, dtype=torch.int64, device=self.device)
        self.r2t_host = self._r2t_host()
        tokens = np.full((rows, cols), -1, dtype=np.int64)
        tokens[:have_rows, :have_cols] = self.tokens
        lens = np.zeros(rows, dtype=np.int64)
        lens[:have_rows] = self.lens
        self.tokens, self.lens = tokens, lens
        self.token_ids, self.token_lens = self._mirror()

    def publish(self, rows: np.ndarray) -> None:
        """The mirror rows ``rows`` as the store holds them (off the CPU: copied over)."""
        if self.device.type != "cpu":
            idx = torch.from_numpy(rows).to(self.device)
            self.token_ids[idx] = torch.from_numpy(self.tokens[rows]).to(self.device)
            self.token_lens[idx] = torch.from_numpy(self.lens[rows]).to(self.device)


class GroupTableView:
    """The :class:`~kvcanary.canary.host.ReqToTokenTable` (+ TokenMirror) of one group."""

    def __init__(self, tables: StepTables, group: int):
        self._tables, self._group = tables, group

    @property
    def req_to_token(self) -> torch.Tensor:
        return self._tables.r2t[self._group]

    @property
    def token_ids(self) -> torch.Tensor:
        return self._tables.token_ids

    @property
    def token_lens(self) -> torch.Tensor:
        return self._tables.token_lens


@dataclass
class GroupHost:
    """The :class:`~kvcanary.canary.host.CanaryHost` of one group."""

    token_to_kv_pool: VllmGroupPool
    req_to_token_pool: GroupTableView
    device: torch.device
    sliding_window: int | None
    is_draft_worker: bool = False


class StepBatch:
    """A :class:`~kvcanary.canary.host.ForwardBatchView` of one group for one step: six
    tensors, or on the CPU their numpy arrays (``host_arrays``, which the canary reads),
    made into tensors only when something asks for one."""

    __slots__ = ("_tensors", "host_arrays")

    def __init__(self, tensors: tuple[torch.Tensor, ...] | None,
                 host_arrays: tuple[np.ndarray, ...] | None = None) -> None:  # fmt: skip
        self._tensors, self.host_arrays = tensors, host_arrays

    def _field(self, i: int) -> torch.Tensor:
        if self._tensors is None:
            self._tensors = tuple(torch.from_numpy(a) for a in cast(tuple, self.host_arrays))
        return self._tensors[i]

    req_pool_indices = property(lambda self: self._field(0))
    prefix_lens = property(lambda self: self._field(1))
    extend_seq_lens = property(lambda self: self._field(2))
    input_ids = property(lambda self: self._field(3))
    positions = property(lambda self: self._field(4))
    out_cache_loc = property(lambda self: self._field(5))


# ---------------------------------------------------------------------------- the worker


class VllmCanaryWorker:
    """Every group's canary on one vLLM worker; the connector's worker side drives it::

        on_meta(meta)                 bind_connector_metadata: tokens, finished requests
        before_forward(metadata)      first layer's wait_for_layer_load: HEAD (all groups)
        after_forward()               wait_for_save: TAIL, reports, abort-mode blocks
        take_invalid_blocks()         get_block_ids_with_load_errors (abort mode)
    """

    def __init__(self, config: CanaryConfig, specs: Sequence[GroupSpec],
                 layers: dict[str, torch.Tensor]):  # fmt: skip
        if not specs:
            raise ValueError("kv-canary (vLLM): the model has no KV cache group")
        self.config = config
        self.specs = list(specs)
        first = layers[self.specs[0].layer_names[0]]
        self.device = first.device
        self.num_blocks = int(first.shape[1] if first.dim() == 5 else first.shape[0])
        self.tables = StepTables(len(self.specs), self.device)
        records: dict[int, SharedRecords] = {}
        self.managers: list[CanaryManager] = []
        self.pools: list[VllmGroupPool] = []
        for spec in self.specs:
            if spec.block_size not in records:
                records[spec.block_size] = SharedRecords.allocate(
                    self.num_blocks * spec.block_size, self.device, config.v_half)
            pool = VllmGroupPool(spec, [layers[n] for n in spec.layer_names],
                                 records[spec.block_size])  # fmt: skip
            host = GroupHost(pool, GroupTableView(self.tables, spec.index), self.device,
                             spec.sliding_window)  # fmt: skip
            self.pools.append(pool)
            manager = install_canary(host, config)
            assert manager is not None  # parse_options refuses mode none
            if config.mode == "abort":
                manager.set_abort_handler(self._abort_handler(spec))
            manager.mark_init_finished()  # vLLM's warm-up runs carry no connector metadata
            self.managers.append(manager)
        self.records = records
        # The group whose slots identify a batch row's request: a full one if any.
        self._key_group = next((s.index for s in self.specs if s.sliding_window is None), 0)
        # Each live request's row of the tables (StepTables), rows free for reuse, rows lent
        # to this step's batch rows that match no request (given back after TAIL).
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._num_rows = 1  # row 0: padding
        self._lent: list[int] = []
        self._step = StepMeta()
        # This step's requests by the key group's slot of their first new token: (slots
        # sorted, their rows), for matching batch rows in one compiled pass.
        self._by_slot = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self._open: list[list[StepBatch]] | None = None
        self.num_dependent_passes = 0
        self._invalid_blocks: set[int] = set()
        self._unmatched_warned = False
        self.num_steps = 0

    # -------------------------------------------------------------- scheduler input
    def on_meta(self, meta: StepMeta) -> None:
        for rid in meta.finished:
            row = self._rows.pop(rid, None)
            if row is not None:
                self._free_rows.append(row)
        self._step = meta
        rows_of, tables = self._rows, self.tables
        rows = [rows_of.get(rid) or self._row(rid) for rid in meta.req_ids]  # (row 0: padding)
        end = max(map(operator.add, meta.token_starts, meta.token_counts), default=0)
        if end > tables.tokens.shape[1]:
            tables.ensure(self._num_rows, end)
        self._by_slot = _meta_nb(
            np.array(rows, dtype=np.int64), np.array(meta.first_slots, dtype=np.int64),
            np.array(meta.token_starts, dtype=np.int64), np.array(meta.token_counts, dtype=np.int64),
            np.array(meta.tokens, dtype=np.int64), tables.tokens, tables.lens,
        )  # fmt: skip

    def _row(self, rid: str) -> int:
        """Request ``rid``'s row of the tables (a fresh one the first time)."""
        row = self._rows.get(rid)
        if row is None:
            row = self._rows[rid] = self._take_row()
        return row

    def _take_row(self) -> int:
        """A row no live request holds, emptied (no token ids known)."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row, self._num_rows = self._num_rows, self._num_rows + 1
            self.tables.ensure(row + 1, 1)
        self.tables.tokens[row] = -1
        self.tables.lens[row] = 0
        return row

    # -------------------------------------------------------------- the forward
    def before_forward(self, metadata: Sequence[Any]) -> None:
        """HEAD of every group; ``metadata[g]``: group g's attention metadata (block_table,
        seq_lens, query_start_loc, slot_mapping).

        vLLM may serve a prefix hit on blocks that another row of the same step is filling
        (both rows' K/V are stored before attention reads): such a *dependent* row is
        checked in a second canary pass, once the rows it reads from wrote their records
        (at ``wait_for_save``; level ``L`` rows after level ``L - 1``)."""
        self._open = None  # a forward that raised before wait_for_save: drop it
        if self._lent:
            self._give_back_lent()
        md0, g = metadata[0], self._key_group
        tables = self.tables
        ql, prefix, seq, positions, max_seq, may_depend, rows, input_ids, unmatched = _batch_nb(
            _host(md0.query_start_loc), _host(md0.seq_lens), _host(metadata[g].slot_mapping),
            *self._by_slot, tables.tokens, tables.lens,
        )  # fmt: skip
        n, num_tokens, dev = ql.shape[0], positions.shape[0], self.device
        if unmatched:  # rows no first slot matched (rare): the slow path
            input_ids = self._unmatched_rows(rows, prefix, ql, num_tokens, input_ids)
        tables.ensure(self._num_rows, max_seq)
        outs = [self._group_rows(spec, md, n, num_tokens, prefix, seq, max_seq, rows)
                for spec, md in zip(self.specs, metadata, strict=True)]  # fmt: skip
        if dev.type == "cpu" and not may_depend:  # the usual step: numpy, no tensors made
            batches = [StepBatch(None, (rows, prefix, ql, input_ids, positions, out.numpy()))
                       for out in outs]  # fmt: skip
            for manager, batch in zip(self.managers, batches, strict=True):
                manager.before_forward(batch)
            self._open = [batches]
            return
        tables.publish(rows)
        row_idx, prefix_t, ql_t, positions_t, ids_t = (
            _tensor(a, dev) for a in (rows, prefix, ql, positions, input_ids))  # fmt: skip
        levels = [0] * n
        if may_depend:
            # Only a row that starts this step on a prefix (a prefix hit, a resumed
            # request: several new tokens after K > 0) can read blocks another row fills.
            token_rows = torch.repeat_interleave(torch.arange(n), ql_t.cpu(),
                                                 output_size=num_tokens)  # fmt: skip
            deps: list[set[int]] = [set() for _ in range(n)]
            pos = torch.arange(max_seq, device=dev)
            for spec, out in zip(self.specs, outs, strict=True):
                table = tables.r2t[spec.index][row_idx, :max_seq]
                verify_slots = torch.where(pos[None, :] < prefix_t[:, None], table, 0)
                self._add_dependencies(deps, verify_slots, out, token_rows)
            levels = _levels(deps)
        passes = []
        for level in range(max(levels, default=0) + 1):
            idx = row_idx if level == 0 and not any(levels) else torch.where(
                torch.tensor(levels, device=dev) == level, row_idx, 0)  # fmt: skip
            passes.append([StepBatch((idx, prefix_t, ql_t, ids_t, positions_t, out))
                           for out in outs])  # fmt: skip
        for manager, batch in zip(self.managers, passes[0], strict=True):
            manager.before_forward(batch)
        self._open = passes

    def after_forward(self) -> None:
        """TAIL of every group, then the dependent passes (HEAD + TAIL), then the reports
        (``raise``: after every group closed)."""
        if self._open is None:
            return
        passes, self._open = self._open, None
        error: KVCanaryViolation | None = None
        for i, batches in enumerate(passes):
            for manager, batch in zip(self.managers, batches, strict=True):
                if i > 0:
                    manager.before_forward(batch)
                try:
                    manager.after_forward(batch)
                except KVCanaryViolation as e:
                    error = error or e
        for manager in self.managers:
            manager.end_step()
        self._give_back_lent()
        self.num_steps += 1
        self.num_dependent_passes += len(passes) - 1
        if error is not None:
            raise error

    @staticmethod
    def _add_dependencies(deps: list[set[int]], verify_slots: torch.Tensor, out: torch.Tensor,
                          token_rows: torch.Tensor) -> None:  # fmt: skip
        """deps[r] += the rows that write (this step) a slot row r verifies."""
        written = out >= 0
        if not bool(written.any()):
            return
        hit = torch.isin(verify_slots, out[written]) & (verify_slots > 0)
        if not bool(hit.any()):  # the usual step: one check per group
            return
        writer = dict(zip(out[written].tolist(), token_rows[written.cpu()].tolist(), strict=True))
        for r, slot in zip(*torch.nonzero(hit, as_tuple=True), strict=True):
            w = writer[int(verify_slots[r, slot])]
            if w != int(r):
                deps[int(r)].add(w)

    def flush(self) -> None:
        for manager in self.managers:
            manager.flush()

    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    # -------------------------------------------------------------- helpers
    def _abort_handler(self, spec: GroupSpec) -> Callable[[torch.Tensor, torch.Tensor], list[int]]:
        def handler(full: torch.Tensor, swa: torch.Tensor) -> list[int]:
            slots = torch.cat([full.long(), swa.long()]).tolist()
            self._invalid_blocks.update(s // spec.block_size for s in slots
                                        if s >= spec.block_size)  # fmt: skip
            return []  # vLLM fails / recomputes them after get_block_ids_with_load_errors

        return handler

    def _give_back_lent(self) -> None:
        self._free_rows.extend(self._lent)
        self._lent = []

    def _unmatched_rows(self, rows: np.ndarray, prefix: np.ndarray, ql: np.ndarray,
                        num_tokens: int, input_ids: np.ndarray) -> np.ndarray:  # fmt: skip
        """Rows (-1 in ``rows``) whose first new token's slot is no scheduled request's: the
        request with their (computed, scheduled) counts, when it is the only one; else a row
        of their own for this step (no token ids known). Fills ``rows`` in; the step's input
        ids again when a request was found."""
        found, step = False, self._step
        for r in np.flatnonzero(rows < 0).tolist():
            k, e = int(prefix[r]), int(ql[r])
            cands = [rid for rid, k2, e2 in zip(step.req_ids, step.num_computed,
                                                step.num_scheduled, strict=True)
                     if k2 == k and e2 == e]  # fmt: skip
            if len(cands) == 1:
                rows[r], found = self._row(cands[0]), True
                continue
            if not self._unmatched_warned:
                self._unmatched_warned = True
                logger.warning("kv-canary (vLLM): batch row %d matches no scheduled request; "
                               "its token ids are not checked", r)  # fmt: skip
            rows[r] = self._take_row()
            self._lent.append(int(rows[r]))
        if not found:
            return input_ids
        return _input_ids_nb(self.tables.tokens, self.tables.lens, rows, prefix, ql, num_tokens)

    def _group_rows(self, spec: GroupSpec, md: Any, n: int, num_tokens: int,
                    prefix: np.ndarray, seq: np.ndarray, max_seq: int,
                    rows: np.ndarray) -> torch.Tensor:  # fmt: skip
        """The batch rows' req->token rows of the group (batch row r -> table row
        ``rows[r]``) from the block table attention reads: position p ->
        ``block_table[r, p // bs] * bs + p % bs``, 0 for the null block, past the sequence
        and (sliding groups) before ``K - W + 1``; returns the step's slots of the group
        (``slot_mapping``, -1 for padding and the null block)."""
        bs, tables = spec.block_size, self.tables
        window = spec.sliding_window or 0
        if self.device.type == "cpu":  # one compiled pass (the per-step path on CPU)
            return torch.from_numpy(_group_rows_nb(
                md.block_table.numpy(), md.slot_mapping.numpy(), seq, prefix, bs, window,
                tables.r2t_host[spec.index], rows, num_tokens))  # fmt: skip
        table = tables.r2t[spec.index]
        row_idx = torch.from_numpy(rows).to(self.device)
        bt = md.block_table[:n].long()
        seq_t = torch.from_numpy(seq).to(self.device)
        prefix_t = torch.from_numpy(prefix).to(self.device)
        pos = torch.arange(max_seq, dtype=torch.int64, device=self.device)
        idx = torch.clamp(pos // bs, max=max(bt.shape[1] - 1, 0))
        blocks = bt[:, idx]
        valid = (pos[None, :] < seq_t[:, None]) & (blocks != 0)
        if window:  # positions the scheduler keeps (module doc)
            valid &= pos[None, :] >= (prefix_t - window + 1)[:, None]
        table[row_idx, :max_seq] = torch.where(valid, blocks * bs + pos % bs, 0)
        out = md.slot_mapping[:num_tokens].long()
        return torch.where(out >= bs, out, -1)  # padding / the null block

    # -------------------------------------------------------------- inspection
    def stats(self) -> dict[str, Any]:
        """Every group's :meth:`CanaryManager.stats`, and their sums."""
        per_group = [m.stats() for m in self.managers]
        total = {k: sum(s[k] for s in per_group)
                 for k in ("protected_tokens", "verify_entries", "write_entries", "violations",
                           "violations_reported", "verify_overflow_steps")}  # fmt: skip
        return {**total, "steps": self.num_steps,
                "dependent_passes": self.num_dependent_passes, "groups": per_group}  # fmt: skip

    @property
    def violations(self) -> list[Any]:
        return [row for m in self.managers for row in m.violations]

    @property
    def reporter(self) -> Any:
        """Every group's reported rows (what :class:`~kvcanary.canary.report.metrics.CanaryCollector`
        reads, with :meth:`collector_stats`)."""
        return SimpleNamespace(rows=self.violations)

    def collector_stats(self) -> dict[str, Any]:
        """The keys :class:`~kvcanary.canary.report.metrics.CanaryCollector` reads, summed."""
        by_tag: Counter[str] = Counter()
        for m in self.managers:
            by_tag.update(m.stats()["verify_entries_by_tag"])
        stats = self.stats()
        return {"violations": stats["violations"], "protected_tokens": stats["protected_tokens"],
                "verify_entries_by_tag": dict(by_tag), "sweep_passes": 0,
                "swa_divergence": {}}  # fmt: skip


class MetricsView:
    """A :class:`VllmCanaryWorker` as :class:`~kvcanary.canary.report.metrics.CanaryCollector`'s
    ``canary`` (``stats()`` and ``reporter.rows``)."""

    def __init__(self, worker: VllmCanaryWorker):
        self._worker = worker

    def stats(self) -> dict[str, Any]:
        return self._worker.collector_stats()

    @property
    def reporter(self) -> Any:
        return self._worker.reporter


def _levels(deps: list[set[int]], max_level: int = 8) -> list[int]:
    """Pass of each row: 0 without dependencies, else 1 + the deepest row it reads from."""
    levels = [0] * len(deps)
    if not any(deps):
        return levels
    for _ in range(max_level):
        new = [max((levels[w] + 1 for w in d), default=0) for d in deps]
        new = [min(v, max_level) for v in new]
        if new == levels:
            break
        levels = new
    return levels


def _host(t: torch.Tensor) -> np.ndarray:
    """``t`` as host numpy (a view on the CPU)."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)


@numba.njit(cache=True)
def _batch_nb(qsl, seq_lens, key_slots, keys, key_rows, tokens, lens):
    """A step's batch from ``qsl`` (query start locations [n + 1], from 0) and ``seq_lens``
    ([>= n]): per row its new tokens ``ql``, the tokens computed before them ``prefix`` and
    their sum; each token's position; the longest sequence (1 without rows); whether some
    row starts on a prefix with several new tokens (and there are rows to share it); each
    row's table row (``key_rows[i]`` where ``keys[i]``, sorted, is the key group's slot
    ``key_slots`` of its first new token; -1 where none is); the input ids from the token
    store (-1 where not known yet, and for unmatched rows); whether some row is unmatched."""
    n = qsl.shape[0] - 1
    num_tokens = max(qsl[n], 0)
    ql = np.empty(n, dtype=np.int64)
    prefix = np.empty(n, dtype=np.int64)
    rows = np.full(n, -1, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    max_seq = 0 if n else 1
    may_depend = unmatched = False
    at = 0
    for r in range(n):
        e = np.int64(qsl[r + 1] - qsl[r])
        k = np.int64(seq_lens[r]) - e
        ql[r], prefix[r] = e, k
        max_seq = max(max_seq, np.int64(seq_lens[r]))
        may_depend |= e > 1 and k > 0
        for i in range(e):
            positions[at + i] = k + i
        if e > 0 and at < key_slots.shape[0]:
            i = np.searchsorted(keys, np.int64(key_slots[at]))
            if i < keys.shape[0] and keys[i] == key_slots[at]:
                rows[r] = key_rows[i]
        unmatched |= rows[r] < 0
        at += e
    ids = _input_ids_nb(tokens, lens, rows, prefix, ql, num_tokens)
    return ql, prefix, prefix + ql, positions, max_seq, may_depend and n > 1, rows, ids, unmatched


@numba.njit(cache=True)
def _meta_nb(rows, first_slots, starts, counts, tokens, store, lens):
    """:meth:`VllmCanaryWorker.on_meta`'s columns: each request's token ids into its row of
    the token store (``store``, lengths ``lens``: the known prefix grows); returns (the
    first slots that are allocated, sorted; their requests' rows)."""
    at = 0
    for i in range(rows.shape[0]):
        row, start, count = rows[i], starts[i], counts[i]
        for j in range(count):
            store[row, start + j] = tokens[at + j]
        at += count
        if start + count > lens[row]:
            lens[row] = start + count
    keep = first_slots >= 0
    keys, key_rows = first_slots[keep], rows[keep]
    order = np.argsort(keys, kind="mergesort")  # (stable: the first of equal slots first)
    return keys[order], key_rows[order]


@numba.njit(cache=True)
def _input_ids_nb(tokens, lens, rows, prefix, ql, num_tokens):
    """This step's input ids from the token store (-1 where not known yet, and for rows
    without a table row, -1)."""
    ids = np.full(num_tokens, -1, dtype=np.int64)
    at = 0
    for r in range(rows.shape[0]):
        k, row = prefix[r], rows[r]
        if row >= 0:
            for i in range(max(min(lens[row], k + ql[r]) - k, 0)):
                ids[at + i] = tokens[row, k + i]
        at += ql[r]
    return ids


@numba.njit(cache=True)
def _group_rows_nb(bt, slot_mapping, seq, prefix, bs, window, table, rows, num_tokens):
    """:meth:`VllmCanaryWorker._group_rows` on the CPU (batch row r -> table row
    ``rows[r]``; only positions < seq[r] are written, the planner reads no further)."""
    nb = bt.shape[1]
    for r in range(seq.shape[0]):
        lo = max(0, prefix[r] - window + 1) if window > 0 else 0
        row = rows[r]
        for p in range(seq[r]):
            bi = p // bs
            b = bt[r, bi] if bi < nb else 0
            table[row, p] = b * bs + p % bs if (b != 0 and p >= lo) else 0
    out = np.empty(min(num_tokens, slot_mapping.shape[0]), dtype=np.int64)
    for t in range(out.shape[0]):
        s = slot_mapping[t]
        out[t] = s if s >= bs else -1
    return out
