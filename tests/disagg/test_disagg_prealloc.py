"""Decode pre-allocation: length helpers, budgets and admission, table-driven over real
pools (no model). Worked examples from reference/swa_pools.md §6."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from disagg_testlib import make_req, memory_scheduler, memory_state, prealloc_queue

from kvcanary.utils import cdiv, floor_page

# W, P, L -> tail, SWA pages, full pages
TAIL_TABLE = [
    (128, 64, 1000, 168, 3, 16),
    (128, 256, 1000, 232, 1, 4),  # charged 256, not 232
    (128, 64, 100, 100, 2, 2),  # fits the window: the tail is the whole sequence
    (4096, 64, 8192, 4096, 64, 128),
    (32, 4, 1023, 35, 9, 256),  # tiny-swa geometry: W <= tail < W + P
]


def _sized(window: int, page: int, seq_len: int, **kw: object):
    tokens = 2 * cdiv(seq_len, page) * page + 2 * page
    return memory_scheduler(window=window, page_size=page, full_tokens=tokens, swa_tokens=tokens,
                            max_context_len=max(4096, seq_len + 8), **kw)  # fmt: skip


@pytest.mark.parametrize(("window", "page", "seq_len", "tail", "swa_pages", "full_pages"), TAIL_TABLE)
def test_tail_lengths_and_charges(window, page, seq_len, tail, swa_pages, full_pages) -> None:
    q = prealloc_queue(_sized(window, page, seq_len), num_reserved_decode_tokens=16)
    assert q.tail_mode
    assert q._swa_tail_len(seq_len) == tail
    req = make_req(seq_len)
    assert q._prealloc_kv_lens(req) == (seq_len, tail)
    plan = q._prealloc_plan(seq_len)
    assert plan.takes_tail_path and plan.swa_tail_len == tail
    assert (plan.num_full_pages, plan.num_swa_pages) == (full_pages, swa_pages)
    # Whole pages are charged (232 -> 256), plus the decode reserve.
    assert q._prealloc_required_tokens(req) == (full_pages * page + 16, swa_pages * page + 16)


def test_fill_len_excludes_the_last_sampled_token() -> None:
    q = prealloc_queue(_sized(128, 64, 1000))
    assert q._prealloc_kv_lens(make_req(900, outputs=101)) == (1000, 168)  # 900 + 101 - 1
    assert q._prealloc_kv_lens(make_req(1000, outputs=1)) == (1000, 168)
    assert q._swa_retractable_len(make_req(1000, outputs=7)) == 168 + 7


@pytest.mark.parametrize(
    ("case", "kwargs", "disagg"),
    [
        ("page size 1", dict(window=128, page_size=1, full_tokens=4096, swa_tokens=2048), {}),
        ("MHA pool", dict(window=None, page_size=64), {}),
        ("tail pre-allocation off", dict(window=128, page_size=64), {"swa_tail_prealloc": False}),
    ],
)
def test_fallback_to_equal_budgets(case, kwargs, disagg) -> None:
    q = prealloc_queue(memory_scheduler(**kwargs), num_reserved_decode_tokens=0, **disagg)
    assert not q.tail_mode, case
    assert q._swa_tail_len(1000) == 1000
    req = make_req(1000)
    full, swa = q._prealloc_required_tokens(req)
    assert full == swa == cdiv(1000, kwargs["page_size"]) * kwargs["page_size"]
    budgets = q._allocatable_token_budgets()
    assert budgets.full == budgets.swa == q.allocator.available_size()  # min(full, swa) free


@pytest.mark.parametrize(
    ("swa_used_pages", "expect_full", "expect_swa"),
    [
        # reserve R*n = 16; need = max_new + prompt - retractable = 100 + 1000 - 1010 = 90
        # SWA: growth = n*W - used = 128 - 0 -> reserve min(16, 128) = 16;
        #      need = tail(1000) + 100 - (168 + 10) = 90
        (0, 4096 - 90, 1024 - 90),
        # SWA pool 12 of 16 pages used: growth 0 -> reserve 0, need 90 still dominates
        (12, 4096 - 90, 256 - 90),
    ],
)
def test_budget_formulas(swa_used_pages, expect_full, expect_swa) -> None:
    sched = memory_scheduler(window=128, page_size=64, full_tokens=4096, swa_tokens=1024)
    q = prealloc_queue(sched, num_reserved_decode_tokens=16)
    if swa_used_pages:
        assert sched.kv.allocator.swa_attn_allocator.alloc(swa_used_pages * 64) is not None
    sched.running.append(make_req(1000, max_new_tokens=100, outputs=10))
    assert q._allocatable_token_budgets() == (expect_full, expect_swa)
    # A second running request with a huge max_new_tokens: its need is clipped.
    sched.running.append(make_req(10, max_new_tokens=10_000))
    retractable = 1010 + 10
    assert q._allocatable_token_budgets().full == 4096 - (4096 + 10 - retractable)
    q.config = dataclasses.replace(q.config, clip_max_new_tokens=300)
    assert q._allocatable_token_budgets().full == 4096 - (100 + 1000 - retractable)


@pytest.mark.parametrize(
    ("full_pages", "swa_pages", "bound", "expect_admitted"),
    [
        (200, 8, "swa budget", 2),  # SWA 512 tokens / 192 per request (3 pages)
        (40, 64, "full budget", 2),  # full 2560 tokens / 1024 per request (16 pages)
    ],
)
def test_admission_rejects_on_either_budget(full_pages, swa_pages, bound, expect_admitted) -> None:
    sched = memory_scheduler(window=128, page_size=64, full_tokens=full_pages * 64,
                             swa_tokens=swa_pages * 64)  # fmt: skip
    q = prealloc_queue(sched, num_reserved_decode_tokens=0)
    before = memory_state(sched)
    q.queue.extend(make_req(1000) for _ in range(4))
    admitted = q.pop_preallocated()
    assert len(admitted) == expect_admitted and len(q.queue) == 2
    assert q.last_rejection == bound
    full_req, swa_req = q._prealloc_required_tokens(q.queue[0])
    budgets = q._allocatable_token_budgets()
    other_fits = budgets.full >= full_req if bound == "swa budget" else budgets.swa >= swa_req
    assert other_fits, "the other budget still had room: the rejection came from one budget"
    for req in admitted:
        assert req.swa_evicted_seqlen == 1000 - 168  # = the page-aligned window start
        assert req in q.transferring.values()
    sched.check_integrity()
    for req in admitted:
        q.release(req)
    assert memory_state(sched) == before
    sched.check_integrity()


def test_without_tail_the_swa_pool_takes_the_whole_sequence() -> None:
    sched = memory_scheduler(window=128, page_size=64, full_tokens=200 * 64, swa_tokens=8 * 64)
    q = prealloc_queue(sched, num_reserved_decode_tokens=0, swa_tail_prealloc=False)
    error = q.capacity_error(make_req(1000))
    assert error is not None and "512" in error
    assert q.capacity_error(make_req(400)) is None


@pytest.mark.parametrize(("window", "page", "seq_len"), [(128, 64, 1000), (128, 16, 2000), (32, 4, 1024)])
def test_admitted_concurrency_ratio(window, page, seq_len) -> None:
    """Same SWA pool, full pool not the bound: tail admits >= 0.8 L/(W+P) times as many."""
    swa_tokens = 4 * cdiv(seq_len, page) * page
    admitted = {}
    for tail in (True, False):
        n = swa_tokens // window + 2
        sched = memory_scheduler(window=window, page_size=page, swa_tokens=swa_tokens, rows=n,
                                 full_tokens=n * cdiv(seq_len, page) * page)  # fmt: skip
        q = prealloc_queue(sched, num_reserved_decode_tokens=0, swa_tail_prealloc=tail)
        q.queue.extend(make_req(seq_len) for _ in range(n))
        admitted[tail] = len(q.pop_preallocated())
        assert q.last_rejection == ("swa budget" if tail else "budget")
    assert admitted[True] / admitted[False] >= 0.8 * seq_len / (window + page)


@pytest.mark.parametrize(("window", "page", "fill_len"), [(128, 64, 1000), (128, 256, 1000), (32, 4, 203)])
def test_prefix_hit_never_charged_more_than_a_miss(window, page, fill_len) -> None:
    q = prealloc_queue(_sized(window, page, fill_len))
    req = make_req(fill_len)
    miss = q._prealloc_required_tokens(req)
    window_start = floor_page(max(0, fill_len - window), page)
    for prefix_len in range(0, fill_len, page):
        hit = q._prealloc_required_tokens(req, prefix_len)
        assert hit[0] <= miss[0] and hit[1] <= miss[1], (prefix_len, hit, miss)
        assert q._prealloc_plan(fill_len, prefix_len).takes_tail_path == (window_start >= prefix_len)


@pytest.mark.parametrize(
    ("window", "page", "fill_len", "prefix_len"),
    [(128, 64, 1000, 0), (128, 64, 1000, 256), (128, 64, 1000, 896), (128, 256, 1000, 512),
     (32, 4, 203, 168), (32, 4, 203, 172)],
)  # fmt: skip
def test_charge_equals_allocation(window, page, fill_len, prefix_len) -> None:
    """The pages admission charges are the pages ``KVManager.preallocate`` takes (one predicate), and
    the tail path leaves the non-tail positions unmapped."""
    sched = _sized(window, page, fill_len)
    alloc, r2t = sched.kv.allocator, sched.kv.req_to_token_pool.req_to_token
    q = prealloc_queue(sched)
    prefix = None
    if prefix_len:  # a resident prefix, as a decode-side cache hit would hand over
        prefix = alloc.alloc_extend([0], [prefix_len], torch.tensor([-1]))
    full0, swa0 = alloc.full_attn_allocator.num_free_pages(), alloc.swa_attn_allocator.num_free_pages()
    req = make_req(fill_len)
    plan = q._prealloc_plan(fill_len, prefix_len)
    assert sched.kv.preallocate(req, prefix, plan.prefix_len, plan.fill_len, plan.swa_tail_len)
    assert full0 - alloc.full_attn_allocator.num_free_pages() == plan.num_full_pages
    assert swa0 - alloc.swa_attn_allocator.num_free_pages() == plan.num_swa_pages
    mapped = alloc.full_to_swa_index_mapping[r2t[req.req_pool_idx, :fill_len].long()] > 0
    if plan.takes_tail_path:
        start = fill_len - plan.swa_tail_len
        assert req.swa_evicted_seqlen == start
        assert not mapped[prefix_len:start].any() and mapped[start:].all()
    else:
        assert req.swa_evicted_seqlen == prefix_len and mapped[prefix_len:].all()
    sched.check_integrity()


def _assert_only_the_cache_holds_memory(sched) -> None:
    """Every allocated slot is the prefix cache's (eviction may have freed some of it)."""
    a, c = sched.kv.allocator, sched.kv.prefix_cache
    assert a.size_full - a.full_available_size() == c.evictable_size() + c.protected_size()
    assert a.size_swa - a.swa_available_size() == c.swa_evictable_size() + c.swa_protected_size()
    assert sched.kv.req_to_token_pool.available_size() == sched.kv.req_to_token_pool.size
    sched.check_integrity()


