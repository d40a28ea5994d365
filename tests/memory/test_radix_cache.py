"""RadixCache: prefix reuse, page truncation, splits, locks (SWA-locking only the window,
exact release across splits), LRU eviction, SWA tombstones (also on locked paths), tombstone
recovery and the ownership contract of insert (tiny pools, window 4)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.memory.allocator import PagedAllocator, make_allocator
from kvcanary.memory.errors import IntegrityError
from kvcanary.memory.radix_cache import RadixCache, RadixNode, SwaLock
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool
from kvcanary.utils import floor_page

WINDOW = 4


def make_swa(
    page_size: int, full: int = 64, swa: int = 32, window: int = WINDOW
) -> tuple[SWAAllocator, RadixCache]:
    pool = SWAKVPool(full, swa, page_size, torch.float32, 1, 2, [1], [0])
    alloc = SWAAllocator(full, swa, page_size, kvcache=pool)
    return alloc, RadixCache(alloc, page_size, sliding_window=window)


def make_plain(page_size: int, size: int = 64) -> tuple[PagedAllocator, RadixCache]:
    alloc = make_allocator(size, page_size)
    return alloc, RadixCache(alloc, page_size)


def make(kind: str, page_size: int) -> tuple[PagedAllocator | SWAAllocator, RadixCache]:
    return make_swa(page_size) if kind == "swa" else make_plain(page_size)


def new_slots(alloc: PagedAllocator | SWAAllocator, num_tokens: int) -> torch.Tensor:
    """A fresh request's slots (no prefix), any length."""
    slots = alloc.alloc_extend([0], [num_tokens], torch.tensor([-1]))
    assert slots is not None
    return slots


def full_avail(alloc: PagedAllocator | SWAAllocator) -> int:
    return (
        alloc.full_available_size() if isinstance(alloc, SWAAllocator) else alloc.available_size()
    )


def mapping(alloc: SWAAllocator, slots: torch.Tensor) -> torch.Tensor:
    return alloc.full_to_swa_index_mapping[slots]


def check(alloc: PagedAllocator | SWAAllocator, cache: RadixCache) -> None:
    assert alloc.check_integrity()
    assert cache.check_integrity()


def cache_seq(
    alloc: SWAAllocator | PagedAllocator,
    cache: RadixCache,
    ids: list[int],
    swa_evicted_seqlen: int = 0,
) -> torch.Tensor:
    """A request computes ``ids`` from scratch, frees its first SWA pages, finishes."""
    slots = new_slots(alloc, len(ids))
    if swa_evicted_seqlen:
        alloc.free_swa(slots[:swa_evicted_seqlen])  # type: ignore[union-attr]
    cache.insert(ids, slots, swa_evicted_seqlen)
    tail = slots[floor_page(len(ids), cache.page_size) :]
    alloc.free(tail)
    return slots


KINDS_AND_PAGES = [(k, p) for k in ("plain", "swa") for p in (1, 2, 4)]


# ---------------------------------------------------------------- reuse and splits
@pytest.mark.parametrize(("kind", "page_size"), KINDS_AND_PAGES)
def test_prefix_reuse_is_page_truncated(kind: str, page_size: int) -> None:
    alloc, cache = make(kind, page_size)
    ids = [1, 2, 3, 4, 5, 6, 7]
    slots = cache_seq(alloc, cache, ids)
    kept = floor_page(7, page_size)
    assert cache.total_size() == kept
    for query, expect in [
        (ids, kept),
        (ids + [9, 9], kept),
        (ids[:5], floor_page(5, page_size)),
        ([2, 3], 0),
        ([], 0),
    ]:
        m = cache.match_prefix(query)
        assert m.num_tokens == expect
        assert m.device_indices.tolist() == slots[:expect].tolist()
        assert (m.last_node is cache.root) == (expect == 0)
    check(alloc, cache)


@pytest.mark.parametrize(("kind", "page_size"), KINDS_AND_PAGES)
def test_insert_again_returns_cached_len_and_frees_duplicates(kind: str, page_size: int) -> None:
    alloc, cache = make(kind, page_size)
    ids = list(range(1, 9))
    first = cache_seq(alloc, cache, ids)
    before = full_avail(alloc)
    dup = new_slots(alloc, 8)
    assert cache.insert(ids, dup) == 8
    assert full_avail(alloc) == before  # the duplicates went back
    assert cache.match_prefix(ids).device_indices.tolist() == first.tolist()
    # The tree's own slots (as match_prefix handed them out) are recognised, not freed.
    own = cache.match_prefix(ids).device_indices
    assert cache.insert(ids, own) == 8
    assert full_avail(alloc) == before
    check(alloc, cache)


