"""Pool adapters: buffer groups per pool type (sizes, LUTs, halves), buf-info splice layout,
host-copy sidecars, and clear refusals for unknown, incomplete and empty pools."""

from __future__ import annotations

import pytest
import torch

from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.attach.registry import (
    AttachOptions,
    attach_canary_buffers,
    register_pool_attacher,
)
from kvcanary.canary.wire.constants import CANARY_SLOT_BYTES, PoolKind, RealKvHashMode
from kvcanary.memory import host_pool
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool

P = 4
FULL, SWA_SIZE = 32, 16
WINDOW = 8


def opts(real: RealKvHashMode = RealKvHashMode.NONE, layers: str = "first",
         window: int | None = WINDOW) -> AttachOptions:  # fmt: skip
    return AttachOptions(real, layers, window)


def mha(layers: int = 2) -> MHAKVPool:
    return MHAKVPool(FULL, P, torch.float32, 2, 8, layers)


def swa(swa_layers: tuple[int, ...] = (0, 1), full_layers: tuple[int, ...] = (2,),
        with_allocator: bool = True) -> SWAKVPool:  # fmt: skip
    pool = SWAKVPool(FULL, SWA_SIZE, P, torch.float32, 2, 8, swa_layers, full_layers)
    if with_allocator:
        SWAAllocator(FULL, SWA_SIZE, P, kvcache=pool)
    return pool


def dsv4(ratios: tuple[int, ...] = (0, 4, 128, 4)) -> DSV4KVPool:
    pool = DSV4KVPool(4 * 128, 2 * 128, 128, list(ratios), 8, 4, torch.float32)
    SWAAllocator(4 * 128, 2 * 128, 128, kvcache=pool)
    return pool


def rows_of(buf: torch.Tensor) -> int:
    return int(buf.shape[0])


# ------------------------------------------------------------------ groups


def test_mha_pool_gets_one_full_group_with_k_and_v() -> None:
    pool = mha()
    (group,) = attach_canary_buffers(pool, opts())
    assert group.kind == PoolKind.FULL and group.has_v_half
    assert group.swa_index_lut is None and group.window is None
    assert group.num_slots == FULL + P  # sink page included: row s = slot s
    assert [tuple(b.shape) for b in group.buffers()] == [(FULL + P, CANARY_SLOT_BYTES)] * 4
    assert all(b.dtype == torch.uint8 and not bool(b.any()) for b in group.buffers())
    assert len({b.data_ptr() for b in group.buffers()}) == 4  # head/tail never alias
    assert group.nbytes == 4 * (FULL + P) * 32


def test_swa_pool_gets_full_and_swa_groups() -> None:
    pool = swa()
    full, swa_group = attach_canary_buffers(pool, opts())
    assert (full.kind, full.sub_pool, full.num_slots) == (PoolKind.FULL, "full_kv_pool", FULL + P)
    assert (swa_group.kind, swa_group.sub_pool, swa_group.num_slots) == (
        PoolKind.SWA, "swa_kv_pool", SWA_SIZE + P,
    )  # fmt: skip
    assert full.swa_index_lut is None
    assert swa_group.swa_index_lut is pool.full_to_swa_index_mapping  # live, never a copy
    assert swa_group.window == WINDOW
    assert full.has_v_half and swa_group.has_v_half


