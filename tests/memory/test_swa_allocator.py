"""SWAAllocator: lockstep allocation, the tail-only path, frees, mapping integrity."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.memory import pages_nb
from kvcanary.memory.errors import DoubleFreeError, IntegrityError
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.utils import cdiv, swa_tail_len


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def snapshot(a: SWAAllocator) -> tuple[list[int], ...]:
    return (
        a.full_attn_allocator.free_pages.tolist(),
        a.full_attn_allocator.page_allocated.tolist(),
        a.swa_attn_allocator.free_pages.tolist(),
        a.swa_attn_allocator.page_allocated.tolist(),
        a.full_to_swa_index_mapping.tolist(),
    )


def mapped(a: SWAAllocator, full: torch.Tensor) -> list[int]:
    return a.full_to_swa_index_mapping[full].tolist()


# ---------------------------------------------------------------- construction, sizes
def test_construction() -> None:
    a = SWAAllocator(full_size=32, swa_size=16, page_size=4)
    m = a.full_to_swa_index_mapping
    assert m.dtype == torch.int64 and m.numel() == 32 + 4 + 1
    assert int(m[-1]) == -1 and not bool(m[:-1].any())
    assert (a.size_full, a.size_swa, a.size) == (32, 16, 16)
    assert a.full_available_size() + a.swa_available_size() == a.size_full + a.size_swa
    assert a.check_integrity()


def test_available_size_is_min() -> None:
    a = SWAAllocator(32, 16, 4)
    assert a.available_size() == 16
    a.full_attn_allocator.alloc(24)  # full side now the smaller one
    assert (a.full_available_size(), a.swa_available_size(), a.available_size()) == (8, 16, 8)


def test_mapping_tensor_is_never_reallocated() -> None:
    a = SWAAllocator(16, 16, 1)
    ptr = a.full_to_swa_index_mapping.data_ptr()
    a.free(a.alloc(4))
    a.clear()
    a.set_full_to_swa_mapping(t([3]), t([5]))
    assert a.full_to_swa_index_mapping.data_ptr() == ptr == a.mapping.tensor.data_ptr()


# ---------------------------------------------------------------- alloc (page 1)
def test_alloc_page1() -> None:
    a = SWAAllocator(8, 6, 1)
    full = a.alloc(3)
    assert full.tolist() == [1, 2, 3] and mapped(a, full) == [1, 2, 3]
    assert (a.full_available_size(), a.swa_available_size()) == (5, 3)
    a.free(full[:1])
    full2 = a.alloc(2)  # full 4,5; SWA 4,5 (slot 1 went to the back of the free list)
    assert full2.tolist() == [4, 5] and mapped(a, full2) == [4, 5]
    assert a.check_integrity()


@pytest.mark.parametrize(("full_size", "swa_size"), [(4, 8), (8, 4)])
def test_alloc_short_side_returns_none_without_mutation(full_size: int, swa_size: int) -> None:
    a = SWAAllocator(full_size, swa_size, 1)
    a.alloc(2)
    before = snapshot(a)
    assert a.alloc(3) is None
    assert snapshot(a) == before


def test_alloc_rejects_paged() -> None:
    with pytest.raises(ValueError, match="page_size=1"):
        SWAAllocator(16, 16, 4).alloc(4)


# ---------------------------------------------------------------- alloc_extend / alloc_decode
def test_alloc_extend_lockstep_and_continuation() -> None:
    a = SWAAllocator(32, 16, 4)
    full = a.alloc_extend([0, 0], [6, 3], t([-1, -1]))
    assert full.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    swa = mapped(a, full)
    assert swa == [4, 5, 6, 7, 8, 9, 12, 13, 14]  # SWA pages 1,2 / 3
    # continue request 0 (prefix 6, its last slot 9 is mid-page) through the mapping
    more = a.alloc_extend([6], [10], t([9]))
    assert more.tolist() == [10, 11, 16, 17]
    assert mapped(a, more) == [10, 11, 4 * 4, 4 * 4 + 1]
    assert all(f % 4 == s % 4 for f, s in zip(more.tolist(), mapped(a, more), strict=True))
    assert a.check_integrity()


@pytest.mark.parametrize(("full_size", "swa_size"), [(8, 32), (32, 8)])
def test_alloc_extend_short_side_returns_none_without_mutation(
    full_size: int, swa_size: int
) -> None:
    a = SWAAllocator(full_size, swa_size, 4)
    a.alloc_extend([0], [4], t([-1]))
    before = snapshot(a)
    assert a.alloc_extend([0], [8], t([-1])) is None
    assert snapshot(a) == before


def test_alloc_extend_partial_page_without_swa_raises_without_mutation() -> None:
    a = SWAAllocator(32, 32, 4)
    full = a.alloc_extend([0], [6], t([-1]))
    a.free_swa(full[4:])  # window evicted the page holding the last token
    before = snapshot(a)
    with pytest.raises(ValueError, match="no SWA"):
        a.alloc_extend([6], [8], full[-1:])
    assert snapshot(a) == before


@pytest.mark.parametrize(
    ("seq_len", "expect_full", "expect_swa", "new_pages"),
    [(7, 10, 10, 0), (9, 12, 12, 1)],  # continue in place / start page 3 on both sides
)
def test_alloc_decode(seq_len: int, expect_full: int, expect_swa: int, new_pages: int) -> None:
    a = SWAAllocator(32, 32, 4)
    full = a.alloc_extend([0], [seq_len - 1], t([-1]))
    free_before = (a.full_attn_allocator.num_free_pages(), a.swa_attn_allocator.num_free_pages())
    out = a.alloc_decode([seq_len], full[-1:])
    assert out.tolist() == [expect_full] and mapped(a, out) == [expect_swa]
    assert free_before[0] - a.full_attn_allocator.num_free_pages() == new_pages
    assert free_before[1] - a.swa_attn_allocator.num_free_pages() == new_pages
    assert a.check_integrity()


@pytest.mark.parametrize(("full_size", "swa_size"), [(8, 32), (32, 8)])
def test_alloc_decode_short_side_returns_none_without_mutation(
    full_size: int, swa_size: int
) -> None:
    a = SWAAllocator(full_size, swa_size, 4)
    full = a.alloc_extend([0], [8], t([-1]))  # fills the smaller side
    before = snapshot(a)
    assert a.alloc_decode([len(full) + 1], full[-1:]) is None  # needs a page on both sides
    assert snapshot(a) == before


@pytest.mark.parametrize("lens", ["host list", "tensor"])  # the Python check, the torch one
def test_alloc_decode_after_window_eviction_raises_without_mutation(lens: str) -> None:
    a = SWAAllocator(32, 32, 4)
    full = a.alloc_extend([0], [6], t([-1]))
    a.free_swa(full)
    before = snapshot(a)
    with pytest.raises(ValueError, match="no SWA slot"):
        a.alloc_decode([7] if lens == "host list" else t([7]), full[-1:])
    assert snapshot(a) == before
    # A token that starts a page needs no previous SWA slot.
    full = a.alloc_extend([0], [8], t([-1]))
    a.free_swa(full)
    out = a.alloc_decode([9] if lens == "host list" else t([9]), full[-1:])
    assert out is not None and mapped(a, out)[0] > 0


# ---------------------------------------------------------------- alloc_extend_swa_tail
def test_tail_zeroes_stale_mappings_of_recycled_full_pages() -> None:
    """#25805: a full page recycled without its mapping cleared must not keep it."""
    a = SWAAllocator(8, 16, 4)  # two full pages
    old = a.alloc_extend([0], [8], t([-1]))
    # a buggy owner returns both sides behind the mapping's back: stale entries remain
    a.swa_attn_allocator.free(a.full_to_swa_index_mapping[old])
    a.full_attn_allocator.free(old)
    assert all(s > 0 for s in mapped(a, old))
    full = a.alloc_extend_swa_tail(0, 8, -1, 4)
    assert sorted(full.tolist()) == sorted(old.tolist())  # the same pages, recycled
    swa = mapped(a, full)
    assert swa[:4] == [0, 0, 0, 0]  # head explicitly zeroed
    assert all(s > 0 for s in swa[4:]) and swa[4] % 4 == 0  # tail on a fresh SWA page
    assert a.check_integrity()