@pytest.mark.parametrize(
    ("page_size", "second", "split_len"),
    [
        (1, [1, 2, 3, 4, 5, 9, 9, 9], 5),
        (2, [1, 2, 3, 4, 5, 9, 9, 9], 4),
        (4, [1, 2, 3, 4, 5, 9, 9, 9], 4),
        (4, [1, 2, 3, 9, 5, 6, 7, 8], 0),
        (2, [1, 2, 3, 4, 5, 6, 9, 9], 6),
    ],
)
def test_diverging_insert_splits_on_page_boundary(
    page_size: int, second: list[int], split_len: int
) -> None:
    alloc, cache = make_plain(page_size)
    first_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    a = cache_seq(alloc, cache, first_ids)
    b = new_slots(alloc, 8)
    assert cache.insert(second, b) == split_len
    if split_len:
        (head,) = cache.root.children.values()
        assert head.key == first_ids[:split_len]
        heads = sorted(c.key[0] for c in head.children.values())
        assert heads == sorted([first_ids[split_len], second[split_len]])
    else:
        assert len(cache.root.children) == 2
    assert cache.total_size() == 16 - split_len
    assert cache.match_prefix(first_ids).device_indices.tolist() == a.tolist()
    expect_b = a[:split_len].tolist() + b[split_len:].tolist()
    assert cache.match_prefix(second).device_indices.tolist() == expect_b
    check(alloc, cache)


def test_match_splits_node_so_last_node_covers_the_match() -> None:
    alloc, cache = make_plain(1)
    cache_seq(alloc, cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 7])
    assert (m.num_tokens, m.last_node.key) == (3, [1, 2, 3])
    assert [c.key for c in m.last_node.children.values()] == [[4, 5, 6]]
    check(alloc, cache)


def test_insert_copies_the_callers_slots() -> None:
    alloc, cache = make_plain(1)
    row = new_slots(alloc, 4)
    expect = row.tolist()
    cache.insert([1, 2, 3, 4], row)
    row[:] = 0  # e.g. the req_to_token row is reused
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == expect


def test_insert_rejects_bad_arguments_without_mutation() -> None:
    alloc, cache = make_plain(1)
    slots = new_slots(alloc, 4)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], slots[:3])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], slots, swa_evicted_seqlen=2)  # not window-aware
    assert cache.total_size() == 0
    with pytest.raises(ValueError):
        RadixCache(alloc, page_size=2)


# ---------------------------------------------------------------- locks and eviction
@pytest.mark.parametrize(("kind", "page_size"), KINDS_AND_PAGES)
def test_lock_protects_the_path(kind: str, page_size: int) -> None:
    alloc, cache = make(kind, page_size)
    cache_seq(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    cache_seq(alloc, cache, [1, 2, 3, 4, 9, 9, 9, 9])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    lock = cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (8, 4)
    full, swa = cache.evict(100, 100)
    assert full == 4 and cache.total_size() == 8  # a locked path is never evicted
    # ... but outside the SWA-locked window [4, 8) its SWA goes: the head is tombstoned.
    assert cache.num_tombstones() == (1 if kind == "swa" else 0)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 8
    cache.dec_lock_ref(m.last_node, lock)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 8)
    assert cache.evict(100) == (8, 4 if kind == "swa" else 0)
    assert cache.total_size() == 0
    check(alloc, cache)


def test_unbalanced_unlock_raises() -> None:
    alloc, cache = make_plain(1)
    cache_seq(alloc, cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node, SwaLock(2, 0))
    cache.dec_lock_ref(cache.root, cache.inc_lock_ref(cache.root))  # the root: a no-op
    cache.dec_lock_ref(node, cache.inc_lock_ref(node))
    assert cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
def test_lru_evicts_older_unlocked_leaves_first(page_size: int) -> None:
    alloc, cache = make_plain(page_size)
    for first in (10, 20, 30):
        cache_seq(alloc, cache, [first, 1, 2, 3])
    cache.match_prefix([10, 1, 2, 3])  # touch the oldest: 20 is now LRU
    assert cache.evict(1) == (4, 0)
    assert cache.match_prefix([20, 1, 2, 3]).num_tokens == 0
    assert cache.evict(1) == (4, 0)
    assert cache.match_prefix([30, 1, 2, 3]).num_tokens == 0
    assert cache.match_prefix([10, 1, 2, 3]).num_tokens == 4
    check(alloc, cache)


