"""The full→SWA translation cache shared by SWAKVPool and DSV4KVPool: hits only for the same
view in the same forward with an unmutated mapping; never stale."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.mha_pool import BaseKVPool, MHAKVPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import BaseSWAKVPool, SWAKVPool

NUM_SWA_LAYERS = 4


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make(kind: str, page_size: int, full_size: int = 64, swa_size: int = 32):
    if kind == "swa":
        pool: BaseSWAKVPool = SWAKVPool(
            full_size,
            swa_size,
            page_size,
            torch.float32,
            2,
            4,
            swa_attention_layer_ids=range(1, 1 + NUM_SWA_LAYERS),
            full_attention_layer_ids=[0],
        )
    else:
        ratios = [0, 4] if page_size % 4 == 0 else [0, 0]
        pool = DSV4KVPool(full_size, swa_size, page_size, ratios * 2, 8, 4, torch.float32)
    return pool, SWAAllocator(full_size, swa_size, page_size, kvcache=pool)


KINDS = ["swa", "dsv4"]


def stats(pool: BaseSWAKVPool) -> tuple[int, int, int]:
    s = pool.translation_stats
    return s["hits"], s["misses"], s["gathers"]


@pytest.mark.parametrize("kind", KINDS)
def test_same_offset_views_hit(kind: str) -> None:
    pool, alloc = make(kind, 1)
    buf = alloc.alloc(8)
    first = pool.translate_loc_from_full_to_swa(buf[2:6])
    hits = stats(pool)[0]
    second = pool.translate_loc_from_full_to_swa(buf[2:6])  # a new view object, same view
    assert second is first and stats(pool)[0] == hits + 1
    assert first.tolist() == alloc.full_to_swa_index_mapping[buf[2:6]].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_different_offset_views_miss(kind: str) -> None:
    pool, alloc = make(kind, 1)
    buf = alloc.alloc(8)
    a, b = buf[0:4], buf[4:8]
    ta = pool.translate_loc_from_full_to_swa(a)
    misses = stats(pool)[1]
    tb = pool.translate_loc_from_full_to_swa(b)
    assert stats(pool)[1] == misses + 1 and tb is not ta
    assert ta.tolist() == [1, 2, 3, 4] and tb.tolist() == [5, 6, 7, 8]
    # the storage-base key SGLang first used would have collided here
    storage_key = (a.untyped_storage().data_ptr(), a.numel())
    assert storage_key == (b.untyped_storage().data_ptr(), b.numel())
    assert a.data_ptr() != b.data_ptr()


def test_sentinel_translates_to_minus_one() -> None:
    pool, alloc = make("swa", 4)
    full = alloc.alloc_extend([0], [3], t([-1]))
    assert pool.translate_loc_from_full_to_swa(t([-1, int(full[0])])).tolist() == [-1, 4]


# Every mutator of the mapping must invalidate: after it, a translation of the same view in
# the same forward is recomputed (a miss) and equals a fresh gather.
MUTATORS: list[tuple[str, int, Callable[[BaseSWAKVPool, SWAAllocator, torch.Tensor], None]]] = [
    ("alloc", 1, lambda p, a, live: a.alloc(2)),
    ("alloc_extend", 2, lambda p, a, live: a.alloc_extend([0], [3], t([-1]))),
    ("alloc_decode", 2, lambda p, a, live: a.alloc_decode([len(live) + 1], live[-1:])),
    ("alloc_extend_swa_tail", 2, lambda p, a, live: a.alloc_extend_swa_tail(0, 6, -1, 2)),
    ("free", 2, lambda p, a, live: a.free(live)),
    ("free_swa", 2, lambda p, a, live: a.free_swa(live[:2])),
    ("clear", 2, lambda p, a, live: a.clear()),
    (
        "set_full_to_swa_mapping",
        2,
        lambda p, a, live: a.set_full_to_swa_mapping(
            live[:1], t([int(a.swa_attn_allocator.alloc(2)[0])])
        ),
    ),
    ("register_mapping", 2, lambda p, a, live: p.register_mapping(a.mapping)),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("page_size", "mutate"), [m[1:] for m in MUTATORS], ids=[m[0] for m in MUTATORS]
)
def test_every_mutator_invalidates(kind: str, page_size: int, mutate) -> None:  # type: ignore[no-untyped-def]
    pool, alloc = make(kind, page_size)
    live = alloc.alloc(4) if page_size == 1 else alloc.alloc_extend([0], [3], t([-1]))
    loc = torch.arange(0, 12)  # live slots and slots the mutators may hand out
    cached = pool.translate_loc_from_full_to_swa(loc)
    assert pool.translate_loc_from_full_to_swa(loc) is cached
    misses = stats(pool)[1]
    mutate(pool, alloc, live)
    again = pool.translate_loc_from_full_to_swa(loc)
    assert again is not cached and stats(pool)[1] == misses + 1
    assert again.tolist() == alloc.full_to_swa_index_mapping[loc].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_reused_buffer_with_new_contents_in_new_forward_misses(kind: str) -> None:
    pool, alloc = make(kind, 1)
    a_slots, b_slots = alloc.alloc(4), alloc.alloc(4)
    out_cache_loc = torch.empty(4, dtype=torch.int64)  # a persistent scheduler buffer
    pool.begin_forward()
    out_cache_loc.copy_(a_slots)
    assert pool.translate_loc_from_full_to_swa(out_cache_loc).tolist() == [1, 2, 3, 4]
    pool.begin_forward()
    out_cache_loc.copy_(b_slots)  # same address, same numel, new contents
    assert pool.translate_loc_from_full_to_swa(out_cache_loc).tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("kind", KINDS)
def test_recycled_address_in_one_forward_is_never_stale(kind: str) -> None:
    """Regression: a freed index tensor's address reused by a new one (same numel) within a
    forward used to return the old translation; the cache entry now keeps its loc alive."""
    pool, alloc = make(kind, 1, full_size=2048, swa_size=2048)
    a_slots, b_slots = alloc.alloc(1000), alloc.alloc(1000)
    pool.begin_forward()
    for i in range(100):
        loc = (a_slots if i % 2 else b_slots).to(torch.int32)  # fresh temporary each time
        got = pool.translate_loc_from_full_to_swa(loc)
        assert torch.equal(got, alloc.full_to_swa_index_mapping[loc.long()])
        del loc, got


def test_base_invalidate_loc_cache_is_noop() -> None:
    for pool in (BaseKVPool(), MHAKVPool(8, 1, torch.float32, 1, 2, 1)):
        before = dict(vars(pool))
        assert pool.invalidate_loc_cache() is None
        pool.invalidate_loc_cache()
        assert vars(pool).keys() == before.keys()
        assert all(vars(pool)[k] is v for k, v in before.items())


@pytest.mark.parametrize("kind", KINDS)
def test_invalidate_then_retranslate(kind: str) -> None:
    pool, alloc = make(kind, 1)
    loc = alloc.alloc(4)
    first = pool.translate_loc_from_full_to_swa(loc)
    pool.invalidate_loc_cache()
    pool.invalidate_loc_cache()  # idempotent
    again = pool.translate_loc_from_full_to_swa(loc)
    assert again is not first and again.tolist() == first.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_one_gather_per_forward_across_swa_layers(kind: str) -> None:
    pool, alloc = make(kind, 1)
    out_cache_loc = alloc.alloc(6)
    k = torch.randn(6, 2, 4) if kind == "swa" else torch.randn(6, 8)
    layers = range(1, 1 + NUM_SWA_LAYERS) if kind == "swa" else range(4)
    for _ in range(3):  # three forwards
        pool.begin_forward()
        before = stats(pool)
        for layer in layers:
            if kind == "swa":
                pool.set_kv_buffer(layer, out_cache_loc[:6], k, k)  # per-layer view
            else:
                pool.set_kv_buffer(layer, out_cache_loc[:6], k)
        hits, misses, gathers = (x - y for x, y in zip(stats(pool), before, strict=True))
        assert (hits, misses, gathers) == (len(layers) - 1, 1, 1)


def test_requires_registered_mapping() -> None:
    pool = SWAKVPool(8, 8, 1, torch.float32, 1, 2, [1], [0])
    with pytest.raises(RuntimeError, match="no mapping registered"):
        pool.translate_loc_from_full_to_swa(t([1]))