def test_dsv4_pool_covers_swa_and_every_compressed_sub_pool() -> None:
    pool = dsv4()
    groups = attach_canary_buffers(pool, opts())
    kinds = {g.kind: g for g in groups}
    assert list(kinds) == [PoolKind.SWA, PoolKind.C4, PoolKind.INDEXER, PoolKind.C128,
                           PoolKind.C4_STATE, PoolKind.C128_STATE, PoolKind.INDEXER_STATE]
    assert all(not g.has_v_half for g in groups)  # latent KV is K only
    assert kinds[PoolKind.SWA].num_slots == pool.swa_kv_pool.num_slots
    assert kinds[PoolKind.SWA].swa_index_lut is pool.full_to_swa_index_mapping
    for kind, sub, ratio in ((PoolKind.C4, pool.c4_kv_pool, 4),
                             (PoolKind.INDEXER, pool.c4_indexer_kv_pool, 4),
                             (PoolKind.C128, pool.c128_kv_pool, 128)):  # fmt: skip
        g = kinds[kind]
        assert (g.num_slots, g.compression_ratio, g.page_size) == (
            sub.num_slots, ratio, sub.rows_per_page,
        )  # fmt: skip
        lut = g.swa_index_lut
        assert lut is not None and torch.equal(lut[:-1], torch.arange(lut.shape[0] - 1) // ratio)
        assert int(lut[:-1].max()) < g.num_slots
    for kind, sub, ratio, ring in (
        (PoolKind.C4_STATE, pool.compress_state_pools[4], 4, 8),
        (PoolKind.C128_STATE, pool.compress_state_pools[128], 128, 128),
        (PoolKind.INDEXER_STATE, pool.indexer_compress_state_pool, 4, 8),
    ):
        g = kinds[kind]
        assert g.state_ring is not None and g.swa_index_lut is pool.full_to_swa_index_mapping
        assert (g.num_slots, g.page_size, g.state_ring.ratio, g.state_ring.ring_size,
                g.state_ring.overlap, g.state_ring.swa_page_size) == (
            sub.num_slots, ring, ratio, ring, ratio == 4, 128)  # fmt: skip
        assert not g.sweepable and not g.per_position


def test_dsv4_without_compressed_layers_has_only_the_swa_group() -> None:
    groups = attach_canary_buffers(dsv4((0, 0, 4)), opts())
    assert [g.kind for g in groups] == [PoolKind.SWA, PoolKind.C4, PoolKind.INDEXER,
                                        PoolKind.C4_STATE, PoolKind.INDEXER_STATE]
    (only,) = attach_canary_buffers(dsv4((0, 0)), opts())
    assert only.kind == PoolKind.SWA


@pytest.mark.parametrize(("mode", "read"), [(RealKvHashMode.PARTIAL, 16), (RealKvHashMode.ALL, 64)])
def test_real_kv_sources_are_live_views_of_layer_buffers(mode: RealKvHashMode, read: int) -> None:
    pool = mha(layers=3)
    (g,) = attach_canary_buffers(pool, opts(mode))
    (k,), (v,) = g.real_kv_sources_k, g.real_kv_sources_v
    assert k.tensor.data_ptr() == pool.k_buffer[0].data_ptr()  # layer 0, not a copy
    assert v.tensor.data_ptr() == pool.v_buffer[0].data_ptr()
    assert (k.num_bytes_per_token, k.read_bytes) == (2 * 8 * 4, read)
    (g_all,) = attach_canary_buffers(mha(layers=3), opts(mode, layers="all"))
    assert len(g_all.real_kv_sources_k) == 3


def test_real_kv_all_layers_refuses_more_than_four_layers() -> None:
    with pytest.raises(ValueError, match="at most 4 fingerprinted layers"):
        attach_canary_buffers(mha(layers=5), opts(RealKvHashMode.PARTIAL, layers="all"))


def test_real_kv_refuses_unaligned_slot_bytes() -> None:
    pool = MHAKVPool(FULL, P, torch.bfloat16, 1, 4, 1)  # 8 bytes per slot
    with pytest.raises(ValueError, match="8 bytes per slot"):
        attach_canary_buffers(pool, opts(RealKvHashMode.PARTIAL))
    assert pool.extra_slot_buffers == []  # nothing half-attached


# ------------------------------------------------------------------ buf-info splice


def _ptrs(bufs: list[torch.Tensor | None]) -> list[int]:
    return [b.data_ptr() for b in bufs if b is not None]


def test_mha_buf_infos_wrap_k_and_v_entries() -> None:
    pool = mha(layers=2)
    before = pool.get_contiguous_buf_infos()
    (g,) = attach_canary_buffers(pool, opts())
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    k, v = pool.k_buffer, pool.v_buffer
    assert ptrs == _ptrs([g.k_head, *k, g.k_tail, g.v_head, *v, g.v_tail])
    assert [items[0], items[3], items[4], items[7]] == [32 * P] * 4
    assert lens[0] == (FULL + P) * 32
    assert (ptrs[1:3] + ptrs[5:7], items[1:3] + items[5:7]) == (before[0], before[2])


def test_swa_buf_infos_wrap_each_channel_with_its_group() -> None:
    pool = swa()
    full_g, swa_g = attach_canary_buffers(pool, opts())
    f, s = pool.full_kv_pool, pool.swa_kv_pool
    assert pool.get_contiguous_buf_infos()[0] == _ptrs(
        [full_g.k_head, *f.k_buffer, full_g.k_tail, full_g.v_head, *f.v_buffer, full_g.v_tail]
    )
    assert pool.get_state_buf_infos()[0] == _ptrs(
        [swa_g.k_head, *s.k_buffer, swa_g.k_tail, swa_g.v_head, *s.v_buffer, swa_g.v_tail]
    )


def test_dsv4_buf_infos_wrap_every_covered_sub_pool() -> None:
    pool = dsv4()
    g = {x.kind: x for x in attach_canary_buffers(pool, opts())}
    c4, idx, c128 = g[PoolKind.C4], g[PoolKind.INDEXER], g[PoolKind.C128]
    ptrs, _, items = pool.get_contiguous_buf_infos()
    assert ptrs == _ptrs([c4.k_head, *pool.c4_kv_pool.buffers, c4.k_tail,
                          idx.k_head, *pool.c4_indexer_kv_pool.buffers, idx.k_tail,
                          c128.k_head, *pool.c128_kv_pool.buffers, c128.k_tail])  # fmt: skip
    assert items[0] == 32 * (128 // 4) and items[-1] == 32 * 1  # one compressed page
    state_ptrs, _, state_items = pool.get_state_buf_infos()
    swa_g = g[PoolKind.SWA]
    wrapped = [swa_g.k_head, *pool.swa_kv_pool.buffers, swa_g.k_tail]
    for kind, sub in ((PoolKind.C4_STATE, pool.compress_state_pools[4]),
                      (PoolKind.C128_STATE, pool.compress_state_pools[128]),
                      (PoolKind.INDEXER_STATE, pool.indexer_compress_state_pool)):  # fmt: skip
        wrapped += [g[kind].k_head, *sub.buffers, g[kind].k_tail]
    assert state_ptrs == _ptrs(wrapped)
    assert state_items[0] == 32 * 128
    c4_ring = len(pool.swa_kv_pool.buffers) + 2  # the C4 ring's HEAD records: one ring per item
    assert state_items[c4_ring] == 32 * 8


# ------------------------------------------------------------------ host-copy sidecars


def test_records_travel_with_host_copies() -> None:
    pool = swa(with_allocator=False)
    alloc = SWAAllocator(FULL, SWA_SIZE, P, kvcache=pool)
    full_g, swa_g = attach_canary_buffers(pool, opts())
    assert pool.full_kv_pool.extra_slot_buffers == full_g.buffers()
    assert pool.swa_kv_pool.extra_slot_buffers == swa_g.buffers()
    src = alloc.alloc_extend([0], [6], torch.tensor([-1]))
    assert src is not None
    for g in (full_g, swa_g):
        for b in g.buffers():
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
    saved_full = [b[src].clone() for b in full_g.buffers()]
    saved_swa = [b[alloc.full_to_swa_index_mapping[src]].clone() for b in swa_g.buffers()]
    copy = host_pool.get_cpu_copy(pool, src)
    alloc.free(src)
    dst = alloc.alloc_extend([0], [6], torch.tensor([-1]))
    assert dst is not None
    host_pool.load_cpu_copy(pool, copy, dst)
    assert all(torch.equal(b[dst], s) for b, s in zip(full_g.buffers(), saved_full, strict=True))
    dst_swa = alloc.full_to_swa_index_mapping[dst]
    assert all(torch.equal(b[dst_swa], s) for b, s in zip(swa_g.buffers(), saved_swa, strict=True))


# ------------------------------------------------------------------ refusals


def test_unknown_pool_type_lists_the_supported_ones() -> None:
    class ForeignPool:
        pass

    with pytest.raises(NotImplementedError) as e:
        attach_canary_buffers(ForeignPool(), opts())
    assert "ForeignPool" in str(e.value)
    for name in ("MHAKVPool", "SWAKVPool", "DSV4KVPool"):
        assert name in str(e.value)


def test_registered_attacher_serves_subclasses() -> None:
    class MyPool:
        pass

    class MyDerivedPool(MyPool):
        pass

    seen = []
    register_pool_attacher(MyPool, lambda pool, o: seen.append(type(pool)) or [])
    try:
        assert attach_canary_buffers(MyDerivedPool(), opts()) == []
        assert seen == [MyDerivedPool]
    finally:
        from kvcanary.canary.attach import registry as adapters

        del adapters._ATTACHERS[MyPool]


@pytest.mark.parametrize(
    ("make", "options", "message"),
    [
        (lambda: mha(layers=0), opts(), "has no layers"),
        (lambda: swa(swa_layers=()), opts(), "swa_kv_pool K has no layers"),
        # No full layer is fine (all-sliding: a records-only FULL group, see
        # test_canary_all_sliding.py); no layer at all is not.
        (lambda: swa(swa_layers=(), full_layers=()), opts(), "swa_kv_pool K has no layers"),
        (lambda: swa(with_allocator=False), opts(), "no mapping registered"),
        (lambda: swa(), opts(window=None), "sliding window None"),
        (lambda: dsv4(), opts(window=None), "sliding window None"),
    ],
)
def test_incomplete_or_empty_pools_are_refused(make, options: AttachOptions, message: str) -> None:
    pool = make()
    with pytest.raises(ValueError, match=message):
        attach_canary_buffers(pool, options)
    subs = {MHAKVPool: lambda: [pool], SWAKVPool: lambda: [pool.full_kv_pool, pool.swa_kv_pool]}
    for sub in subs.get(type(pool), list)():
        assert sub.extra_slot_buffers == []  # nothing half-attached
    assert not hasattr(pool.get_contiguous_buf_infos, "__kv_canary_spliced__")


def test_missing_sub_pool_is_named() -> None:
    pool = swa()
    pool.swa_kv_pool = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"SWAKVPool\.swa_kv_pool is missing"):
        attach_canary_buffers(pool, opts())


def test_pool_with_only_the_sink_slot_is_refused() -> None:
    pool = MHAKVPool(0, 1, torch.float32, 1, 4, 1)  # one row: slot 0, reserved
    with pytest.raises(ValueError, match="at least one slot beyond the reserved slot 0"):
        attach_canary_buffers(pool, opts())


def test_group_is_frozen() -> None:
    (g,) = attach_canary_buffers(mha(), opts())
    assert isinstance(g, CanaryBufferGroup)
    with pytest.raises(AttributeError):
        g.window = 3  # type: ignore[misc]