@pytest.mark.parametrize(
    ("page_size", "ask", "freed"),
    [(1, 0, 0), (1, 1, 2), (1, 2, 2), (1, 3, 4), (2, 1, 2), (4, 1, 4), (4, 5, 8), (4, 99, 8)],
)
def test_evict_returns_tokens_freed(page_size: int, ask: int, freed: int) -> None:
    alloc, cache = make_plain(page_size)
    width = max(2, page_size)
    cache_seq(alloc, cache, [1] * width)
    cache_seq(alloc, cache, [2] * width)
    before = alloc.available_size()
    assert cache.evict(ask) == (freed, 0)
    assert alloc.available_size() == before + freed
    check(alloc, cache)


def test_evict_cascades_to_parents_that_become_leaves() -> None:
    alloc, cache = make_plain(1)
    cache_seq(alloc, cache, [1, 2, 3, 4])
    cache_seq(alloc, cache, [1, 2, 5, 6])
    assert cache.evict(5) == (6, 0)
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


# ---------------------------------------------------------------- SWA locks (window only)
def spans(cache: RadixCache) -> list[tuple[int, int, int, int, bool]]:
    """(start, num_tokens, lock_ref, swa_lock_ref, tombstone) of every node, by position."""
    out = [
        (s.prefix_len, len(s.node.key), s.node.lock_ref, s.node.swa_lock_ref, s.node.tombstone)
        for s in cache.iter_cached()
    ]
    return sorted(out)


def locked_chain(
    page_size: int, window: int, lens: list[int]
) -> tuple[SWAAllocator, RadixCache, list[int], RadixNode, SwaLock]:
    """A chain with node boundaries at ``lens`` (``range(lens[-1])``), locked at its end."""
    alloc, cache = make_swa(page_size, window=window)
    for n in lens:
        cache_seq(alloc, cache, list(range(n)))
    ids = list(range(lens[-1]))
    node = cache.match_prefix(ids).last_node
    return alloc, cache, ids, node, cache.inc_lock_ref(node)


@pytest.mark.parametrize(
    ("page_size", "window", "lens", "swa_start", "boundaries"),
    [
        (1, 4, [12], 8, [0, 8]),  # one long node: split at end - W
        (2, 4, [12], 8, [0, 8]),
        (4, 4, [12], 8, [0, 8]),
        (2, 3, [12], 8, [0, 8]),  # rounded out to a page: 4 >= W tokens
        (4, 5, [12], 4, [0, 4]),  # floor_page(7, 4) = 4
        (4, 4, [4, 8, 12], 8, [0, 4, 8]),  # the window is a whole node: no split
        (2, 6, [4, 8, 12], 6, [0, 4, 6, 8]),  # the window starts inside [4, 8)
        (1, 4, [3], 0, [0]),  # shorter than the window: the whole path
    ],
)
def test_swa_lock_covers_only_the_last_window(
    page_size: int, window: int, lens: list[int], swa_start: int, boundaries: list[int]
) -> None:
    alloc, cache, _, node, lock = locked_chain(page_size, window, lens)
    end = lens[-1]
    assert lock == SwaLock(end, swa_start)
    assert [s[0] for s in spans(cache)] == boundaries
    assert all(s[2] == 1 and s[3] == int(s[0] >= swa_start) for s in spans(cache))
    assert (cache.protected_size(), cache.evictable_size()) == (end, 0)
    assert (cache.swa_protected_size(), cache.swa_evictable_size()) == (end - swa_start, swa_start)
    cache.dec_lock_ref(node, lock)
    assert all(s[2] == s[3] == 0 for s in spans(cache))
    assert cache.swa_protected_size() == 0
    check(alloc, cache)