@pytest.mark.parametrize(
    ("prefix_len", "seq_len", "tail", "swa_expected"),
    [
        (0, 10, 6, [0, 0, 0, 0, 4, 5, 6, 7, 8, 9]),  # tail starts at position 4
        (0, 10, 10, [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]),  # the whole sequence fits
        (0, 10, 2, [0] * 8 + [4, 5]),
        (0, 7, 0, [0] * 7),  # full only: SWA untouched
        (4, 10, 2, [0, 0, 0, 0, 8, 9]),  # extends a prefix that holds SWA page 1
    ],
)
def test_tail_mapping(prefix_len: int, seq_len: int, tail: int, swa_expected: list[int]) -> None:
    a = SWAAllocator(32, 32, 4)
    last = int(a.alloc_extend([0], [prefix_len], t([-1]))[-1]) if prefix_len else -1
    swa_used = a.swa_attn_allocator.num_used_pages()
    full = a.alloc_extend_swa_tail(prefix_len, seq_len, last, tail)
    assert full.numel() == seq_len - prefix_len
    swa = mapped(a, full)
    assert swa == swa_expected
    assert a.swa_attn_allocator.num_used_pages() - swa_used == cdiv(tail, 4)
    assert a.check_integrity()


@pytest.mark.parametrize(("seq_len", "tail"), [(10, 5), (10, 11), (10, -1)])
def test_tail_bad_arguments(seq_len: int, tail: int) -> None:
    a = SWAAllocator(32, 32, 4)
    before = snapshot(a)
    with pytest.raises(ValueError):
        a.alloc_extend_swa_tail(0, seq_len, -1, tail)
    assert snapshot(a) == before


