"""Canary buffers: one 32-byte record per KV slot, stored as raw little-endian bytes.

A canary buffer is a ``uint8 [num_slots, slot_bytes]`` tensor (``slot_bytes >= 32``, a
multiple of 8; bytes past 32 are ignored). Kernels work on the int64 view
``[num_slots, slot_bytes // 8]`` whose columns 0..3 are the fields of
:mod:`kvcanary.canary.wire.constants`. Slot 0 is reserved padding and never verified.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcanary.canary.wire.constants import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    CANARY_SLOT_BYTES,
)


class SlotRecord(NamedTuple):
    token: int
    position: int
    prev_hash: int  # signed int64 bits
    real_kv_hash: int  # signed int64 bits


def alloc_canary_buffer(num_slots: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed ``uint8 [num_slots, 32]`` canary buffer."""
    if num_slots < 1:
        raise ValueError(f"canary buffer num_slots={num_slots}; allowed: >= 1")
    return torch.zeros(num_slots, CANARY_SLOT_BYTES, dtype=torch.uint8, device=device)


def as_int64_records(buf: torch.Tensor) -> torch.Tensor:
    """The int64 ``[num_slots, slot_bytes // 8]`` view of a canary buffer (shares memory)."""
    if (
        buf.dtype != torch.uint8
        or buf.dim() != 2
        or buf.shape[1] < CANARY_SLOT_BYTES
        or buf.shape[1] % 8
        or buf.stride(1) != 1
    ):
        raise ValueError(
            f"canary buffer must be uint8 [num_slots, >=32 bytes, multiple of 8] with unit "
            f"column stride, got dtype={buf.dtype} shape={tuple(buf.shape)} stride={buf.stride()}"
        )
    return buf.view(torch.int64)


def read_record(buf: torch.Tensor, slot: int) -> SlotRecord:
    """Host copy of one slot's record (a device sync on accelerators)."""
    row = as_int64_records(buf)[slot].tolist()
    return SlotRecord(
        token=row[CANARY_FIELD_TOKEN],
        position=row[CANARY_FIELD_POSITION],
        prev_hash=row[CANARY_FIELD_PREV_HASH],
        real_kv_hash=row[CANARY_FIELD_REAL_KV_HASH],
    )
