"""Plans of the compress-state groups: DeepSeek-V4 compressor rings.

A compressed layer does not compress a window until its last token arrives; until then the
window's raw per-token compressor state (kv and score, fp32) waits in a ring of rows. One
row holds one token's state, written once by the forward that processes the token and left
alone until a later token of the same ring takes the row. Only a request's *live tail* is
ever read back: with ``L`` tokens committed, the positions ::

    tail(L) = [L - t, L),  t = min(L, L % ratio + (ratio if overlap else 0), ring_size)

C4 (overlap): the open window and the one before it, 4..7 positions; C128: the open window,
0..127 positions (SGLang's online C128 keeps one running row, ``ring_size`` 1: the last
position only). The last ``ring_size`` positions of a request map to distinct rows, so every
tail row holds its own token's state. A row is addressed in one of two ways
(:class:`StateRing`)::

    swa_page   row = (s // P) * ring_size + s % ring_size,  s = full->SWA LUT[req_to_token]
               (kvcanary's DSV4KVPool: every ring; SGLang: the C4 and C4-indexer rings)
    request    row = req_pool_idx * ring_size + position % ring_size
               (SGLang: the C128 ring, request-scoped)

A state group keeps one 32-byte record per row, like any group: the token whose state the
row holds, its position and the request's chain hash before it, and (TAIL) the fingerprint
of the row's bytes. Per forward, per request (prefix ``L``, extend ``E``):

* verify (HEAD) the tail of ``L``: each entry chained to the previous position's row while
  that is still one of the last ``ring_size`` positions (beyond, the row was reused:
  predecessor unreachable, chain check skipped), from the anchor at position 0;
* write every new token ``[L, L + E)`` into its row, chained from the row of ``L - 1`` (always
  one of the last ``ring_size`` positions); tokens that share a row keep the last one, as
  the ring itself does;
* verify (TAIL) only the tail entries this forward did not take over: positions
  ``>= L + E - ring_size``; the others now hold a newer token's state.

Real-KV fingerprints (TAIL) bind each row's bytes to its record, so a byte flip in a live
row, a row written to the wrong place or a stale row shows up at the next forward's HEAD.
The plans are materialised (flat tensors, any device); a forward verifies at most
``ring_size`` entries per request, so their cost does not grow with the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvcanary.canary.plan.types import CanaryPlans, PlanInputs, VerifyPlan, WritePlan
from kvcanary.canary.wire.constants import NO_SLOT, NO_TOKEN, REQ_POOL_IDX_PADDING

StateAddressing = Literal["swa_page", "request"]
STATE_ADDRESSINGS: tuple[StateAddressing, ...] = ("swa_page", "request")


@dataclass(frozen=True)
class StateRing:
    """How a compress-state sub-pool lays out its rings (module doc)."""

    ratio: int  # the compression ratio the ring feeds: 4 or 128
    ring_size: int  # rows per ring
    addressing: StateAddressing
    overlap: bool = False  # C4: the window before the open one is still read
    swa_page_size: int = 0  # swa_page addressing: SWA slots per page (one ring per page)

    def __post_init__(self) -> None:
        if self.addressing not in STATE_ADDRESSINGS:
            raise ValueError(
                f"StateRing.addressing={self.addressing!r}; allowed: {', '.join(STATE_ADDRESSINGS)}"
            )
        if self.ratio < 2 or self.ring_size < 1:
            raise ValueError(
                f"StateRing(ratio={self.ratio}, ring_size={self.ring_size}); allowed: ratio >= 2, "
                "ring_size >= 1"
            )
        if self.addressing == "swa_page" and self.swa_page_size < 1:
            raise ValueError(
                f"StateRing.swa_page_size={self.swa_page_size}; allowed: >= 1 (SWA slots per "
                "page: one ring per page)"
            )

    def tail_len(self, seq_len: torch.Tensor) -> torch.Tensor:
        """Live-tail length after ``seq_len`` committed tokens (int64, elementwise)."""
        open_window = seq_len % self.ratio + (self.ratio if self.overlap else 0)
        return torch.minimum(torch.minimum(seq_len, open_window), torch.full_like(seq_len,
                             self.ring_size))  # fmt: skip

    def row(self, req_rows: torch.Tensor, positions: torch.Tensor,
            swa_slots: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """Ring row of each token (module doc): ``request`` addressing reads the request row
        and position, ``swa_page`` the token's SWA slot (int64, elementwise)."""
        if self.addressing == "request":
            return req_rows.long() * self.ring_size + positions.long() % self.ring_size
        if swa_slots is None:
            raise ValueError("kv-canary: a swa_page compress-state ring row needs the SWA slot")
        swa = swa_slots.long()
        return (swa // self.swa_page_size) * self.ring_size + swa % self.ring_size


def build_state_plans(
    inputs: PlanInputs,
    ring: StateRing,
    lut: torch.Tensor | None,
    *,
    kv_token_id_vs_position_offset: int = 0,
) -> CanaryPlans:
    """HEAD verify, write and TAIL verify plans of one state group (module doc).

    ``lut``: the full->SWA mapping (``swa_page`` addressing; ignored for ``request``).
    """
    if ring.addressing == "swa_page" and lut is None:
        raise ValueError("kv-canary: a swa_page compress-state ring needs the full->SWA LUT")
    device = inputs.req_pool_indices.device
    rows = inputs.req_pool_indices.long()
    real = rows != REQ_POOL_IDX_PADDING
    prefix = inputs.prefix_lens.long().clamp(min=0)
    extend = inputs.extend_lens.long().clamp(min=0)
    r2t = inputs.req_to_token

    def row_of(req_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Ring row of each (request row, position); 0 where the SWA slot is gone."""
        swa = None
        if ring.addressing == "swa_page" and lut is not None:
            swa = lut[r2t[req_rows, positions].long()]
        return ring.row(req_rows, positions, swa)

    # ---- verify: the live tail of the committed prefix
    tail = torch.where(real, ring.tail_len(prefix), 0)
    n = int(tail.sum())
    owner = torch.repeat_interleave(torch.arange(rows.shape[0], device=device), tail,
                                    output_size=n)  # fmt: skip
    first = torch.cumsum(tail, 0) - tail
    pos = (prefix - tail)[owner] + torch.arange(n, device=device) - first[owner]
    req = rows[owner]
    slots = row_of(req, pos)
    prev_pos = pos - 1
    reachable = prev_pos >= prefix[owner] - ring.ring_size
    prev = torch.where(reachable & (pos > 0), row_of(req, prev_pos.clamp(min=0)), 0)
    prev = torch.where(pos == 0, NO_SLOT, prev)
    expected = _expected_tokens(inputs, req, pos, owner, kv_token_id_vs_position_offset)
    head_verify = VerifyPlan(slots, prev, pos, expected, True, n)
    survives = pos >= (prefix + extend)[owner] - ring.ring_size
    tail_verify = VerifyPlan(slots[survives], prev[survives], pos[survives],
                             expected[survives], True, int(survives.sum()))  # fmt: skip

    # ---- write: every new token into its row, chained from the row of position L - 1
    num_flat = inputs.input_ids.shape[0]
    token_starts = torch.cumsum(extend, 0) - extend
    num_tokens = torch.where(real, extend, 0)
    owner_t = torch.repeat_interleave(torch.arange(rows.shape[0], device=device), extend,
                                      output_size=int(extend.sum()))  # fmt: skip
    flat_pos = inputs.positions.long()
    swa_written = (lut[inputs.out_cache_loc[: owner_t.shape[0]].long()]
                   if ring.addressing == "swa_page" and lut is not None else None)  # fmt: skip
    written = ring.row(rows[owner_t], flat_pos[: owner_t.shape[0]], swa_written)
    write_slots = torch.full((num_flat,), NO_SLOT, dtype=torch.int64, device=device)
    write_slots[: owner_t.shape[0]] = written
    seed_pos = (prefix - 1).clamp(min=0)
    has_seed = real & (prefix > 0) & (extend > 0)
    seeds = torch.where(has_seed, row_of(torch.where(has_seed, rows, 0), seed_pos), NO_SLOT)
    write = WritePlan(
        seeds, token_starts, num_tokens, inputs.input_ids.long(), flat_pos, write_slots,
        int(num_tokens.max()) if num_tokens.numel() else 0, int(num_tokens.sum()),
        _long(inputs.expected_input_ids), _long(inputs.expected_positions),
    )  # fmt: skip
    return CanaryPlans(head_verify, write, None, tail_verify)


def _long(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.long()


def _expected_tokens(
    inputs: PlanInputs, req: torch.Tensor, pos: torch.Tensor, owner: torch.Tensor, offset: int
) -> torch.Tensor:
    table, lens = inputs.expected_token_table, inputs.expected_token_lens
    if table is None or lens is None:
        return torch.full_like(pos, NO_TOKEN)
    idx = pos + offset
    limit = lens.long()[owner].clamp(max=table.shape[1])
    ok = (idx >= 0) & (idx < limit)
    return torch.where(ok, table[req, idx.clamp(0, table.shape[1] - 1)].long(), NO_TOKEN)