@pytest.mark.parametrize(
    ("full_size", "swa_size", "seq_len", "tail"),
    [(8, 32, 12, 4), (32, 4, 12, 8)],  # full short (3 pages > 2) / SWA short (2 pages > 1)
)
def test_tail_checks_both_capacities_first(
    full_size: int, swa_size: int, seq_len: int, tail: int
) -> None:
    a = SWAAllocator(full_size, swa_size, 4)
    before = snapshot(a)
    assert a.alloc_extend_swa_tail(0, seq_len, -1, tail) is None
    assert snapshot(a) == before


def test_tail_request_frees_cleanly() -> None:
    a = SWAAllocator(64, 16, 4)
    full = a.alloc_extend_swa_tail(0, 25, -1, 9)
    a.alloc_decode([26], full[-1:])
    a.free(full)  # page-granular: frees the decode slot's page too (same last page)
    assert a.full_available_size() == 64 and a.swa_available_size() == 16
    assert not bool(a.full_to_swa_index_mapping[:-1].any())
    assert a.check_integrity()


# ---------------------------------------------------------------- worked examples
@pytest.mark.parametrize(
    ("window", "page", "seq_len", "tail", "swa_pages", "full_pages"),
    [
        (128, 64, 1000, 168, 3, 16),
        (128, 256, 1000, 232, 1, 4),
        (128, 64, 100, 100, 2, 2),
        (4096, 64, 8192, 4096, 64, 128),
    ],
)
def test_tail_worked_examples(
    window: int, page: int, seq_len: int, tail: int, swa_pages: int, full_pages: int
) -> None:
    assert swa_tail_len(seq_len, window, page) == tail
    assert (cdiv(tail, page), cdiv(seq_len, page)) == (swa_pages, full_pages)
    # and a real allocation consumes exactly those pages on each side
    a = SWAAllocator(full_pages * page, swa_pages * page, page)
    full = a.alloc_extend_swa_tail(0, seq_len, -1, tail)
    assert full is not None and full.numel() == seq_len
    assert (
        a.full_attn_allocator.num_free_pages() == 0 and a.swa_attn_allocator.num_free_pages() == 0
    )
    assert int((a.full_to_swa_index_mapping[full] > 0).sum()) == tail
    assert a.check_integrity()


@pytest.mark.parametrize(
    ("window", "page", "seq_len", "tail"),
    [(8, 4, 25, 9), (8, 4, 24, 8), (8, 4, 6, 6), (8, 4, 0, 0), (None, 4, 25, 25), (0, 4, 25, 25)],
)
def test_swa_tail_len_small(window: int | None, page: int, seq_len: int, tail: int) -> None:
    assert swa_tail_len(seq_len, window, page) == tail
    if window:
        assert seq_len <= window or window <= tail < window + page


