"""Property tests: a miniature scheduler drives a real allocator (+ SWA pool) and RadixCache
through random admit / decode / window-evict (+ dec_swa_lock_only) / cache-unfinished /
finish / retract / evict sequences, following the scheduler contract in radix_cache.py.

After every step: both integrity checks pass, every allocated full page is owned by exactly
one of {the tree, one request's own slots}, requests' matched prefixes are still cached,
each request's own window is mapped exactly where it claims, every position a request may
still read through SWA (``>= kv_len - W + 1``) is mapped even when it is tree-owned, and
tree SWA locks hold at most one page-rounded window per request. At the end, with every
request gone and the cache evicted, both pools are back to their initial free sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary.memory.allocator import PagedAllocator, make_allocator
from kvcanary.memory.radix_cache import RadixCache, RadixNode, SwaLock
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool
from kvcanary.utils import floor_page, swa_tail_len

WINDOW = 4
FULL_SIZE, SWA_SIZE = 48, 24


@dataclass(slots=True, eq=False)
class Req:
    ids: list[int]
    slots: torch.Tensor  # full slot of every position; [0, prefix_len) are the tree's
    prefix_len: int
    last_node: RadixNode  # locked with ``lock``
    lock: SwaLock
    swa_evicted_seqlen: int = 0


class MiniScheduler:
    def __init__(self, kind: str, page_size: int):
        self.page_size = page_size
        self.alloc: PagedAllocator | SWAAllocator
        if kind == "swa":
            pool = SWAKVPool(FULL_SIZE, SWA_SIZE, page_size, torch.float32, 1, 2, [1], [0])
            self.alloc = SWAAllocator(FULL_SIZE, SWA_SIZE, page_size, kvcache=pool)
            self.full = self.alloc.full_attn_allocator
        else:
            self.alloc = make_allocator(FULL_SIZE, page_size)
            self.full = self.alloc
        self.swa = isinstance(self.alloc, SWAAllocator)
        self.cache = RadixCache(self.alloc, page_size, sliding_window=WINDOW)
        self.reqs: list[Req] = []
        self.history: list[list[int]] = []  # admitted prompts, re-sent to get prefix hits

    # ---------------------------------------------------------------- operations
    def _retry(self, fn: Callable[[], torch.Tensor | None], num_tokens: int) -> torch.Tensor | None:
        out = fn()
        if out is None:
            self.cache.evict(num_tokens, num_tokens)
            out = fn()
        return out

    def admit(self, ids: list[int], tail: bool) -> Req | None:
        m = self.cache.match_prefix(ids[:-1])  # at least one token left to compute
        lock = self.cache.inc_lock_ref(m.last_node)
        pre, seq_len = m.num_tokens, len(ids)
        last = m.device_indices[-1:] if pre else torch.tensor([-1])
        if tail and isinstance(self.alloc, SWAAllocator):
            alloc = self.alloc
            tail_len = min(swa_tail_len(seq_len, WINDOW, self.page_size), seq_len - pre)
            new = self._retry(
                lambda: alloc.alloc_extend_swa_tail(pre, seq_len, last, tail_len), seq_len
            )
            evicted = seq_len - tail_len
        else:
            new = self._retry(lambda: self.alloc.alloc_extend([pre], [seq_len], last), seq_len)
            evicted = 0
        if new is None:
            self.cache.dec_lock_ref(m.last_node, lock)
            return None
        slots = torch.cat([m.device_indices, new])
        req = Req(list(ids), slots, pre, m.last_node, lock, evicted)
        self.history.append(list(ids))
        self.reqs.append(req)
        return req

    def decode(self, req: Req, token: int) -> None:
        seq_len = len(req.ids) + 1
        new = self._retry(
            lambda: self.alloc.alloc_decode([seq_len], req.slots[-1:]), self.page_size
        )
        if new is not None:
            req.ids.append(token)
            req.slots = torch.cat([req.slots, new])

    def window_evict(self, req: Req) -> None:
        """Free the request's own out-of-window pages (never the tree's prefix); drop the
        tree's SWA lock once no later token reads a tree-owned position."""
        if len(req.ids) - WINDOW >= req.prefix_len:
            req.lock = self.cache.dec_swa_lock_only(req.last_node, req.lock)
        if not isinstance(self.alloc, SWAAllocator):
            return
        start = max(req.swa_evicted_seqlen, req.prefix_len)
        frontier = floor_page(max(start, len(req.ids) - WINDOW - self.page_size), self.page_size)
        if frontier > start:
            self.alloc.free_swa(req.slots[start:frontier])
            req.swa_evicted_seqlen = frontier

    def finish(self, req: Req) -> None:
        self.reqs.remove(req)
        self.cache.insert(req.ids, req.slots, req.swa_evicted_seqlen)
        self.cache.dec_lock_ref(req.last_node, req.lock)
        self.alloc.free(req.slots[floor_page(len(req.ids), self.page_size) :])

    def cache_unfinished(self, req: Req) -> None:
        """Move a running request's computed pages into the tree and adopt them."""
        m = self.cache.cache_unfinished(req.ids, req.slots, req.swa_evicted_seqlen)
        if m is None:
            return
        assert m.num_tokens == floor_page(len(req.ids), self.page_size)
        assert not m.last_node.tombstone
        req.slots = torch.cat([m.device_indices, req.slots[m.num_tokens :]])
        lock = self.cache.inc_lock_ref(m.last_node)
        self.cache.dec_lock_ref(req.last_node, req.lock)
        req.last_node, req.lock, req.prefix_len = m.last_node, lock, m.num_tokens

    def retract(self, req: Req) -> None:
        self.reqs.remove(req)
        self.cache.dec_lock_ref(req.last_node, req.lock)
        self.alloc.free(req.slots[req.prefix_len :])

    # ---------------------------------------------------------------- checks
    def check(self) -> None:
        assert self.alloc.check_integrity()
        assert self.cache.check_integrity()
        p = self.page_size
        tree = self.cache.all_values()
        tree_pages = set((tree // p).tolist())
        owners = [tree_pages]
        for req in self.reqs:
            assert set(req.slots[: req.prefix_len].tolist()) <= set(tree.tolist())
            owners.append(set((req.slots[req.prefix_len :] // p).tolist()))
        allocated = set(torch.nonzero(self.full.page_allocated).reshape(-1).tolist())
        assert sum(len(o) for o in owners) == len(allocated), "a page has two owners"
        assert set().union(*owners) == allocated, "leaked or foreign pages"
        if isinstance(self.alloc, SWAAllocator):
            mapping = self.alloc.full_to_swa_index_mapping
            for req in self.reqs:
                own = mapping[req.slots[req.prefix_len :]]
                resident = max(req.swa_evicted_seqlen, req.prefix_len) - req.prefix_len
                assert bool((own[:resident] == 0).all()) and bool((own[resident:] > 0).all())
                readable = req.slots[max(0, len(req.ids) - WINDOW + 1) :]
                assert bool((mapping[readable] > 0).all()), "a request lost SWA it may read"
        assert all(req.lock.path_len == req.prefix_len for req in self.reqs)
        if self.swa:  # a lock's SWA part is at most the window rounded out to pages
            swa_locked = [req.lock.path_len - req.lock.swa_start for req in self.reqs]
            assert max(swa_locked, default=0) <= WINDOW + p - 1
            assert self.cache.swa_protected_size() <= sum(swa_locked)
        assert self.cache.protected_size() <= self.cache.total_size()

    def drain(self) -> None:
        for req in list(self.reqs):
            self.finish(req)
        total = self.cache.total_size()
        assert self.cache.evict(total, total)[0] == total
        self.check()
        assert self.cache.total_size() == 0 and self.cache.num_tombstones() == 0
        if isinstance(self.alloc, SWAAllocator):
            assert self.alloc.full_available_size() == self.alloc.size_full
            assert self.alloc.swa_available_size() == self.alloc.size_swa
        else:
            assert self.alloc.available_size() == self.alloc.size


tokens = st.lists(st.integers(0, 2), min_size=1, max_size=12)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), tokens, st.booleans()),
        # a previous prompt plus a few tokens: shared prefixes, tombstones met again
        st.tuples(
            st.just("again"),
            st.integers(0, 7),
            st.lists(st.integers(0, 2), max_size=4),
            st.booleans(),
        ),
        # admit, slide the window, finish at once: long unlocked chains for SWA eviction
        st.tuples(
            st.just("serve"),
            st.integers(0, 7),
            st.lists(st.integers(0, 2), max_size=6),
            st.booleans(),
        ),
        # a running request caches its prompt, decodes past the window (dropping its tree
        # SWA lock), then SWA pressure tombstones what it no longer reads
        st.tuples(
            st.just("life"),
            st.integers(0, 7),
            st.lists(st.integers(0, 2), max_size=4),
            st.lists(st.integers(0, 2), max_size=8),
            st.integers(1, 24),
        ),
        st.tuples(st.just("decode"), st.integers(0, 7), st.integers(0, 2)),
        # decode past the window: the request drops its SWA lock on the tree
        st.tuples(st.just("run"), st.integers(0, 7), st.lists(st.integers(0, 2), max_size=8)),
        st.tuples(st.just("window"), st.integers(0, 7)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("retract"), st.integers(0, 7)),
        st.tuples(st.just("unfinished"), st.integers(0, 7)),
        st.tuples(st.just("unfinished"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(0, 12), st.integers(0, 12)),
        # SWA only: tombstones, also on locked paths outside their windows
        st.tuples(st.just("evict"), st.just(0), st.integers(1, 24)),
        st.tuples(st.just("evict"), st.just(0), st.integers(1, 24)),
    ),
    min_size=10,
    max_size=40,
)


@pytest.mark.parametrize("kind", ["swa", "plain"])
@pytest.mark.parametrize("page_size", [1, 2, 4])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops)
def test_random_schedules_keep_ownership_and_never_leak(
    kind: str, page_size: int, program: list[tuple]
) -> None:
    sim = MiniScheduler(kind, page_size)
    for op, *args in program:
        if op == "admit":
            sim.admit(args[0], args[1])
        elif op in ("again", "serve"):
            base = sim.history[args[0] % len(sim.history)][:12] if sim.history else []
            req = sim.admit(base + args[1], args[2]) if base + args[1] else None
            if op == "serve" and req is not None:
                sim.window_evict(req)
                sim.finish(req)
        elif op == "life":
            base = sim.history[args[0] % len(sim.history)][:12] if sim.history else []
            req = sim.admit(base + args[1], False) if base + args[1] else None
            if req is not None:
                sim.cache_unfinished(req)
                for token in args[2]:
                    sim.decode(req, token)
                sim.window_evict(req)
                sim.check()
                sim.cache.evict(0, args[3])
        elif op == "evict":
            sim.cache.evict(args[0], args[1])
        elif sim.reqs:
            req = sim.reqs[args[0] % len(sim.reqs)]
            if op == "decode":
                sim.decode(req, args[1])
            elif op == "run":
                for token in args[1]:
                    sim.decode(req, token)
                sim.window_evict(req)
            elif op == "window":
                sim.window_evict(req)
            elif op == "finish":
                sim.finish(req)
            elif op == "unfinished":
                sim.cache_unfinished(req)
            else:
                sim.retract(req)
        sim.check()
    sim.drain()