def test_plain_cache_lock_is_the_whole_path() -> None:
    alloc, cache = make_plain(2)
    cache_seq(alloc, cache, list(range(12)))
    node = cache.match_prefix(list(range(12))).last_node
    lock = cache.inc_lock_ref(node)
    assert lock == SwaLock(12, 0) and len(spans(cache)) == 1  # no window: no split
    assert cache.dec_swa_lock_only(node, lock) == SwaLock(12, 12)
    cache.dec_lock_ref(node, SwaLock(12, 12))
    check(alloc, cache)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_swa_evict_tombstones_the_unlocked_part_of_a_locked_path(page_size: int) -> None:
    alloc, cache, ids, node, lock = locked_chain(page_size, WINDOW, [12])
    slots = cache.match_prefix(ids).device_indices
    swa0 = alloc.swa_available_size()
    assert cache.evict(100, 100) == (0, 8)  # nothing to delete; [0, 8) loses its SWA
    assert alloc.swa_available_size() == swa0 + 8
    assert spans(cache) == [(0, 8, 1, 0, True), (8, 4, 1, 1, False)]
    assert mapping(alloc, slots[:8]).eq(0).all() and mapping(alloc, slots[8:]).gt(0).all()
    assert cache.match_prefix(ids).num_tokens == 12  # the locked window is resident
    assert cache.evict(100, 100) == (0, 0)
    check(alloc, cache)
    # A request extends from its locked node: cache_unfinished, relock, release the old.
    own = alloc.alloc_extend([12], [16], slots[-1:])
    assert own is not None
    row = torch.cat([slots, own])
    m2 = cache.cache_unfinished(ids + [90, 91, 92, 93], row, swa_evicted_seqlen=12)
    assert m2 is not None and m2.device_indices.tolist() == row.tolist()
    lock2 = cache.inc_lock_ref(m2.last_node)
    cache.dec_lock_ref(node, lock)
    assert lock2 == SwaLock(16, 12)
    assert spans(cache) == [(0, 8, 1, 0, True), (8, 4, 1, 0, False), (12, 4, 1, 1, False)]
    assert cache.evict(0, 100) == (0, 4)  # [8, 12) is outside the new window now
    assert cache.match_prefix(ids + [90, 91, 92, 93]).num_tokens == 16
    cache.dec_lock_ref(m2.last_node, lock2)
    cache.free_all()
    check(alloc, cache)
    assert alloc.full_available_size() == alloc.size_full
    assert alloc.swa_available_size() == alloc.size_swa


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("node_is_leaf", [True, False])
def test_dec_swa_lock_only_lets_the_window_be_tombstoned(
    page_size: int, node_is_leaf: bool
) -> None:
    alloc, cache, ids, node, lock = locked_chain(page_size, WINDOW, [12])
    if not node_is_leaf:
        cache_seq(alloc, cache, ids + [50, 51, 52, 53])  # another request's continuation
    assert cache.evict(0, 1) == (0, 8)  # the LRU unlocked live node first: the old head
    swa_lock = cache.dec_swa_lock_only(node, lock)
    assert swa_lock == SwaLock(12, 12)
    assert cache.dec_swa_lock_only(node, swa_lock) == swa_lock  # idempotent
    assert cache.swa_protected_size() == 0
    assert cache.evict(0, 1) == (0, 4)  # [8, 12) is older than the continuation
    # A locked leaf may be a tombstone (its request released the SWA lock) ...
    assert spans(cache)[:2] == [(0, 8, 1, 0, True), (8, 4, 1, 0, True)]
    assert cache.match_prefix(ids).num_tokens == 0
    check(alloc, cache)
    # ... and stays one when its unlocked continuation is evicted ...
    assert cache.evict(100)[0] == (0 if node_is_leaf else 4)
    assert spans(cache) == [(0, 8, 1, 0, True), (8, 4, 1, 0, True)]
    check(alloc, cache)
    # ... until it is unlocked: then it goes with its tombstone ancestors.
    cache.dec_lock_ref(node, swa_lock)
    assert cache.total_size() == 0 and alloc.full_available_size() == alloc.size_full
    check(alloc, cache)


@pytest.mark.parametrize(
    ("page_size", "window", "cut"), [(1, 4, 14), (2, 4, 14), (4, 8, 12), (2, 6, 12)]
)
def test_split_of_a_swa_locked_node_keeps_locks_exact(
    page_size: int, window: int, cut: int
) -> None:
    alloc, cache, ids, node, lock = locked_chain(page_size, window, [16])
    swa_start = 16 - window
    assert lock == SwaLock(16, swa_start) and swa_start < cut
    # Another request diverges inside the SWA-locked node: both halves stay locked.
    cache_seq(alloc, cache, ids[:cut] + [99] * page_size)
    assert [s for s in spans(cache) if s[0] >= swa_start and s[2]] == [
        (swa_start, cut - swa_start, 1, 1, False),
        (cut, 16 - cut, 1, 1, False),
    ]
    assert cache.swa_protected_size() == window
    cache.evict(100, 100)
    assert cache.total_size() == 16 and cache.swa_protected_size() == window
    cache.dec_lock_ref(node, lock)  # releases both halves, exactly
    assert all(s[2] == s[3] == 0 for s in spans(cache))
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node, lock)
    check(alloc, cache)