# ---------------------------------------------------------------- free / free_swa
def test_free_swa_is_page_expanded_and_repeatable() -> None:
    a = SWAAllocator(32, 32, 4)
    full = a.alloc_extend([0], [10], t([-1]))
    a.free_swa(full[1:2])  # one slot: the whole first page loses SWA
    assert mapped(a, full) == [0, 0, 0, 0, 8, 9, 10, 11, 12, 13]
    assert a.swa_attn_allocator.num_used_pages() == 2
    a.free_swa(full[:4])  # freeing the same page again: no double free
    a.free_swa(full[0:1])
    assert a.swa_attn_allocator.num_used_pages() == 2
    assert a.check_integrity()
    a.free(full)  # full side of everything, SWA of the rest
    assert a.full_available_size() == 32 and a.swa_available_size() == 32
    assert a.check_integrity()


def test_free_twice_raises_on_the_full_side() -> None:
    a = SWAAllocator(32, 32, 4)
    full = a.alloc_extend([0], [6], t([-1]))
    a.free(full)
    with pytest.raises(DoubleFreeError):
        a.free(full)
    assert a.check_integrity()


def test_free_group() -> None:
    a = SWAAllocator(32, 32, 4)
    full = a.alloc_extend([0], [8], t([-1]))
    a.free_group_begin()
    a.free(full[:4])
    a.free(full)  # page 1 again: merged, no double free
    assert a.full_available_size() == 24  # queued
    a.free_group_end()
    assert a.full_available_size() == 32 and a.swa_available_size() == 32
    assert a.check_integrity()


def test_clear_keeps_sentinel() -> None:
    a = SWAAllocator(16, 16, 4)
    a.alloc_extend([0], [9], t([-1]))
    a.clear()
    m = a.full_to_swa_index_mapping
    assert int(m[-1]) == -1 and not bool(m[:-1].any())
    assert a.available_size() == 16 and a.check_integrity()


def test_set_full_to_swa_mapping() -> None:
    a = SWAAllocator(16, 16, 4)
    full = a.alloc_extend([0], [4], t([-1]))
    swa = a.full_to_swa_index_mapping[full].clone()
    a.free_swa(full)
    new_swa = a.swa_attn_allocator.alloc(4)
    a.set_full_to_swa_mapping(full, new_swa)  # e.g. tombstone recovery
    assert mapped(a, full) == new_swa.tolist() != swa.tolist()
    assert a.check_integrity()


def test_translate_last_locs_sentinel() -> None:
    a = SWAAllocator(16, 16, 4)
    full = a.alloc_extend([0], [2], t([-1]))
    assert a.translate_last_locs(t([-1, int(full[1])])).tolist() == [-1, mapped(a, full[1:])[0]]


# ---------------------------------------------------------------- integrity
def _non_injective(a: SWAAllocator, full: torch.Tensor) -> None:
    a.full_to_swa_index_mapping[full[1]] = a.full_to_swa_index_mapping[full[0]]


def _leaked_swa_page(a: SWAAllocator, full: torch.Tensor) -> None:
    a.swa_attn_allocator.alloc(4)


def _mapped_free_full_slot(a: SWAAllocator, full: torch.Tensor) -> None:
    a.full_attn_allocator.free(full)


def _mapped_free_swa_slot(a: SWAAllocator, full: torch.Tensor) -> None:
    a.swa_attn_allocator.free(a.full_to_swa_index_mapping[full])


def _sentinel(a: SWAAllocator, full: torch.Tensor) -> None:
    a.full_to_swa_index_mapping[-1] = 0


def _reserved_mapped(a: SWAAllocator, full: torch.Tensor) -> None:
    a.full_to_swa_index_mapping[2] = 12


def _past_the_end(a: SWAAllocator, full: torch.Tensor) -> None:
    a.full_to_swa_index_mapping[full[0]] = 999


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_non_injective, "not injective"),
        (_leaked_swa_page, "leak"),
        (_mapped_free_full_slot, "free full slot is still mapped"),
        (_mapped_free_swa_slot, "mapped SWA slot is free"),
        (_sentinel, "sentinel"),
        (_reserved_mapped, "reserved full page 0"),
        (_past_the_end, "past the end"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message: str) -> None:  # type: ignore[no-untyped-def]
    a = SWAAllocator(32, 32, 4)
    full = a.alloc_extend([0], [6], t([-1]))
    assert a.check_integrity()
    corrupt(a, full)
    with pytest.raises(IntegrityError, match=message):
        a.check_integrity()


