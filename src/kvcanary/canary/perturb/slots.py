"""Where a fault can land: live slots of the batch's requests and cached slots nobody holds.

All pickers read host copies (the perturbation runs outside the forward, on the host).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvcanary.canary.plan.state import StateRing
from kvcanary.canary.wire.constants import REQ_POOL_IDX_PADDING


class PrefixEntry(NamedTuple):
    req_pool_idx: int
    position: int
    slot: int  # full-pool slot (req_to_token value)


def prefix_entries(fb: Any, req_to_token: torch.Tensor, window: int | None = None) -> list[PrefixEntry]:
    """Committed entries ``[start, prefix_len)`` of the batch's real rows (``start`` = 0, or
    ``prefix_len - window`` for in-window entries), slot 0 excluded."""
    rows = fb.req_pool_indices.tolist()
    prefix = fb.prefix_lens.tolist()
    out = []
    for row, k in zip(rows, prefix, strict=True):
        if row == REQ_POOL_IDX_PADDING or k <= 0:
            continue
        start = max(0, k - window) if window else 0
        slots = req_to_token[row, start:k].tolist()
        out += [PrefixEntry(row, start + j, s) for j, s in enumerate(slots) if s > 0]
    return out


def complete_blocks(entries: list[PrefixEntry], ratio: int) -> list[PrefixEntry]:
    """The entries that close a ``ratio`` block (position ``ratio - 1`` mod ``ratio``): their
    full slot // ratio is a complete compressed entry (blocks never straddle pages)."""
    return [e for e in entries if e.position % ratio == ratio - 1]


def live_ring_rows(fb: Any, req_to_token: torch.Tensor, ring: StateRing, lut: torch.Tensor | None,
                   after_forward: bool = False) -> list[int]:  # fmt: skip
    """Compress-state rows of the batch's live tails that a TAIL verify fingerprints (see
    :mod:`kvcanary.canary.plan.state`): before the forward, the tail of each prefix ``L`` the
    forward does not take over (positions ``>= L + E - ring_size``); after it, the tail of
    ``L + E`` a one-token decode keeps (``>= L + E + 1 - ring_size``). Rows whose SWA slot is
    gone are left out."""
    out: list[int] = []
    rows, prefix = fb.req_pool_indices.tolist(), fb.prefix_lens.tolist()
    for row, k, e in zip(rows, prefix, fb.extend_seq_lens.tolist(), strict=True):
        if row == REQ_POOL_IDX_PADDING:
            continue
        length = k + e if after_forward else k
        tail = int(ring.tail_len(torch.tensor([length]))[0])
        first = max(length - tail, (length + 1 if after_forward else k + e) - ring.ring_size)
        positions = torch.arange(max(first, 0), length)
        if positions.numel() == 0:
            continue
        slots = req_to_token[row, positions].long()
        swa = None if lut is None or ring.addressing == "request" else lut[slots].long()
        ring_rows = ring.row(torch.full_like(positions, row), positions, swa)
        keep = slots > 0 if swa is None else swa > 0
        out += ring_rows[keep].tolist()
    return out


class WriteEntry(NamedTuple):
    token_index: int  # index into the batch's flat token arrays
    req_pool_idx: int
    position: int
    slot: int


def write_entries(fb: Any) -> list[WriteEntry]:
    """The tokens this forward writes, for the batch's real rows."""
    rows = fb.req_pool_indices.tolist()
    extend = fb.extend_seq_lens.tolist()
    positions = fb.positions.tolist()
    locs = fb.out_cache_loc.tolist()
    out, start = [], 0
    for row, n in zip(rows, extend, strict=True):
        if row != REQ_POOL_IDX_PADDING:
            out += [WriteEntry(i, row, positions[i], locs[i]) for i in range(start, start + n)]
        start += n
    return out


def unlocked_cached_slots(cache: Any, lut: torch.Tensor | None = None) -> list[int]:
    """Full slots of cached prefix nodes no running request locks (SGLang's "orphan" slots).
    With ``lut`` (an SWA target): only nodes whose SWA part is resident (not tombstoned) and
    slots with an SWA slot."""
    if cache is None:
        return []
    out: list[int] = []
    for node, _, value in cache.iter_cached():
        if getattr(node, "lock_ref", 0) != 0:
            continue
        if lut is not None and getattr(node, "tombstone", False):
            continue
        slots = value.reshape(-1).long()
        if lut is not None:
            slots = slots[lut[slots] > 0]
        out += slots.tolist()
    return out
