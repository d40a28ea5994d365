"""MHAKVPool: per-layer K and V storage for one token pool.

Each layer owns ``k_buffer[l]`` / ``v_buffer[l]`` of shape
``[size + page_size, num_kv_heads, head_dim]``; rows ``[0, page_size)`` are the
reserved sink page (padded writes land there, nothing reads them). The pool only
stores: which slots are live is the allocator's business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcanary.memory.base import BufInfos, KVPairPool, resolve_device
from kvcanary.utils import buf_infos


class BaseKVPool:
    """Common base of the pools; their contract is :class:`~kvcanary.memory.base.KVPool`.
    Host copies are :mod:`~kvcanary.memory.host_pool`'s functions, not pool methods."""

    size: int
    page_size: int
    device: torch.device

    def __init__(self) -> None:
        # Bumped at the start of every model forward / graph replay (see ModelRunner).
        self.forward_epoch = 0

    def begin_forward(self) -> None:
        self.forward_epoch += 1

    def invalidate_loc_cache(self) -> None:
        """No translation cache here; SWA pools override. Safe to call any time."""

    def get_contiguous_buf_infos(self) -> BufInfos:
        raise NotImplementedError

    def get_state_buf_infos(self) -> BufInfos:
        return [], [], []


class MHAKVPool(BaseKVPool):
    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ):
        super().__init__()
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.layer_num = layer_num
        self.device = resolve_device(device)  # what register_slot_buffer compares with
        rows = size + page_size
        self.k_buffer = [
            torch.zeros((rows, head_num, head_dim), dtype=dtype, device=self.device)
            for _ in range(layer_num)
        ]
        self.v_buffer = [
            torch.zeros((rows, head_num, self.v_head_dim), dtype=dtype, device=self.device)
            for _ in range(layer_num)
        ]
        self.extra_slot_buffers: list[torch.Tensor] = []

    def register_slot_buffer(self, buf: torch.Tensor) -> None:
        """Attach a per-slot sidecar (row ``i`` describes slot ``i``, e.g. the canary's
        ``[num_slots, 32]`` uint8 records) that host copies carry along with K/V.

        The pool does not read or write it. A copy loads only into a pool with the same
        sidecars registered, so register before the first copy is taken.
        """
        if buf.shape[0] != self.num_slots or buf.device != self.device:
            raise ValueError(
                f"slot buffer shape={tuple(buf.shape)} device={buf.device}: needs "
                f"{self.num_slots} rows on {self.device}"
            )
        self.extra_slot_buffers.append(buf)

    @property
    def num_slots(self) -> int:
        """Rows per layer buffer, including the reserved sink page."""
        return self.size + self.page_size

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        loc = loc.to(torch.int64)
        self.k_buffer[layer_id].index_copy_(0, loc, k if k.dtype == self.dtype else k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, v if v.dtype == self.dtype else v.to(self.dtype))

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        for k, v in zip(self.k_buffer, self.v_buffer, strict=True):
            k[tgt_loc] = k[src_loc]
            v[tgt_loc] = v[src_loc]

    def get_kv_size_bytes(self) -> tuple[int, int]:
        return sum(b.nbytes for b in self.k_buffer), sum(b.nbytes for b in self.v_buffer)

    def get_contiguous_buf_infos(self) -> BufInfos:
        """All K buffers first, then all V buffers."""
        return buf_infos(self.k_buffer + self.v_buffer, self.page_size)

    def all_buffers(self) -> list[torch.Tensor]:
        """Buffers in buf-info order (all K, then all V)."""
        return self.k_buffer + self.v_buffer


if TYPE_CHECKING:  # mypy: the contracts of kvcanary.memory.base hold
    _mha: type[KVPairPool] = MHAKVPool