@pytest.mark.parametrize(
    ("page_size", "window", "old_len", "new_len"),
    [(1, 4, 6, 8), (2, 4, 6, 8), (4, 8, 12, 16), (4, 4, 8, 16)],
)
def test_relock_on_a_descendant_then_release_the_old_lock(
    page_size: int, window: int, old_len: int, new_len: int
) -> None:
    """The cache_unfinished pair: the new lock splits inside the old lock's SWA range."""
    alloc, cache, _, old_node, old_lock = locked_chain(page_size, window, [old_len])
    ids = list(range(new_len))
    prefix = cache.match_prefix(ids).device_indices
    own = alloc.alloc_extend([old_len], [new_len], prefix[-1:])
    assert own is not None
    m = cache.cache_unfinished(ids, torch.cat([prefix, own]))
    assert m is not None
    new_lock = cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(old_node, old_lock)
    new_start = floor_page(new_len - window, page_size)
    assert new_lock == SwaLock(new_len, new_start)
    assert all(s[2] == 1 and s[3] == int(s[0] >= new_start) for s in spans(cache))
    cache.dec_lock_ref(m.last_node, new_lock)
    assert cache.protected_size() == cache.swa_protected_size() == 0
    cache.free_all()
    assert alloc.full_available_size() == alloc.size_full
    check(alloc, cache)


def test_unbalanced_release_raises_without_mutation() -> None:
    alloc, cache, ids, node, lock = locked_chain(1, WINDOW, [12])
    head = cache.match_prefix(ids[:8]).last_node  # [0, 8): full-locked only
    before = spans(cache)
    for bad_node, bad_lock in [
        (node, SwaLock(11, 8)),  # not this path's length
        (node, SwaLock(12, 9)),  # SWA start inside a node
        (node, SwaLock(12, 0)),  # claims SWA on [0, 8), never taken
        (head, SwaLock(8, 0)),  # idem, on the head itself
    ]:
        for release in (cache.dec_lock_ref, cache.dec_swa_lock_only):
            with pytest.raises(ValueError):
                release(bad_node, bad_lock)
            assert spans(cache) == before
    cache.dec_lock_ref(node, lock)
    for release in (cache.dec_lock_ref, cache.dec_swa_lock_only):
        with pytest.raises(ValueError):
            release(node, lock)  # twice
        with pytest.raises(ValueError):
            release(head, SwaLock(8, 8))  # nothing holds it any more
    check(alloc, cache)


# ---------------------------------------------------------------- SWA tombstones
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_tombstoned_prefix_needs_a_resident_window(page_size: int) -> None:
    alloc, cache = make_swa(page_size)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    slots = cache_seq(alloc, cache, ids, swa_evicted_seqlen=4)
    assert cache.num_tombstones() == 1
    assert (cache.swa_evictable_size(), cache.evictable_size()) == (4, 8)
    assert cache.match_prefix(ids[:4]).num_tokens == 0  # its SWA was freed
    assert cache.match_prefix(ids[:6]).num_tokens == 0  # 2 resident < window 4
    m = cache.match_prefix(ids)  # 4 resident >= window: the whole path
    assert m.device_indices.tolist() == slots.tolist() and m.last_node.key == ids[4:]
    assert mapping(alloc, slots[:4]).eq(0).all() and mapping(alloc, slots[4:]).gt(0).all()
    check(alloc, cache)


def test_match_truncates_to_before_the_first_tombstone() -> None:
    alloc, cache = make_swa(1)
    for n in (4, 8, 10):
        cache_seq(alloc, cache, list(range(1, n + 1)))  # [1..4] -> [5..8] -> [9, 10]
    head = cache.match_prefix([1, 2, 3, 4]).last_node
    lock = cache.inc_lock_ref(head)
    assert cache.evict(0, 1) == (0, 4)  # [5..8] is the LRU unlocked live node: tombstoned
    cache.dec_lock_ref(head, lock)
    m = cache.match_prefix(list(range(1, 11)))
    assert (m.num_tokens, m.last_node.key) == (4, [1, 2, 3, 4])
    check(alloc, cache)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_swa_evict_tombstones_internal_nodes_and_keeps_full_kv(page_size: int) -> None:
    alloc, cache = make_swa(page_size)
    a = cache_seq(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    b = cache_seq(alloc, cache, [1, 2, 3, 4, 9, 9, 9, 9])  # head [1..4] -> {[5..8], [9..]}
    full0, swa0 = alloc.full_available_size(), alloc.swa_available_size()
    # LRU live nodes: leaf [5..8] (deleted: both sides), then the head (internal: tombstoned).
    assert cache.evict(0, 5) == (4, 8)
    assert cache.num_tombstones() == 1 and cache.total_size() == 8
    assert alloc.full_available_size() == full0 + 4 and alloc.swa_available_size() == swa0 + 8
    assert mapping(alloc, a[:4]).eq(0).all()  # full KV of the head kept, SWA gone
    m = cache.match_prefix([1, 2, 3, 4, 9, 9, 9, 9])  # 4 resident tokens after the tombstone
    assert m.device_indices.tolist() == a[:4].tolist() + b[4:].tolist()
    check(alloc, cache)
    # Full eviction of the last leaf deletes the tombstone too: leaves are never tombstones.
    assert cache.evict(1) == (8, 4)
    assert cache.total_size() == 0 and cache.num_tombstones() == 0
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (
        alloc.size_full,
        alloc.size_swa,
    )
    check(alloc, cache)


def test_swa_lru_prefers_ancestors_on_a_chain() -> None:
    alloc, cache = make_swa(1)
    cache_seq(alloc, cache, [1, 2, 3, 4])
    cache_seq(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])  # touch stamps root -> leaf
    assert cache.evict(0, 1) == (0, 4)  # the head goes first, the window near the leaf stays
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 8
    check(alloc, cache)