# ---------------------------------------------------------------- property test
OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "tail", "extend", "decode", "evict", "free"]), st.integers(0, 11)
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), ops=OPS)
def test_random_ops_keep_invariants(page_size: int, ops: list[tuple[str, int]]) -> None:
    """Random requests (plain or tail-only), growth, window eviction and frees: both pools
    balance, the mapping stays injective on live slots, nothing leaks at the end."""
    p, window = page_size, 2 * page_size
    a = SWAAllocator(16 * p, 8 * p, p)
    reqs: list[dict[str, object]] = []  # {"slots": list[int], "evicted": int}

    def pick(n: int) -> dict[str, object] | None:
        return reqs[n % len(reqs)] if reqs else None

    for op, n in ops:
        r = pick(n)
        if op == "new" and n:
            out = a.alloc_extend([0], [n], t([-1]))
            if out is not None:
                reqs.append({"slots": out.tolist(), "evicted": 0})
        elif op == "tail" and n and p > 1:
            tail = swa_tail_len(n, window, p)
            out = a.alloc_extend_swa_tail(0, n, -1, tail)
            if out is not None:
                reqs.append({"slots": out.tolist(), "evicted": n - tail})
        elif r is not None:
            slots: list[int] = r["slots"]  # type: ignore[assignment]
            evicted: int = r["evicted"]  # type: ignore[assignment]
            seq = len(slots)
            last_has_swa = mapped(a, t(slots[-1:]))[0] > 0
            if op == "extend" and n and (seq % p == 0 or last_has_swa):
                out = a.alloc_extend([seq], [seq + n], t(slots[-1:]))
                if out is not None:
                    slots.extend(out.tolist())
            elif op == "decode" and (seq % p == 0 or last_has_swa):
                out = a.alloc_decode([seq + 1], t(slots[-1:]))
                if out is not None:
                    slots.extend(out.tolist())
            elif op == "evict":
                # window eviction frontier: whole pages strictly behind the last page
                frontier = (max(evicted, seq - window - p) // p) * p
                if frontier > evicted:
                    a.free_swa(t(slots[evicted:frontier]))
                    r["evicted"] = frontier
            elif op == "free":
                a.free(t(slots))
                reqs.remove(r)
        for alloc in (a.full_attn_allocator, a.swa_attn_allocator):
            assert alloc.num_free_pages() + alloc.num_used_pages() == alloc.num_pages
        assert a.check_integrity()
    for r in reqs:
        a.free(t(r["slots"]))  # type: ignore[arg-type]
    assert a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
    assert not bool(a.full_to_swa_index_mapping[:-1].any())
    assert a.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(st.sampled_from(["extend", "decode", "free_swa", "free"]), st.integers(0, 9),
                  st.lists(st.integers(-1, 40), min_size=0, max_size=6)),
        min_size=1, max_size=10,
    ),
)  # fmt: skip
def test_host_paths_equal_the_torch_path(page_size: int, ops: list[tuple[str, int, list[int]]]) -> None:
    """Allocation and frees on a host pool (numpy: the mapping's reads and writes, page
    flags, ``free_swa`` / ``free``) and on the stand-in device "cpu:0" (the torch ops) from
    the same state: the same slots, SWA pages freed, mapping and errors, repeat frees
    skipped."""
    host = SWAAllocator(40, 24, page_size)
    torch_path = SWAAllocator(40, 24, page_size, device="cpu:0")
    held: list[int] = []  # the last extend's slots: a decode continues them
    for op, n, values in ops:
        if op in ("extend", "decode"):
            outcome = []
            for alloc in (host, torch_path):
                last = t([held[-1] if held else -1]).to(alloc.device)
                try:
                    out = (alloc.alloc_extend([0], [n], last) if op == "extend"
                           else alloc.alloc_decode([len(held) + 1], last))  # fmt: skip
                    outcome.append(None if out is None else out.tolist())
                except ValueError as err:
                    outcome.append(str(err))
            assert outcome[0] == outcome[1]
            if isinstance(outcome[0], list):
                held = outcome[0] if op == "extend" else held + outcome[0]
        else:
            outcome = []
            for alloc in (host, torch_path):
                try:
                    getattr(alloc, op)(t(values).to(alloc.device))
                    outcome.append(None)
                except (ValueError, IndexError, DoubleFreeError) as err:
                    outcome.append(type(err))
            assert outcome[0] == outcome[1]
        assert snapshot(host) == snapshot(torch_path)
        assert host.mapping.version == torch_path.mapping.version


