"""DSV4KVPool: a DeepSeek-V4-style pool — sliding-window latent KV on every layer, plus
compressed KV on the layers whose ``compression_ratios[layer]`` is 4 ("C4", with a
lightning-indexer key pool) or 128 ("C128"); ratio 0 = SWA only.

It pairs with :class:`~kvcanary.memory.swa_allocator.SWAAllocator` (one ``page_size`` for
both sides): the allocator's full side is the logical token space the compressed pools are
indexed by, its SWA side the latent pool's rows. Index spaces (``P = page_size``)::

    full slot f          no storage of its own
      C4 row   f // 4    C4 page k   = rows [k*P/4,   (k+1)*P/4)   <-> full page k
      C128 row f // 128  C128 page k = rows [k*P/128, (k+1)*P/128) <-> full page k
    SWA slot s = mapping[f]
      latent row s       SWA page k  = rows [k*P, (k+1)*P)
      state row          (s // P) * ring + s % ring                  <-> SWA page k
                         (ring = 8 for C4, 128 for C128: one ring per SWA page; the C4
                         lightning indexer has its own ring pool, same rows)

so full page ids double as compressed page ids and SWA page ids as compress-state ring
ids. Page 0 of every sub-pool is the reserved sink (full page 0 -> compressed page 0,
SWA slot 0 -> SWA page 0 -> ring 0), so padded writes land there harmlessly.

Storage is flat rows ``[num_rows, dim]`` per layer (a paged view is
``buf.view(-1, rows_per_page, dim)``). Latent KV is K only (it serves as V too).
Compress states are ``[rows, 2 * (1 + overlap) * dim]`` in ``state_dtype`` (``dim`` =
``head_dim``, or ``indexer_head_dim`` for the indexer's ring): the kv half starts at 0, the
score half at −inf (an empty ring contributes no weight); overlap = 1 for C4, 0 for C128.

The ring contract (what the compressors and the canary's state groups agree on): row
``state_loc(s)`` of SWA slot ``s`` holds the raw (kv, score) state of the token at that slot,
written once when the token is processed and left alone until a later token of the same
ring overwrites it. Only a request's *live tail* is ever read: with ``L`` tokens
committed, positions ``[L - (L % 4 + 4), L)`` for C4 (the open window and, for the
overlap, the window before it) and ``[L - L % 128, L)`` for C128 (the open window). Those
rows are distinct and all hold their own token's state, because the last ``ring``
positions of a request map to distinct rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvcanary.memory.base import BufInfos, WindowedKVPool
from kvcanary.memory.swa_pool import BaseSWAKVPool
from kvcanary.utils import buf_infos

COMPRESSION_RATIOS = (0, 4, 128)
STATE_RING_SIZE = {4: 8, 128: 128}


class LatentKVPool:
    """Per-layer ``[(num_pages + 1) * rows_per_page, dim]`` buffers; page 0 is the sink."""

    def __init__(
        self,
        num_pages: int,
        rows_per_page: int,
        dim: int,
        layer_num: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.rows_per_page = rows_per_page
        self.num_slots = (num_pages + 1) * rows_per_page
        self.buffers = [
            torch.zeros((self.num_slots, dim), dtype=dtype, device=device) for _ in range(layer_num)
        ]
        self.extra_slot_buffers: list[torch.Tensor] = []

    def register_slot_buffer(self, buf: torch.Tensor) -> None:
        """Attach a per-row sidecar (row ``i`` describes row ``i``, e.g. the canary's records)
        that host copies carry along with the rows; the pool never reads or writes it."""
        if buf.shape[0] != self.num_slots:
            raise ValueError(
                f"register_slot_buffer: sidecar has {buf.shape[0]} rows; the sub-pool has "
                f"{self.num_slots}"
            )
        self.extra_slot_buffers.append(buf)

    def buf_infos(self) -> BufInfos:
        """One item = one page (``rows_per_page`` rows)."""
        return buf_infos(self.buffers, self.rows_per_page)


class DSV4Layer(NamedTuple):
    ratio: int  # 0, 4 or 128
    index_in_pool: int  # position among the layers of this ratio (buffer index in its pools)
    pool: LatentKVPool | None  # the compressed KV sub-pool; None for ratio 0


class DSV4KVPool(BaseSWAKVPool):
    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        compression_ratios: Sequence[int],
        head_dim: int,
        indexer_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        state_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        bad = [r for r in compression_ratios if r not in COMPRESSION_RATIOS]
        if bad:
            raise ValueError(
                f"compression_ratios={list(compression_ratios)}: {bad} not in {COMPRESSION_RATIOS}"
            )
        for r in set(compression_ratios) - {0}:
            if page_size % r:
                raise ValueError(
                    f"page_size={page_size}: must be a multiple of every compression ratio "
                    f"in use ({r})"
                )
        if min(size, size_swa) < page_size:
            raise ValueError(
                f"size={size}, size_swa={size_swa}: each must hold a page of {page_size}"
            )
        self.size = size
        self.size_swa = size_swa
        self.page_size = page_size
        self.device = torch.device(device)
        self.compression_ratios = list(compression_ratios)
        num_full_pages, num_swa_pages = size // page_size, size_swa // page_size
        count = {r: self.compression_ratios.count(r) for r in COMPRESSION_RATIOS}

        def latent(
            num_pages: int, rows_per_page: int, dim: int, n: int, dt: torch.dtype
        ) -> LatentKVPool:
            return LatentKVPool(num_pages, rows_per_page, dim, n, dt, self.device)

        self.swa_kv_pool = latent(
            num_swa_pages, page_size, head_dim, len(compression_ratios), dtype
        )
        self.c4_kv_pool = latent(num_full_pages, page_size // 4, head_dim, count[4], dtype)
        self.c4_indexer_kv_pool = latent(
            num_full_pages, page_size // 4, indexer_head_dim, count[4], dtype
        )
        self.c128_kv_pool = latent(num_full_pages, page_size // 128, head_dim, count[128], dtype)
        self.compress_state_pools = {
            r: latent(
                num_swa_pages,
                STATE_RING_SIZE[r],
                2 * (1 + (r == 4)) * head_dim,
                count[r],
                state_dtype,
            )
            for r in (4, 128)
        }
        # The C4 lightning indexer's compressor keeps its own (overlap) ring per C4 layer.
        self.indexer_compress_state_pool = latent(
            num_swa_pages, STATE_RING_SIZE[4], 2 * 2 * indexer_head_dim, count[4], state_dtype
        )
        for state_pool in (*self.compress_state_pools.values(), self.indexer_compress_state_pool):
            for buf in state_pool.buffers:
                buf[:, buf.shape[1] // 2 :] = float("-inf")

        kv_pools = {0: None, 4: self.c4_kv_pool, 128: self.c128_kv_pool}
        seen = dict.fromkeys(COMPRESSION_RATIOS, 0)
        self.layer_mapping: list[DSV4Layer] = []
        for r in self.compression_ratios:
            self.layer_mapping.append(DSV4Layer(r, seen[r], kv_pools[r]))
            seen[r] += 1

    # ------------------------------------------------------------ routing
    def _compressed(self, layer_id: int, ratio: int | None = None) -> DSV4Layer:
        entry = self.layer_mapping[layer_id]
        if entry.ratio == 0 or (ratio is not None and entry.ratio != ratio):
            want = f"ratio {ratio}" if ratio is not None else "a compressed layer"
            raise ValueError(f"layer {layer_id} has compression ratio {entry.ratio}: need {want}")
        return entry

    def compressed_loc(self, layer_id: int, full_loc: torch.Tensor) -> torch.Tensor:
        """Compressed row holding the token at full slot ``full_loc`` (``f // ratio``)."""
        return full_loc.to(torch.int64) // self._compressed(layer_id).ratio

    def state_loc(self, layer_id: int, swa_loc: torch.Tensor) -> torch.Tensor:
        """Compress-state row of SWA slot ``swa_loc`` (attention and indexer rings alike):
        one ring per SWA page."""
        ring = STATE_RING_SIZE[self._compressed(layer_id).ratio]
        swa_loc = swa_loc.to(torch.int64)
        return (swa_loc // self.page_size) * ring + swa_loc % ring

    @staticmethod
    def state_tail_len(ratio: int, seq_len: int) -> int:
        """Length of the live tail of a ``ratio`` ring after ``seq_len`` tokens (module doc)."""
        if ratio == 4:
            return min(seq_len, seq_len % 4 + 4)
        return seq_len % ratio

    # ------------------------------------------------------------ buffers
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's SWA latent buffer (indexed by SWA slot)."""
        return self.swa_kv_pool.buffers[layer_id]

    def get_compressed_buffer(self, layer_id: int) -> torch.Tensor:
        entry = self._compressed(layer_id)
        assert entry.pool is not None  # ratio > 0
        return entry.pool.buffers[entry.index_in_pool]

    def get_indexer_buffer(self, layer_id: int) -> torch.Tensor:
        return self.c4_indexer_kv_pool.buffers[self._compressed(layer_id, 4).index_in_pool]

    def get_state_buffer(self, layer_id: int) -> torch.Tensor:
        entry = self._compressed(layer_id)
        return self.compress_state_pools[entry.ratio].buffers[entry.index_in_pool]

    def get_indexer_state_buffer(self, layer_id: int) -> torch.Tensor:
        """The C4 layer's lightning-indexer compress-state ring (rows: :meth:`state_loc`)."""
        return self.indexer_compress_state_pool.buffers[self._compressed(layer_id, 4).index_in_pool]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None
    ) -> None:
        """Write latent KV of full slots ``loc`` at their SWA translation (K only)."""
        if v is not None:
            raise ValueError("DSV4KVPool.set_kv_buffer: latent KV is K only; pass v=None")
        buf = self.get_key_buffer(layer_id)
        buf[self.translate_loc_from_full_to_swa(loc)] = k.to(buf.dtype)

    def set_compressed_buffer(
        self, layer_id: int, full_loc: torch.Tensor, kv: torch.Tensor
    ) -> None:
        buf = self.get_compressed_buffer(layer_id)
        buf[self.compressed_loc(layer_id, full_loc)] = kv.to(buf.dtype)

    def set_indexer_buffer(self, layer_id: int, full_loc: torch.Tensor, k: torch.Tensor) -> None:
        buf = self.get_indexer_buffer(layer_id)
        buf[self.compressed_loc(layer_id, full_loc)] = k.to(buf.dtype)

    # ------------------------------------------------------------ transfer
    def get_contiguous_buf_infos(self) -> BufInfos:
        """C4 KV, C4 indexer, C128 KV buffers; one item = one compressed page (= full page)."""
        parts = [self.c4_kv_pool, self.c4_indexer_kv_pool, self.c128_kv_pool]
        return _concat_infos([p.buf_infos() for p in parts])

    def get_state_buf_infos(self) -> BufInfos:
        """SWA latent buffers (item = one SWA page), then C4, C128 and C4-indexer compress
        states (item = one ring of ``ring_size`` rows, i.e. one SWA page's state)."""
        parts = [self.swa_kv_pool, *self.compress_state_pools.values(),
                 self.indexer_compress_state_pool]  # fmt: skip
        return _concat_infos([p.buf_infos() for p in parts])


def _concat_infos(
    infos: list[BufInfos],
) -> BufInfos:
    ptrs, lens, items = [], [], []
    for p, n, i in infos:
        ptrs += p
        lens += n
        items += i
    return ptrs, lens, items


if TYPE_CHECKING:  # mypy: the contracts of kvcanary.memory.base hold
    _dsv4: type[WindowedKVPool] = DSV4KVPool
