"""SWAKVPool: a full sub-pool for full-attention layers and a smaller SWA sub-pool for
sliding-window layers, joined by the allocator-owned full→SWA mapping.

Callers always speak full-pool slot ids; SWA layers read/write the SWA sub-pool at
``mapping[full_loc]``. The mapping registration and the per-forward translation cache
live in :class:`BaseSWAKVPool`, shared with the DeepSeek-V4-style pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvcanary.memory.base import BufInfos, KVPairPool, WindowedKVPool
from kvcanary.memory.mha_pool import BaseKVPool, MHAKVPool

if TYPE_CHECKING:
    from kvcanary.memory.swa_mapping import SwaIndexMapping


class BaseSWAKVPool(BaseKVPool):
    """A pool whose SWA-side storage is addressed through the allocator-owned full→SWA
    mapping (:class:`SWAKVPool`, :class:`~kvcanary.memory.dsv4_pool.DSV4KVPool`).

    ``translate_loc_from_full_to_swa`` is memoised for at most one forward: the cache key is
    ``(loc.data_ptr(), numel, stride, dtype, mapping.version, forward_epoch)``, so a hit needs
    the same view (not merely the same storage), an unmutated mapping and the same forward.
    The entry keeps ``loc`` alive: a freed index tensor's address cannot be recycled by a new
    tensor with other contents while the entry could still match it. ``translation_stats``
    counts hits, misses and gathers.
    """

    def __init__(self) -> None:
        super().__init__()
        self._mapping: SwaIndexMapping | None = None
        self._cache_key: tuple[object, ...] | None = None
        self._cache_loc: torch.Tensor | None = None  # held only to pin the key's address
        self._cache_val: torch.Tensor | None = None
        self.translation_stats: dict[str, int] = {"hits": 0, "misses": 0, "gathers": 0}

    def register_mapping(self, mapping: SwaIndexMapping) -> None:
        """Adopt the allocator's mapping (same object for the pool's life)."""
        self._mapping = mapping
        self.invalidate_loc_cache()

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor:
        return self._registered().tensor

    def _registered(self) -> SwaIndexMapping:
        if self._mapping is None:
            raise RuntimeError(
                f"{type(self).__name__}: no mapping registered (build the SWAAllocator first)"
            )
        return self._mapping

    @property
    def mapping_version(self) -> int:
        return self._mapping.version if self._mapping is not None else -1

    def invalidate_loc_cache(self) -> None:
        self._cache_key = self._cache_loc = self._cache_val = None

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """``mapping[loc]`` (−1 → −1), gathered at most once per forward for one view."""
        key = (
            loc.data_ptr(),
            loc.numel(),
            *loc.stride(),
            loc.dtype,
            self.mapping_version,
            self.forward_epoch,
        )
        if key == self._cache_key and self._cache_val is not None:
            self.translation_stats["hits"] += 1
            return self._cache_val
        self.translation_stats["misses"] += 1
        self.translation_stats["gathers"] += 1
        out = self._registered().translate(loc)  # (on the host: numpy's gather)
        self._cache_key, self._cache_loc, self._cache_val = key, loc, out
        return out


class SWAKVPool(BaseSWAKVPool):
    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        swa_attention_layer_ids: Sequence[int],
        full_attention_layer_ids: Sequence[int],
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.size = size
        self.size_swa = size_swa
        self.page_size = page_size
        self.device = torch.device(device)
        self.full_kv_pool = MHAKVPool(
            size, page_size, dtype, head_num, head_dim, len(full_attention_layer_ids), device
        )
        self.swa_kv_pool = MHAKVPool(
            size_swa, page_size, dtype, head_num, head_dim, len(swa_attention_layer_ids), device
        )
        self.layers_mapping: dict[int, tuple[int, bool]] = {}
        for local, gid in enumerate(full_attention_layer_ids):
            self.layers_mapping[gid] = (local, False)
        for local, gid in enumerate(swa_attention_layer_ids):
            self.layers_mapping[gid] = (local, True)

    # ------------------------------------------------------------ layers
    def is_swa_layer(self, layer_id: int) -> bool:
        return self.layers_mapping[layer_id][1]

    def _sub(self, layer_id: int) -> tuple[MHAKVPool, int]:
        local, is_swa = self.layers_mapping[layer_id]
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), local

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local = self._sub(layer_id)
        return pool.get_key_buffer(local)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local = self._sub(layer_id)
        return pool.get_value_buffer(local)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, local = self._sub(layer_id)
        return pool.get_kv_buffer(local)

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """``loc`` are full slots; SWA layers write at their translation."""
        pool, local = self._sub(layer_id)
        if self.is_swa_layer(layer_id):
            loc = self.translate_loc_from_full_to_swa(loc)
        pool.set_kv_buffer(local, loc, k, v)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        self.full_kv_pool.move_kv_cache(tgt_loc, src_loc)
        m = self.full_to_swa_index_mapping
        self.swa_kv_pool.move_kv_cache(m[tgt_loc], m[src_loc])

    def get_kv_size_bytes(self) -> tuple[int, int]:
        fk, fv = self.full_kv_pool.get_kv_size_bytes()
        sk, sv = self.swa_kv_pool.get_kv_size_bytes()
        return fk + sk, fv + sv

    # ------------------------------------------------------------ transfer
    def get_contiguous_buf_infos(self) -> BufInfos:
        """The full sub-pool only (the "KV" channel)."""
        return self.full_kv_pool.get_contiguous_buf_infos()

    def get_state_buf_infos(self) -> BufInfos:
        """The SWA sub-pool (the "state" channel)."""
        return self.swa_kv_pool.get_contiguous_buf_infos()


if TYPE_CHECKING:  # mypy: the contracts of kvcanary.memory.base hold
    _swa_pair: type[KVPairPool] = SWAKVPool
    _swa_windowed: type[WindowedKVPool] = SWAKVPool