@contextlib.contextmanager
def _patched(name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``kvcanary.memory.pages_nb.<name>`` replaced for the block (restored after it)."""
    real = getattr(pages_nb, name)
    setattr(pages_nb, name, replacement)
    try:
        yield
    finally:
        setattr(pages_nb, name, real)


def _recording(name: str, statuses: list[int]) -> Callable[..., Any]:
    """``pages_nb.<name>`` itself, appending each call's status to ``statuses``."""
    real = getattr(pages_nb, name)

    def spy(*args: Any) -> Any:
        out = real(*args)
        statuses.append(int(out[0]))
        return out

    return spy


def _numpy_path(a: SWAAllocator) -> SWAAllocator:
    """``a`` with its compiled free_swa turned off (the SWA pool reports no host flags)."""
    a.swa_attn_allocator.host_page_flags = lambda: None  # type: ignore[method-assign]
    return a


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.sampled_from([2, 4]),
    requests=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    quarantine=st.lists(st.integers(0, 23), max_size=4),
    frees=st.lists(st.lists(st.integers(-2, 44), max_size=8), min_size=1, max_size=6),
)
def test_compiled_free_swa_equals_the_numpy_path(
    page_size: int, requests: list[int], quarantine: list[int], frees: list[list[int]]
) -> None:
    """free_swa on a host pool through :mod:`kvcanary.memory.pages_nb` and through numpy
    from the same state (requests allocated, some SWA pages quarantined while held): the
    same free lists (quarantined pages left out), page flags, mapping, mapping version,
    and the same error, message included (double frees, negative and out-of-range slots,
    repeats)."""
    pools = [SWAAllocator(40, 24, page_size), _numpy_path(SWAAllocator(40, 24, page_size))]
    for a in pools:
        for n in requests:
            a.alloc_extend([0], [n], t([-1]))
        a.quarantine_swa(t(quarantine))
    statuses: list[int] = []
    for values in frees:
        outcome = []
        for a in pools:
            try:
                with _patched("free_swa_pages", _recording("free_swa_pages", statuses)):
                    a.free_swa(t(values))
                outcome.append(None)
            except (ValueError, IndexError, DoubleFreeError) as err:
                outcome.append((type(err), str(err)))
        assert outcome[0] == outcome[1]
        assert snapshot(pools[0]) == snapshot(pools[1])
        assert pools[0].mapping.version == pools[1].mapping.version
        assert pools[0].check_integrity() and pools[1].check_integrity()
    assert len(statuses) == sum(1 for v in frees if v)  # every free of the first pool asks it