def test_swa_evict_of_a_leaf_deletes_it_and_tombstone_parents() -> None:
    alloc, cache = make_swa(1)
    cache_seq(alloc, cache, [1, 2, 3, 4, 5, 6], swa_evicted_seqlen=2)  # tomb [1,2] -> [3..6]
    assert cache.evict(0, 1) == (6, 4)
    assert cache.total_size() == 0
    check(alloc, cache)


def test_reference_example_tombstoned_prefix() -> None:
    """swa_pools.md §7 (page 1, window 4): a tombstoned [1,2,3] under [4,5] -> {[60,70]}."""
    alloc, cache = make_swa(1, full=128, swa=64)
    for ids in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]):
        cache_seq(alloc, cache, ids)
    assert cache.evict(1, 0) == (2, 2)  # leaf [6, 7] (LRU leaf)
    assert cache.evict(0, 1) == (3, 3)  # leaf [10, 11, 12] (LRU live node)
    assert cache.evict(0, 1) == (0, 3)  # internal [1, 2, 3] -> tombstone
    assert cache.match_prefix([1, 2, 3, 4, 5]).num_tokens == 0
    m = cache.match_prefix([1, 2, 3, 4, 5, 60, 70])
    assert m.num_tokens == 7 and m.last_node.key == [60, 70]
    check(alloc, cache)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_tail_that_lost_its_window_is_not_cached(page_size: int) -> None:
    alloc, cache = make_swa(page_size)
    cache_seq(alloc, cache, [1, 2, 3, 4])
    before = alloc.full_available_size()
    slots = new_slots(alloc, 8)
    alloc.free_swa(slots)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], slots, swa_evicted_seqlen=8) == 4
    assert alloc.full_available_size() == before  # all 8 freed: duplicates and the tail
    assert cache.total_size() == 4
    check(alloc, cache)


def test_insert_rejects_unreported_window_eviction() -> None:
    alloc, cache = make_swa(2)
    slots = new_slots(alloc, 8)
    alloc.free_swa(slots[:4])
    with pytest.raises(ValueError):
        cache.insert(list(range(8)), slots, swa_evicted_seqlen=2)
    assert cache.total_size() == 0
    cache.insert(list(range(8)), slots, swa_evicted_seqlen=4)
    check(alloc, cache)


def test_insert_frees_swa_left_below_the_reported_frontier() -> None:
    alloc, cache = make_swa(1)
    slots = new_slots(alloc, 8)
    swa0 = alloc.swa_available_size()
    cache.insert(list(range(8)), slots, swa_evicted_seqlen=3)
    assert alloc.swa_available_size() == swa0 + 3
    check(alloc, cache)


# ---------------------------------------------------------------- tombstone recovery
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_tombstone_recovery_takes_the_incoming_swa(page_size: int) -> None:
    alloc, cache = make_swa(page_size)
    old = cache_seq(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8], swa_evicted_seqlen=4)
    assert cache.match_prefix([1, 2, 3, 4, 20, 21, 22, 23]).num_tokens == 0
    full0, swa0 = alloc.full_available_size(), alloc.swa_available_size()
    mine = new_slots(alloc, 8)  # recomputed [1..4] with SWA
    my_swa = mapping(alloc, mine[:4]).clone()
    assert cache.insert([1, 2, 3, 4, 20, 21, 22, 23], mine) == 4
    assert cache.num_tombstones() == 0
    assert mapping(alloc, old[:4]).tolist() == my_swa.tolist()  # old full slots, new SWA
    assert mapping(alloc, mine[:4]).eq(0).all()
    assert alloc.full_available_size() == full0 - 4  # the duplicates' full slots went back
    assert alloc.swa_available_size() == swa0 - 8  # the SWA slots all live on in the tree
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.device_indices.tolist() == old[:4].tolist()
    check(alloc, cache)


