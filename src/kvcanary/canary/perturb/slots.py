"""Where a fault can land: live slots of the batch's requests and cached slots nobody holds.

All pickers read host copies (the perturbation runs outside the forward, on the host).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvcanary.canary.constants import REQ_POOL_IDX_PADDING


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