def test_compiled_free_swa_frees_a_window_page_in_one_call() -> None:
    """An eviction as a decode step makes it: the page's SWA slots unmapped, the SWA page
    back on the free list (a quarantined one not), the version bumped once, the full
    side untouched; freeing it again changes nothing."""
    a = SWAAllocator(64, 32, 4)
    full = a.alloc_extend([0], [12], t([-1]))
    assert full is not None
    swa = mapped(a, full)
    a.quarantine_swa(t([swa[4]]))  # the second page's SWA page: held, quarantined
    free_before, version = a.swa_attn_allocator.free_pages.tolist(), a.mapping.version
    statuses: list[int] = []
    with _patched("free_swa_pages", _recording("free_swa_pages", statuses)):
        a.free_swa(full[:8])
        a.free_swa(full[:8])  # a repeat: nothing mapped, nothing freed
    assert statuses == [pages_nb.FUSED, pages_nb.FUSED]
    assert mapped(a, full) == [0] * 8 + swa[8:]
    assert a.swa_attn_allocator.free_pages.tolist() == free_before + [swa[0] // 4]
    assert a.mapping.version == version + 1
    assert not a.swa_attn_allocator.page_allocated[swa[4] // 4]
    assert a.full_attn_allocator.page_allocated[full[0].item() // 4]
    assert a.check_integrity()


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    requests=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    spans=st.lists(st.tuples(st.integers(-1, 4), st.integers(-1, 10), st.integers(-1, 12)),
                   max_size=5),
    repeat=st.booleans(),
)  # fmt: skip
def test_free_swa_rows_equals_gathering_then_free_swa(
    page_size: int, requests: list[int], spans: list[tuple[int, int, int]], repeat: bool
) -> None:
    """free_swa_rows (the window eviction's call: compiled where it applies) against what it
    stands for, the rows' slots gathered, the mapped ones counted, then free_swa through
    numpy: the same count, free lists, flags, mapping, version and error (spans outside the
    table, empty spans, repeats)."""
    import numpy as np

    table = np.zeros((5, 16), dtype=np.int32)
    pools = [SWAAllocator(64, 64, page_size), _numpy_path(SWAAllocator(64, 64, page_size))]
    for a in pools:
        for row, n in enumerate(requests, start=1):
            out = a.alloc_extend([0], [n], t([-1]))
            assert out is not None
            table[row, :n] = out.numpy()
    spans_np = np.array(spans, dtype=np.int64).reshape(-1, 3)

    def reference(a: SWAAllocator) -> int:
        flat = np.concatenate([table[r, x:y] for r, x, y in spans] or [np.zeros(0, np.int32)])
        flat = flat.astype(np.int64)
        count = int((a.mapping.translate_host(flat) > 0).sum())
        a.free_swa(t(flat.tolist()))
        return count

    for _ in range(2 if repeat else 1):
        outcome = []
        for a, call in ((pools[0], lambda a: a.free_swa_rows(table, spans_np)), (pools[1], reference)):
            try:
                outcome.append(call(a))
            except (ValueError, IndexError, DoubleFreeError) as err:
                outcome.append((type(err), str(err)))
        assert outcome[0] == outcome[1]
        assert snapshot(pools[0]) == snapshot(pools[1])
        assert pools[0].mapping.version == pools[1].mapping.version


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    requests=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    evict=st.lists(st.integers(0, 3), max_size=2),
    steps=st.integers(1, 12),
    odd=st.sampled_from(["none", "short", "orphan", "outside"]),
)
def test_compiled_alloc_decode_equals_the_python_path(
    page_size: int, requests: list[int], evict: list[int], steps: int, odd: str
) -> None:
    """alloc_decode of host lengths through :mod:`kvcanary.memory.pages_nb` and through the
    Python path (the kernel made to decline) from the same state, step after step until a
    pool runs out: the same slots (None when short), free lists, flags, mapping, version
    and error, message included; the last step may be odd: fewer last slots than lengths,
    a last slot outside the pool, or every request's last page out of the window (a
    continuing request without an SWA slot)."""
    pools = [SWAAllocator(48, 32, page_size), SWAAllocator(48, 32, page_size)]
    held: list[list[list[int]]] = [[], []]
    for a, h in zip(pools, held, strict=True):
        for n in requests:
            out = a.alloc_extend([0], [n], t([-1])) if n else t([])
            h.append([] if out is None else out.tolist())
        for r in evict:  # the window left a request's first page
            if r < len(h) and h[r]:
                a.free_swa(t(h[r][:1]))
    statuses: list[int] = []

    def declined(*args: Any) -> Any:  # the kernel's answer when it will not: nothing written
        return pages_nb.FALL_BACK, args[1][:0], 0

    for step in range(steps):
        outcome = []
        last_step = step == steps - 1
        for which, (a, h) in enumerate(zip(pools, held, strict=True)):
            seq = [len(s) + 1 for s in h]
            last = [s[-1] if s else -1 for s in h]
            if last_step and odd == "short":
                last = last[:-1]
            elif last_step and odd == "outside":
                last[0] = 10_000
            elif last_step and odd == "orphan":
                a.free_swa(t([x for x in last if x >= 0]))
            kernel = declined if which else _recording("alloc_decode", statuses)
            try:
                with _patched("alloc_decode", kernel):
                    out = a.alloc_decode(seq, t(last))
                outcome.append(None if out is None else out.tolist())
            except (ValueError, IndexError) as err:
                outcome.append((type(err), str(err)))
        assert outcome[0] == outcome[1]
        assert snapshot(pools[0]) == snapshot(pools[1])
        assert pools[0].mapping.version == pools[1].mapping.version
        if isinstance(outcome[0], list):
            assert statuses[-1] == pages_nb.FUSED  # an ordinary step: the compiled call did it
            for h in held:
                for s, slot in zip(h, outcome[0], strict=True):
                    s.append(slot)
        else:
            break
