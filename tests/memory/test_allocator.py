"""TokenAllocator / PagedAllocator: every method, failure paths, integrity checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.memory.allocator import PagedAllocator, TokenAllocator, make_allocator
from kvcanary.memory.errors import DoubleFreeError, IntegrityError


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def snapshot(a: PagedAllocator) -> tuple[list[int], list[bool]]:
    return a.free_pages.tolist(), a.page_allocated.tolist()


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize(
    ("size", "page_size", "num_pages", "alloc_size"),
    [(8, 1, 8, 8), (16, 4, 4, 16), (18, 4, 4, 16), (4, 4, 1, 4)],
)
def test_sizes(size: int, page_size: int, num_pages: int, alloc_size: int) -> None:
    a = make_allocator(size, page_size)
    assert isinstance(a, TokenAllocator) == (page_size == 1)
    assert (a.num_pages, a.size, a.available_size()) == (num_pages, alloc_size, alloc_size)
    assert a.free_pages.tolist() == list(range(1, num_pages + 1))  # page 0 reserved
    assert a.check_integrity()


@pytest.mark.parametrize(("size", "page_size"), [(8, 0), (3, 4)])
def test_bad_geometry(size: int, page_size: int) -> None:
    with pytest.raises(ValueError):
        PagedAllocator(size, page_size)


# ---------------------------------------------------------------- alloc
@pytest.mark.parametrize(
    ("page_size", "size", "num_tokens", "expected"),
    [
        (1, 8, 3, [1, 2, 3]),
        (1, 8, 0, []),
        (4, 16, 8, [4, 5, 6, 7, 8, 9, 10, 11]),
        (2, 8, 2, [2, 3]),
    ],
)
def test_alloc(page_size: int, size: int, num_tokens: int, expected: list[int]) -> None:
    a = make_allocator(size, page_size)
    assert a.alloc(num_tokens).tolist() == expected
    assert a.available_size() == a.size - num_tokens
    assert a.check_integrity()


def test_alloc_unaligned_raises_without_mutation() -> None:
    a = PagedAllocator(16, 4)
    before = snapshot(a)
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(6)
    assert snapshot(a) == before


@pytest.mark.parametrize(("page_size", "first", "second"), [(1, 6, 3), (4, 8, 12)])
def test_alloc_short_returns_none_and_mutates_nothing(
    page_size: int, first: int, second: int
) -> None:
    a = make_allocator(8 if page_size == 1 else 16, page_size)
    a.alloc(first)
    before = snapshot(a)
    assert a.alloc(second) is None
    assert snapshot(a) == before


# ---------------------------------------------------------------- alloc_extend
# Fresh allocator per row (free pages 1..num_pages in order). last_locs of requests with a
# prefix are slots the caller already owns; the allocator only continues them.
EXTEND_CASES = [
    # id, page_size, num_pages, prefix_lens, seq_lens, last_locs, expected slots
    ("p1-prefix0", 1, 8, [0], [3], [-1], [1, 2, 3]),
    ("p1-batch", 1, 8, [0, 2], [2, 4], [-1, 7], [1, 2, 3, 4]),
    ("p2-prefix0-partial-last", 2, 4, [0], [3], [-1], [2, 3, 4]),
    ("p2-continue-partial", 2, 4, [1], [4], [6], [7, 2, 3]),
    ("p4-prefix0-one-page", 4, 4, [0], [3], [-1], [4, 5, 6]),
    ("p4-prefix0-two-pages", 4, 4, [0], [6], [-1], [4, 5, 6, 7, 8, 9]),
    ("p4-continue-partial-then-new", 4, 4, [5], [10], [8], [9, 10, 11, 4, 5]),
    ("p4-prefix-full-page", 4, 4, [4], [6], [7], [4, 5]),
    ("p4-within-partial-only", 4, 4, [1], [3], [12], [13, 14]),
    ("p4-empty-extend", 4, 4, [3], [3], [6], []),
    # requests consume pages in batch order: req0 pages 1,2; req1 page 3; req2 page 4
    (
        "p4-batch-order",
        4,
        4,
        [0, 0, 0],
        [5, 3, 4],
        [-1, -1, -1],
        [4, 5, 6, 7, 8, 12, 13, 14, 16, 17, 18, 19],
    ),
    # req0 continues its partial page (no new page), req1 takes page 1, req2 pages 2,3
    (
        "p4-batch-mixed",
        4,
        4,
        [2, 0, 4],
        [4, 2, 11],
        [21, -1, 27],
        [22, 23, 4, 5, 8, 9, 10, 11, 12, 13, 14],
    ),
]


@pytest.mark.parametrize(
    ("page_size", "num_pages", "prefix", "seq", "last", "expected"),
    [c[1:] for c in EXTEND_CASES],
    ids=[c[0] for c in EXTEND_CASES],
)
@pytest.mark.parametrize("lens", ["host list", "tensor"])  # the Python path, the torch path
def test_alloc_extend(
    page_size: int,
    num_pages: int,
    prefix: list[int],
    seq: list[int],
    last: list[int],
    expected: list[int],
    lens: str,
) -> None:
    a = make_allocator(num_pages * page_size, page_size)
    pages = a.num_new_pages_extend(*_lens(lens, prefix, seq))
    out = a.alloc_extend(*_lens(lens, prefix, seq), t(last))
    assert out is not None and out.tolist() == expected and out.dtype == torch.int64
    assert a.num_free_pages() == num_pages - pages
    # position p of a request sits at offset p % page_size of its page
    positions = [p for pre, s in zip(prefix, seq, strict=True) for p in range(pre, s)]
    assert [s % page_size for s in expected] == [p % page_size for p in positions]
    assert a.check_integrity()


@pytest.mark.parametrize(
    ("prefix", "seq", "expected_pages"),
    [
        ([0], [1], 1),
        ([0], [4], 1),
        ([0], [5], 2),
        ([3], [5], 1),
        ([4], [5], 1),
        ([1, 0], [4, 9], 3),
    ],
)
def test_num_new_pages_extend(prefix: list[int], seq: list[int], expected_pages: int) -> None:
    assert PagedAllocator(16, 4).num_new_pages_extend(prefix, seq) == expected_pages


@pytest.mark.parametrize(
    ("prefix", "seq", "last", "error"),
    [
        ([2], [5], [4], ValueError),  # last_loc+1 not congruent with prefix_len
        ([3], [2], [6], ValueError),  # seq < prefix
        ([-1], [2], [-1], ValueError),
        ([0, 0], [1], [-1, -1], ValueError),  # length mismatch
    ],
)
@pytest.mark.parametrize("lens", ["host list", "tensor"])
def test_alloc_extend_bad_arguments_mutate_nothing(
    prefix: list[int], seq: list[int], last: list[int], error: type[Exception], lens: str
) -> None:
    a = PagedAllocator(16, 4)
    before = snapshot(a)
    with pytest.raises(error):
        a.alloc_extend(*_lens(lens, prefix, seq), t(last))
    assert snapshot(a) == before


@pytest.mark.parametrize("lens", ["host list", "tensor"])
def test_alloc_extend_short_returns_none_and_mutates_nothing(lens: str) -> None:
    a = PagedAllocator(16, 4)
    assert a.alloc_extend(*_lens(lens, [0], [9]), t([-1])) is not None  # 3 of 4 pages
    before = snapshot(a)
    assert a.alloc_extend(*_lens(lens, [0, 0], [1, 1]), t([-1, -1])) is None  # needs 2
    assert snapshot(a) == before


def _lens(kind: str, *lens: list[int]) -> list[list[int]] | list[torch.Tensor]:
    """The lengths as host lists (the Python path) or tensors (the torch path)."""
    return list(lens) if kind == "host list" else [t(v) for v in lens]


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    steps=st.lists(
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=6),
        min_size=1, max_size=8,
    ),
)
def test_alloc_extend_host_path_equals_the_torch_path(
    page_size: int, steps: list[list[tuple[int, int]]]
) -> None:  # fmt: skip
    """Host lengths (Python) and tensor lengths (torch) from the same state: the same slots,
    the same pages taken, the same refusals and errors, batch after batch (prefixes that end
    mid-page continue at a last slot of matching offset, or of a wrong one: an error)."""
    host, torch_path = (PagedAllocator(40 * page_size, page_size) for _ in range(2))
    for batch in steps:
        prefix = [q for q, _ in batch]
        seq = [q + n for q, n in batch]
        # a last slot whose offset continues the prefix, but every 7th prefix's: off by one
        last = t([-1 if q == 0 else page_size * (3 + i) + (q - 1 + (q % 7 == 3)) % page_size
                  for i, q in enumerate(prefix)])  # fmt: skip
        assert host.num_new_pages_extend(prefix, seq) == torch_path.num_new_pages_extend(
            t(prefix), t(seq))  # fmt: skip
        results = []
        for a, lens in ((host, (prefix, seq)), (torch_path, (t(prefix), t(seq)))):
            try:
                out = a.alloc_extend(*lens, last)
                results.append(None if out is None else out.tolist())
            except ValueError as e:
                results.append(f"ValueError: {e}")
        assert results[0] == results[1]
        assert snapshot(host) == snapshot(torch_path)


# ---------------------------------------------------------------- alloc_decode
@pytest.mark.parametrize(
    ("page_size", "seq_lens", "last_locs", "expected", "pages_taken"),
    [
        (1, [3, 9], [5, 2], [1, 2], 2),  # every token is its own page
        (4, [6], [8], [9], 0),  # continue in place
        (4, [5], [7], [4], 1),  # position 4 starts a page
        (4, [1], [-1], [4], 1),  # first token of a request
        (4, [5, 7, 9], [11, 21, 30], [4, 22, 8], 2),  # pages in batch order
    ],
)
@pytest.mark.parametrize("lens", ["host list", "tensor"])  # the Python path, the torch path
def test_alloc_decode(
    page_size: int, seq_lens: list[int], last_locs: list[int], expected: list[int],
    pages_taken: int, lens: str,
) -> None:  # fmt: skip
    a = make_allocator(4 * page_size, page_size)
    given_lens = seq_lens if lens == "host list" else t(seq_lens)
    assert a.num_new_pages_decode(given_lens) == pages_taken
    out = a.alloc_decode(given_lens, t(last_locs))
    assert out is not None and out.tolist() == expected and out.dtype == torch.int64
    assert a.num_free_pages() == 4 - pages_taken


@pytest.mark.parametrize("lens", ["host list", "tensor"])
def test_alloc_decode_short_returns_none_and_mutates_nothing(lens: str) -> None:
    def as_lens(v: list[int]) -> list[int] | torch.Tensor:
        return v if lens == "host list" else t(v)

    a = PagedAllocator(8, 4)
    a.alloc(4)
    before = snapshot(a)
    assert a.alloc_decode(as_lens([5, 9]), t([7, 11])) is None  # two page starts, one free page
    assert snapshot(a) == before
    assert a.alloc_decode(as_lens([6]), t([8])).tolist() == [9]  # continuing needs no page


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    steps=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=8),
)
def test_alloc_decode_host_path_equals_the_torch_path(page_size: int, steps: list[list[int]]) -> None:
    """Host lengths (Python) and tensor lengths (torch) from the same state: the same slots,
    the same pages taken, the same refusals, batch after batch."""
    host, torch_path = (PagedAllocator(48 * page_size, page_size) for _ in range(2))
    for lens in steps:
        seq = [n + 1 for n in lens]
        last = t([-1 if n == 0 else page_size * (3 + i) + (n - 1) % page_size for i, n in enumerate(lens)])
        assert host.num_new_pages_decode(seq) == torch_path.num_new_pages_decode(t(seq))
        a, b = host.alloc_decode(seq, last), torch_path.alloc_decode(t(seq), last)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.tolist() == b.tolist()
        assert snapshot(host) == snapshot(torch_path)


# ---------------------------------------------------------------- free
def test_free_is_page_granular() -> None:
    a = PagedAllocator(16, 4)
    slots = a.alloc(8)  # pages 1, 2
    a.free(slots[1:2])  # one slot frees all of page 1
    assert a.available_size() == 12
    assert a.free_pages.tolist() == [3, 4, 1]
    with pytest.raises(DoubleFreeError):
        a.free(t([6]))  # another slot of page 1
    a.free(slots[4:])
    assert a.available_size() == 16 and a.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_double_free_raises_without_mutation(page_size: int) -> None:
    a = make_allocator(4 * page_size, page_size)
    slots = a.alloc(2 * page_size)
    a.free(slots[:page_size])
    before = snapshot(a)
    with pytest.raises(DoubleFreeError):
        a.free(slots)  # half of it is already free
    assert snapshot(a) == before


@pytest.mark.parametrize("slots", [[0], [3], [16], [100]])
def test_free_reserved_or_out_of_range_raises(slots: list[int]) -> None:
    a = PagedAllocator(12, 4)  # pages 1..3 = slots 4..15
    with pytest.raises(ValueError):
        a.free(t(slots))


def test_free_empty_is_noop() -> None:
    a = PagedAllocator(8, 4)
    before = snapshot(a)
    a.free(t([]))
    assert snapshot(a) == before


def test_free_group_merges_duplicates() -> None:
    a = PagedAllocator(16, 4)
    slots = a.alloc(8)
    a.free_group_begin()
    a.free(slots[:1])
    a.free(slots[:4])  # same page again: fine inside a group
    a.free(slots[5:6])
    assert a.available_size() == 8  # nothing freed yet
    a.free_group_end()
    assert a.available_size() == 16 and a.check_integrity()


def test_free_group_double_free_detected_at_end() -> None:
    a = PagedAllocator(16, 4)
    slots = a.alloc(4)
    a.free(slots)
    a.free_group_begin()
    a.free(slots)
    with pytest.raises(DoubleFreeError):
        a.free_group_end()


def test_clear() -> None:
    a = PagedAllocator(16, 4)
    a.alloc(12)
    a.free_group_begin()
    a.clear()
    assert a.free_pages.tolist() == [1, 2, 3, 4] and a.num_used_pages() == 0
    a.free(a.alloc(4))  # not queued: clear ended the group
    assert a.available_size() == 16


# ---------------------------------------------------------------- integrity
def _dup_free(a: PagedAllocator) -> None:
    a.free_pages = torch.cat([a.free_pages, a.free_pages[:1]])


def _free_and_allocated(a: PagedAllocator) -> None:
    a.page_allocated[int(a.free_pages[0])] = True


def _reserved_allocated(a: PagedAllocator) -> None:
    a.page_allocated[0] = True


def _out_of_range_free(a: PagedAllocator) -> None:
    a.free_pages = torch.cat([a.free_pages, t([a.num_pages + 5])])


def _reserved_free(a: PagedAllocator) -> None:
    a.free_pages = torch.cat([a.free_pages, t([0])])


def _leaked_page(a: PagedAllocator) -> None:
    a.free_pages = a.free_pages[1:]  # gone from the free list, never marked allocated


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_dup_free, "duplicate"),
        (_free_and_allocated, "both free and allocated"),
        (_reserved_allocated, "reserved page 0"),
        (_out_of_range_free, "out-of-range"),
        (_reserved_free, "reserved or out-of-range"),
        (_leaked_page, "!= total"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message: str) -> None:  # type: ignore[no-untyped-def]
    a = PagedAllocator(16, 4)
    a.alloc(4)
    assert a.check_integrity()
    corrupt(a)
    with pytest.raises(IntegrityError, match=message):
        a.check_integrity()


# ---------------------------------------------------------------- property test
def _reference_extend(free: list[int], p: int, pre: list[int], seq: list[int], last: list[int]):
    """Straight-line model of alloc_extend: continue the partial page, then take pages
    (None when the free list runs out)."""
    out, free = [], list(free)
    if sum(-(-s // p) - -(-pr // p) for pr, s in zip(pre, seq, strict=True)) > len(free):
        return None
    for pr, s, ll in zip(pre, seq, last, strict=True):
        page = None
        for pos in range(pr, s):
            if pos < -(-pr // p) * p:
                out.append(ll + pos - pr + 1)
                continue
            if pos % p == 0 or page is None:
                page = free.pop(0)
            out.append(page * p + pos % p)
    return out


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(st.sampled_from(["extend", "decode", "free"]), st.integers(0, 9)), max_size=30
    ),
)
def test_random_ops_keep_invariants(page_size: int, ops: list[tuple[str, int]]) -> None:
    """Requests grow by extend/decode and are freed; free + used == total; integrity holds;
    alloc_extend matches a straight-line model; freeing everything returns every page."""
    a = make_allocator(12 * page_size, page_size)
    reqs: list[list[int]] = []  # slots per live request
    for op, n in ops:
        if op == "free" and reqs:
            a.free(t(reqs.pop(n % len(reqs))))
        elif op == "decode" and reqs:
            r = reqs[n % len(reqs)]
            out = a.alloc_decode([len(r) + 1], t([r[-1]]))
            if out is not None:
                r.append(int(out))
        elif op == "extend" and (n or reqs):
            r = reqs[n % len(reqs)] if reqs and (n % 2 or not n) else []
            pre, last = len(r), (r[-1] if r else -1)
            want = _reference_extend(a.free_pages.tolist(), page_size, [pre], [pre + n], [last])
            out = a.alloc_extend([pre], [pre + n], t([last]))
            assert (out.tolist() if out is not None else None) == want
            if out is not None:
                if r:
                    r.extend(out.tolist())
                else:
                    reqs.append(out.tolist())
        assert a.num_free_pages() + a.num_used_pages() == a.num_pages
        assert a.check_integrity()
    for r in reqs:
        if r:
            a.free(t(r))
    assert a.num_free_pages() == a.num_pages and a.num_used_pages() == 0


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "quarantine"]),
                  st.lists(st.integers(-2, 26), min_size=0, max_size=6)),
        min_size=1, max_size=12,
    ),
)  # fmt: skip
def test_free_host_path_equals_the_torch_path(page_size: int, ops: list[tuple[str, list[int]]]) -> None:
    """A host pool frees in numpy; the stand-in device ("cpu:0") keeps the torch ops: the same
    pages freed in the same free-list order, the same errors (double frees, the sink page,
    out of range, negative slots), nothing mutated by a refused free."""
    host, torch_path = PagedAllocator(6 * page_size, page_size), PagedAllocator(6 * page_size, page_size, "cpu:0")
    for a in (host, torch_path):  # pages 1..4 allocated, 2 of them quarantined while held
        a.alloc(4 * page_size)
        a.quarantine(t([page_size, 3 * page_size]))
    for op, values in ops:
        if op == "alloc":
            n = len(values) % 3 * page_size
            a, b = host.alloc(n), torch_path.alloc(n)
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert a.tolist() == b.tolist()
        elif op == "quarantine":
            assert host.quarantine(t(values)) == torch_path.quarantine(t(values))
        else:
            outcome = []
            for a in (host, torch_path):
                try:
                    a.free(t(values).to(a.device))
                    outcome.append(None)
                except (ValueError, IndexError, DoubleFreeError) as err:
                    outcome.append((type(err), str(err)))
            assert outcome[0] == outcome[1]
        assert snapshot(host) == snapshot(torch_path)
        assert host.page_quarantined.tolist() == torch_path.page_quarantined.tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(1 << 40), max_value=1 << 40), max_size=80))
def test_unique_sorted_is_numpys_unique(values: list[int]) -> None:
    """The free paths' page ids: sorted, each once, exactly ``np.unique``'s (duplicates,
    negatives, empty and single-element arrays included)."""
    import numpy as np

    from kvcanary.utils import unique_sorted

    a = np.array(values, dtype=np.int64)
    got = unique_sorted(a)
    assert got.dtype == np.int64 and got.tolist() == np.unique(a).tolist()
    assert a.tolist() == values  # the input is left as it was