def test_no_leak_when_a_preallocation_fails_halfway(monkeypatch) -> None:
    """The row and the prefix lock are taken, then the KV allocation fails (even after
    evicting cache entries): nothing stays held but the cache's own entries."""
    sched = memory_scheduler(window=128, page_size=64, full_tokens=64 * 64, swa_tokens=16 * 64,
                             prefix_cache=True)  # fmt: skip
    alloc, cache = sched.kv.allocator, sched.kv.prefix_cache
    cached = alloc.alloc_extend([0], [256], torch.tensor([-1]))
    cache.insert([1] * 256, cached)  # make_req prompts are all ones: a 256-token hit
    q = prealloc_queue(sched)
    q.queue.append(make_req(1000))
    monkeypatch.setattr(alloc, "alloc_extend_swa_tail", lambda *a, **k: None)
    assert q.pop_preallocated() == []
    assert q.last_rejection == "allocation failed"
    assert len(q.queue) == 1 and not q.transferring
    assert cache.protected_size() == 0 and cache.evictable_size() == 256  # lock released
    _assert_only_the_cache_holds_memory(sched)
    monkeypatch.undo()
    (req,) = q.pop_preallocated()  # the same request goes through once memory is there
    assert req.cache_protected_len == 256 and req.swa_evicted_seqlen == 1000 - 168
    q.release(req)
    assert cache.protected_size() == 0
    _assert_only_the_cache_holds_memory(sched)