def test_partial_recovery_splits_the_tombstone() -> None:
    alloc, cache = make_swa(2)
    cache_seq(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8], swa_evicted_seqlen=4)
    mine = new_slots(alloc, 8)
    alloc.free_swa(mine[:2])
    cache.insert([1, 2, 3, 4, 9, 9, 9, 9], mine, swa_evicted_seqlen=2)
    tomb = cache.root.children[(1, 2)]
    assert tomb.tombstone and tomb.key == [1, 2]
    (live,) = tomb.children.values()
    assert not live.tombstone and live.key == [3, 4]
    check(alloc, cache)


def test_recovery_under_a_lock_keeps_the_locked_slots() -> None:
    alloc, cache = make_swa(1)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    cache_seq(alloc, cache, ids, swa_evicted_seqlen=4)
    held = cache.match_prefix(ids)  # usable: 4 resident tokens follow the tombstone
    assert held.num_tokens == 8
    lock = cache.inc_lock_ref(held.last_node)
    mine = new_slots(alloc, 6)
    cache.insert([1, 2, 3, 4, 30, 31], mine)
    assert cache.num_tombstones() == 0
    assert cache.match_prefix(ids).device_indices.tolist() == held.device_indices.tolist()
    cache.dec_lock_ref(held.last_node, lock)
    check(alloc, cache)


def test_recovery_of_the_callers_own_tail_inside_a_tombstone() -> None:
    alloc, cache = make_swa(2)
    tree = cache_seq(alloc, cache, list(range(12)), swa_evicted_seqlen=8)  # tomb [0,8) live [8,12)
    mine = torch.cat([tree[:4], new_slots(alloc, 8)])  # the tree's [0,4), its own [4,12)
    cache.insert(list(range(12)), mine)
    spans = [(s.prefix_len, len(s.node.key), s.node.tombstone) for s in cache.iter_cached()]
    assert spans == [(0, 4, True), (4, 4, False), (8, 4, False)]
    assert cache.match_prefix(list(range(8))).device_indices.tolist() == tree[:8].tolist()
    check(alloc, cache)


# ---------------------------------------------------------------- running requests
def test_truncating_a_gated_match_can_leave_the_window() -> None:
    """Why callers pass ``ids[:-1]`` instead of truncating a match afterwards."""
    alloc, cache = make_swa(4)
    ids = list(range(12))
    cache_seq(alloc, cache, ids, swa_evicted_seqlen=8)  # tomb [0,8) live [8,12)
    assert cache.match_prefix(ids).num_tokens == 12  # usable: 4 resident tokens at the end
    # ... but position 8 is not a usable point: SWA for [4, 8) is gone.
    assert cache.match_prefix(ids[:-1]).num_tokens == 0


def test_cache_unfinished_is_not_window_gated_and_never_frees_under_the_request() -> None:
    alloc, cache = make_swa(4, window=6)
    ids = [7] * 10
    slots = alloc.alloc_extend_swa_tail(0, 10, -1, 6)  # SWA only for [4, 10)
    assert slots is not None
    before = alloc.full_available_size()
    m = cache.cache_unfinished(ids, slots, swa_evicted_seqlen=4)
    assert m is not None and m.num_tokens == 8 and not m.last_node.tombstone
    assert m.device_indices.tolist() == slots[:8].tolist()  # nothing was a duplicate
    assert alloc.full_available_size() == before  # nothing freed
    # A gated match cannot use it (4 resident < window 6), the request can (it holds [8, 10)).
    assert cache.match_prefix(ids).num_tokens == 0
    lock = cache.inc_lock_ref(m.last_node)
    assert lock == SwaLock(8, 4)  # the SWA lock stops at the tombstone [0, 4)
    assert cache.evict(100, 100) == (0, 0)
    cache.dec_lock_ref(m.last_node, lock)
    check(alloc, cache)


def test_cache_unfinished_hands_back_the_trees_slots_for_duplicates() -> None:
    alloc, cache = make_swa(2)
    ids = list(range(9))
    first = cache_seq(alloc, cache, ids)
    mine = new_slots(alloc, 9)  # computed concurrently, its own copy
    before = alloc.full_available_size()
    m = cache.cache_unfinished(ids, mine)
    assert m is not None and m.num_tokens == 8
    assert m.device_indices.tolist() == first[:8].tolist()  # re-point onto these
    assert alloc.full_available_size() == before + 8  # its duplicates went back; [8] is its own
    alloc.free(mine[8:])
    check(alloc, cache)


