"""DSV4KVPool: sub-pool geometry, layer mapping, index spaces, buf-infos, and working with the
SWAAllocator (full side = compressed logical tokens, SWA side = latent rows)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import BaseSWAKVPool

P = 128  # smallest page that holds a C128 row
RATIOS = [0, 4, 128, 4, 0]
HEAD_DIM, INDEXER_DIM = 8, 4
FULL, SWA = 4 * P, 2 * P  # 4 full pages, 2 SWA pages


def make(dtype: torch.dtype = torch.bfloat16) -> tuple[DSV4KVPool, SWAAllocator]:
    pool = DSV4KVPool(FULL, SWA, P, RATIOS, HEAD_DIM, INDEXER_DIM, dtype)
    return pool, SWAAllocator(FULL, SWA, P, kvcache=pool)


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_is_a_mapped_swa_pool() -> None:
    pool, alloc = make()
    assert isinstance(pool, BaseSWAKVPool)
    assert pool.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping


@pytest.mark.parametrize(
    ("name", "num_buffers", "rows", "dim"),
    [
        ("swa_kv_pool", 5, 3 * P, HEAD_DIM),  # every layer; 2 pages + sink page
        ("c4_kv_pool", 2, 5 * P // 4, HEAD_DIM),  # 4 full pages + sink, P/4 rows each
        ("c4_indexer_kv_pool", 2, 5 * P // 4, INDEXER_DIM),
        ("c128_kv_pool", 1, 5, HEAD_DIM),
    ],
)
def test_latent_sub_pools(name: str, num_buffers: int, rows: int, dim: int) -> None:
    pool, _ = make()
    sub = getattr(pool, name)
    assert sub.num_slots == rows
    assert len(sub.buffers) == num_buffers
    assert all(b.shape == (rows, dim) and b.dtype == torch.bfloat16 for b in sub.buffers)


@pytest.mark.parametrize(
    ("ratio", "num_buffers", "ring", "dim"), [(4, 2, 8, 4 * HEAD_DIM), (128, 1, 128, 2 * HEAD_DIM)]
)
def test_compress_state_pools(ratio: int, num_buffers: int, ring: int, dim: int) -> None:
    pool, _ = make()
    sub = pool.compress_state_pools[ratio]
    assert len(sub.buffers) == num_buffers and sub.rows_per_page == ring
    for buf in sub.buffers:
        assert buf.shape == (3 * ring, dim) and buf.dtype == torch.float32  # a ring per SWA page
        assert not bool(buf[:, : dim // 2].any())  # kv half
        assert bool(torch.isneginf(buf[:, dim // 2 :]).all())  # score half


def test_layer_mapping() -> None:
    pool, _ = make()
    got = [(e.ratio, e.index_in_pool, e.pool) for e in pool.layer_mapping]
    assert got == [
        (0, 0, None),
        (4, 0, pool.c4_kv_pool),
        (128, 0, pool.c128_kv_pool),
        (4, 1, pool.c4_kv_pool),
        (0, 1, None),
    ]
    assert pool.get_key_buffer(3) is pool.swa_kv_pool.buffers[3]
    assert pool.get_compressed_buffer(3) is pool.c4_kv_pool.buffers[1]
    assert pool.get_compressed_buffer(2) is pool.c128_kv_pool.buffers[0]
    assert pool.get_indexer_buffer(3) is pool.c4_indexer_kv_pool.buffers[1]
    assert pool.get_state_buffer(3) is pool.compress_state_pools[4].buffers[1]
    assert pool.get_state_buffer(2) is pool.compress_state_pools[128].buffers[0]


@pytest.mark.parametrize(
    ("call", "layer"),
    [
        ("get_compressed_buffer", 0),
        ("get_state_buffer", 4),
        ("get_indexer_buffer", 2),
        ("get_indexer_buffer", 0),
    ],
)
def test_wrong_layer_kind_raises(call: str, layer: int) -> None:
    pool, _ = make()
    with pytest.raises(ValueError, match=f"layer {layer} has compression ratio"):
        getattr(pool, call)(layer)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compression_ratios": [0, 8]}, "not in"),
        ({"page_size": 64, "compression_ratios": [0, 128]}, "multiple of every compression ratio"),
        ({"page_size": 2, "compression_ratios": [4]}, "multiple of every compression ratio"),
        ({"size_swa": 64}, "must hold a page"),
    ],
)
def test_validation(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    args = {
        "size": FULL,
        "size_swa": SWA,
        "page_size": P,
        "compression_ratios": RATIOS,
        "head_dim": HEAD_DIM,
        "indexer_head_dim": INDEXER_DIM,
        "dtype": torch.float32,
    } | kwargs
    with pytest.raises(ValueError, match=message):
        DSV4KVPool(**args)


def test_c4_only_geometry_with_small_pages() -> None:
    pool = DSV4KVPool(16, 8, 4, [4, 0], 2, 2, torch.float32)
    assert pool.c4_kv_pool.num_slots == 5 and pool.c128_kv_pool.buffers == []
    assert pool.compress_state_pools[4].buffers[0].shape == (3 * 8, 8)


# ---------------------------------------------------------------- index spaces
@pytest.mark.parametrize(
    ("layer", "swa_loc", "state_loc"),
    [
        (1, [0, 1, 7, 8, 9, 128, 135, 136, 255, 256], [0, 1, 7, 0, 1, 8, 15, 8, 15, 16]),  # ring 8
        (2, [0, 127, 128, 200, 256], [0, 127, 128, 200, 256]),  # ring 128 = one row per slot
    ],
)
def test_state_loc(layer: int, swa_loc: list[int], state_loc: list[int]) -> None:
    pool, _ = make()
    assert pool.state_loc(layer, t(swa_loc)).tolist() == state_loc


def test_compressed_loc_pages_match_full_pages() -> None:
    pool, _ = make()
    full = torch.arange(P, 5 * P)
    for layer, ratio in ((1, 4), (2, 128)):
        c = pool.compressed_loc(layer, full)
        assert torch.equal(c, full // ratio)
        assert torch.equal(c // (P // ratio), full // P)  # compressed page k <-> full page k


def test_works_with_the_swa_allocator() -> None:
    """A 300-token request with only the last 172 tokens' window resident (tail start 128)."""
    pool, alloc = make(torch.float32)
    full = alloc.alloc_extend_swa_tail(0, 300, -1, 172)
    swa = alloc.full_to_swa_index_mapping[full]
    assert (swa[:128] == 0).all() and (swa[128:] > 0).all()
    latent = torch.randn(300, HEAD_DIM)
    for layer in range(len(RATIOS)):
        pool.set_kv_buffer(layer, full, latent + layer)
        assert torch.equal(pool.get_key_buffer(layer)[swa[128:]], (latent + layer)[128:])
    # compressed rows: one per 4 (or 128) tokens, written at full_loc // ratio
    for layer, ratio in ((1, 4), (2, 128)):
        ends = full[ratio - 1 :: ratio]  # the token completing each group
        kv = torch.randn(ends.numel(), HEAD_DIM)
        pool.set_compressed_buffer(layer, ends, kv)
        assert torch.equal(pool.get_compressed_buffer(layer)[ends // ratio], kv)
    pool.set_indexer_buffer(3, full[3::4], torch.ones(75, INDEXER_DIM))
    assert int(pool.get_indexer_buffer(3).sum()) == 75 * INDEXER_DIM
    # compress states: SWA page ids are ring ids
    state = pool.state_loc(1, swa[128:])
    assert torch.equal(state // 8, swa[128:] // P)
    alloc.free(full)
    assert alloc.check_integrity() and alloc.available_size() == SWA


def test_set_kv_buffer_is_k_only() -> None:
    pool, alloc = make()
    full = alloc.alloc_extend([0], [2], t([-1]))
    with pytest.raises(ValueError, match="K only"):
        pool.set_kv_buffer(0, full, torch.zeros(2, HEAD_DIM), torch.zeros(2, HEAD_DIM))


# ---------------------------------------------------------------- buf-infos
def test_contiguous_buf_infos() -> None:
    pool, _ = make()
    bufs = pool.c4_kv_pool.buffers + pool.c4_indexer_kv_pool.buffers + pool.c128_kv_pool.buffers
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in bufs] and lens == [b.nbytes for b in bufs]
    elem = 2  # bf16
    c4_page, idx_page = HEAD_DIM * elem * P // 4, INDEXER_DIM * elem * P // 4
    assert items == [c4_page, c4_page, idx_page, idx_page, HEAD_DIM * elem * P // 128]
    assert all(n == i * 5 for n, i in zip(lens, items, strict=True))  # 4 full pages + sink


def test_state_buf_infos() -> None:
    pool, _ = make()
    states = pool.compress_state_pools[4].buffers + pool.compress_state_pools[128].buffers
    bufs = pool.swa_kv_pool.buffers + states + pool.indexer_compress_state_pool.buffers
    ptrs, lens, items = pool.get_state_buf_infos()
    assert ptrs == [b.data_ptr() for b in bufs] and lens == [b.nbytes for b in bufs]
    assert items == (
        [HEAD_DIM * 2 * P] * 5 + [8 * 4 * HEAD_DIM * 4] * 2 + [128 * 2 * HEAD_DIM * 4]
        + [8 * 4 * INDEXER_DIM * 4] * 2
    )
    assert all(n == i * 3 for n, i in zip(lens, items, strict=True))  # 2 SWA pages + sink
