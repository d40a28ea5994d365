"""MHAKVPool / SWAKVPool storage: buffer shapes, buf-infos, layer routing, the slot-0 sink."""

from __future__ import annotations

import pytest
import torch

from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool
from kvcanary.utils import buf_infos

FULL_LAYERS, SWA_LAYERS = [0, 2], [1, 3, 4]


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_swa(
    page_size: int = 4, dtype: torch.dtype = torch.float32
) -> tuple[SWAKVPool, SWAAllocator]:
    pool = SWAKVPool(32, 16, page_size, dtype, 2, 4, SWA_LAYERS, FULL_LAYERS)
    return pool, SWAAllocator(32, 16, page_size, kvcache=pool)


# ---------------------------------------------------------------- MHAKVPool
@pytest.mark.parametrize(
    ("size", "page_size", "heads", "head_dim", "v_head_dim", "dtype"),
    [
        (16, 1, 2, 4, None, torch.float32),
        (16, 4, 1, 8, 4, torch.bfloat16),
        (12, 2, 3, 2, None, torch.float16),
    ],
)
def test_mha_buffers_and_buf_infos(
    size: int, page_size: int, heads: int, head_dim: int, v_head_dim: int | None, dtype: torch.dtype
) -> None:
    pool = MHAKVPool(size, page_size, dtype, heads, head_dim, 3, v_head_dim=v_head_dim)
    vdim = v_head_dim or head_dim
    assert pool.num_slots == size + page_size
    assert all(
        b.shape == (size + page_size, heads, head_dim) and b.dtype == dtype for b in pool.k_buffer
    )
    assert all(b.shape == (size + page_size, heads, vdim) for b in pool.v_buffer)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    buffers = pool.k_buffer + pool.v_buffer  # all K first, then all V
    assert ptrs == [b.data_ptr() for b in buffers]
    assert lens == [b.nbytes for b in buffers]
    elem = torch.finfo(dtype).bits // 8
    assert (
        items == [heads * head_dim * elem * page_size] * 3 + [heads * vdim * elem * page_size] * 3
    )
    # page p of buffer i starts at ptr + p * item_len, and the buffer holds whole pages
    assert all(n == it * (size // page_size + 1) for n, it in zip(lens, items, strict=True))
    assert pool.get_state_buf_infos() == ([], [], [])
    assert pool.get_kv_size_bytes() == (sum(lens[:3]), sum(lens[3:]))


def test_buf_infos_page_address() -> None:
    buf = torch.arange(24, dtype=torch.int32).reshape(6, 2, 2)  # 3 pages of 2 rows
    (ptr,), _, (item,) = buf_infos([buf], 2)
    assert ptr + 2 * item == buf[4].data_ptr()


def test_mha_set_get_move() -> None:
    pool = MHAKVPool(8, 1, torch.float32, 2, 4, 2)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    pool.set_kv_buffer(1, t([3, 5, 6]), k, v)
    assert torch.equal(pool.get_key_buffer(1)[t([3, 5, 6])], k)
    assert torch.equal(pool.get_value_buffer(1)[t([3, 5, 6])], v)
    assert pool.get_kv_buffer(1) == (pool.k_buffer[1], pool.v_buffer[1])
    assert not bool(pool.k_buffer[0].any())  # other layer untouched
    pool.move_kv_cache(t([1, 2]), t([5, 6]))
    assert torch.equal(pool.k_buffer[1][1:3], k[1:]) and torch.equal(pool.v_buffer[1][1:3], v[1:])


def test_mha_set_casts_to_pool_dtype() -> None:
    pool = MHAKVPool(8, 1, torch.bfloat16, 1, 2, 1)
    pool.set_kv_buffer(0, t([1]), torch.ones(1, 1, 2, dtype=torch.float32), torch.ones(1, 1, 2))
    assert pool.k_buffer[0].dtype == torch.bfloat16 and float(pool.k_buffer[0][1].sum()) == 2.0


def test_register_slot_buffer_checks_shape_and_device() -> None:
    pool = MHAKVPool(8, 4, torch.float32, 1, 2, 1)
    pool.register_slot_buffer(torch.zeros(12, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs 12 rows"):
        pool.register_slot_buffer(torch.zeros(8, 32, dtype=torch.uint8))
    assert len(pool.extra_slot_buffers) == 1
    # sidecars are not part of the KV buf-infos (the canary splices its own)
    assert len(pool.get_contiguous_buf_infos()[0]) == 2


# ---------------------------------------------------------------- SWAKVPool
def test_swa_pool_layer_mapping_and_buffers() -> None:
    pool, _ = make_swa()
    assert pool.layers_mapping == {
        0: (0, False),
        2: (1, False),
        1: (0, True),
        3: (1, True),
        4: (2, True),
    }
    assert pool.full_kv_pool.num_slots == 36 and pool.swa_kv_pool.num_slots == 20
    assert pool.get_key_buffer(2) is pool.full_kv_pool.k_buffer[1]
    assert pool.get_value_buffer(4) is pool.swa_kv_pool.v_buffer[2]
    assert pool.get_kv_buffer(1) == (pool.swa_kv_pool.k_buffer[0], pool.swa_kv_pool.v_buffer[0])
    assert [pool.is_swa_layer(i) for i in range(5)] == [False, True, False, True, True]


def test_swa_pool_buf_infos_split_channels() -> None:
    pool, _ = make_swa()
    assert pool.get_contiguous_buf_infos() == pool.full_kv_pool.get_contiguous_buf_infos()
    assert pool.get_state_buf_infos() == pool.swa_kv_pool.get_contiguous_buf_infos()
    fk, fv = pool.full_kv_pool.get_kv_size_bytes()
    sk, sv = pool.swa_kv_pool.get_kv_size_bytes()
    assert pool.get_kv_size_bytes() == (fk + sk, fv + sv)


def test_swa_pool_routes_writes() -> None:
    pool, alloc = make_swa()
    full = alloc.alloc_extend_swa_tail(0, 8, -1, 4)  # slots 4..11; SWA only for 8..11
    swa = alloc.full_to_swa_index_mapping[full]
    k, v = torch.randn(8, 2, 4), torch.randn(8, 2, 4)
    for layer in FULL_LAYERS + SWA_LAYERS:
        pool.set_kv_buffer(layer, full, k + layer, v - layer)
    for layer in FULL_LAYERS:  # full layers: at the full slots
        kb, vb = pool.get_kv_buffer(layer)
        assert torch.equal(kb[full], k + layer) and torch.equal(vb[full], v - layer)
    for layer in SWA_LAYERS:  # SWA layers: at the translated slots (tail only)
        kb, vb = pool.get_kv_buffer(layer)
        assert torch.equal(kb[swa[4:]], (k + layer)[4:]) and torch.equal(
            vb[swa[4:]], (v - layer)[4:]
        )
        # untranslated head tokens went to the sink, nothing else was touched
        touched = torch.zeros(kb.shape[0], dtype=torch.bool)
        touched[swa[4:]] = True
        touched[0] = True
        assert not bool(kb[~touched].any())


def test_slot0_sink_absorbs_padded_writes() -> None:
    pool, alloc = make_swa()
    full = alloc.alloc_extend([0], [2], t([-1]))
    pad = torch.zeros(3, dtype=torch.int64)  # graph padding: out_cache_loc = 0
    loc = torch.cat([full, pad])
    k = torch.randn(5, 2, 4)
    pool.set_kv_buffer(0, loc, k, k)
    pool.set_kv_buffer(1, loc, k, k)
    assert int(alloc.full_to_swa_index_mapping[0]) == 0  # slot 0 translates to SWA slot 0
    for layer, real in ((0, full), (1, alloc.full_to_swa_index_mapping[full])):
        kb = pool.get_key_buffer(layer)
        assert torch.equal(kb[real], k[:2])
        live = torch.ones(kb.shape[0], dtype=torch.bool)
        live[real] = False
        live[0] = False
        assert not bool(kb[live].any())  # only the sink row absorbed the padding


def test_swa_move_kv_cache() -> None:
    pool, alloc = make_swa(page_size=1)
    src, dst = alloc.alloc(2), alloc.alloc(2)
    k = torch.randn(2, 2, 4)
    pool.set_kv_buffer(0, src, k, k)
    pool.set_kv_buffer(1, src, k, k)
    pool.move_kv_cache(dst, src)
    assert torch.equal(pool.get_key_buffer(0)[dst], k)
    assert torch.equal(pool.get_key_buffer(1)[alloc.full_to_swa_index_mapping[dst]], k)