@pytest.mark.parametrize(
    ("num_tokens", "lost_swa", "evicted"),
    [
        (3, (0, 0), 0),  # no whole page
        (9, (0, 8), 8),  # every whole page is before the reported frontier
        (8, (4, 8), 0),  # the last page lost its SWA (unreported)
    ],
)
def test_cache_unfinished_refuses_without_a_live_last_page(
    num_tokens: int, lost_swa: tuple[int, int], evicted: int
) -> None:
    alloc, cache = make_swa(4)
    slots = new_slots(alloc, num_tokens)
    alloc.free_swa(slots[lost_swa[0] : lost_swa[1]])
    before = (alloc.full_available_size(), alloc.swa_available_size())
    assert cache.cache_unfinished(list(range(num_tokens)), slots, evicted) is None
    assert (alloc.full_available_size(), alloc.swa_available_size()) == before
    assert cache.total_size() == 0


# ---------------------------------------------------------------- walk, reset, integrity
def test_iter_cached_and_all_values() -> None:
    alloc, cache = make_plain(1)
    a = cache_seq(alloc, cache, [1, 2, 3, 4])
    b = cache_seq(alloc, cache, [1, 2, 7])
    spans = {tuple(s.node.key): (s.prefix_len, s.slots.tolist()) for s in cache.iter_cached()}
    assert spans == {
        (1, 2): (0, a[:2].tolist()),
        (3, 4): (2, a[2:].tolist()),
        (7,): (2, b[2:].tolist()),
    }
    assert sorted(cache.all_values().tolist()) == sorted(a.tolist() + b[2:].tolist())


@pytest.mark.parametrize(("kind", "page_size"), KINDS_AND_PAGES)
def test_free_all_returns_every_slot(kind: str, page_size: int) -> None:
    alloc, cache = make(kind, page_size)
    cache_seq(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8], swa_evicted_seqlen=4 if kind == "swa" else 0)
    cache_seq(alloc, cache, [1, 2, 3, 4, 9, 9])
    node = cache.match_prefix([1, 2, 3, 4, 9, 9]).last_node
    lock = cache.inc_lock_ref(node)
    with pytest.raises(ValueError):
        cache.free_all()
    cache.dec_lock_ref(node, lock)
    cache.free_all()
    assert cache.total_size() == 0
    if isinstance(alloc, SWAAllocator):
        assert (alloc.full_available_size(), alloc.swa_available_size()) == (
            alloc.size_full,
            alloc.size_swa,
        )
    else:
        assert alloc.available_size() == alloc.size
    check(alloc, cache)


def test_reset_forgets_without_freeing() -> None:
    alloc, cache = make_plain(1)
    cache_seq(alloc, cache, [1, 2, 3])
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size - 3
    alloc.clear()
    check(alloc, cache)


def test_check_integrity_reports_breakage() -> None:
    alloc, cache = make_swa(1)
    cache_seq(alloc, cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    node.tombstone = True  # a tombstone leaf, still mapped, counters stale
    with pytest.raises(IntegrityError, match="tombstone leaf.*counters|counters"):
        cache.check_integrity()
    node.tombstone = False
    alloc.free(node.value)  # the tree now holds free slots
    with pytest.raises(IntegrityError, match="free slot"):
        cache.check_integrity()


def test_invalidate_drops_the_nodes_holding_a_slot_and_their_subtrees() -> None:
    alloc = make_allocator(64, 2)
    cache = RadixCache(alloc, 2)
    a = alloc.alloc(8)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], a)
    b = torch.cat([a[:4], alloc.alloc(4)])
    cache.insert([1, 2, 3, 4, 9, 9, 9, 9], b)  # shares [1..4] with a, diverges after
    c = alloc.alloc(4)
    cache.insert([7, 7, 7, 7], c)
    free_before = alloc.available_size()
    # A slot of the shared prefix: the prefix and both continuations go; [7,7,7,7] stays.
    assert cache.invalidate(a[2:3]) == 12
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 0
    assert cache.match_prefix([7, 7, 7, 7]).num_tokens == 4
    assert alloc.available_size() == free_before + 12
    cache.check_integrity()
    alloc.check_integrity()


def test_invalidate_leaves_locked_subtrees_alone() -> None:
    alloc = make_allocator(32, 1)
    cache = RadixCache(alloc, 1)
    slots = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    m = cache.match_prefix([1, 2, 3, 4])
    lock = cache.inc_lock_ref(m.last_node)
    assert cache.invalidate(slots[:1]) == 0
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 4
    cache.dec_lock_ref(m.last_node, lock)
    assert cache.invalidate(slots[:1]) == 4
    cache.check_integrity()
