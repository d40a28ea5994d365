"""KVManager: one object owning each request's KV lifecycle over the memory system.

The scheduler decides *who* runs; this decides *where their KV lives*. Verbs come in the
pairs of nano-vllm's block manager and vLLM v1's ``KVCacheManager``::

    can_admit(need, headroom)  room for a new request (evicts unlocked cache entries)
    admit(req)                 a req->token row + its cached prefix (locked) or host copy
    extend(req, end)           slots for a prefill chunk [kv_len, end)
    extend_decode(reqs)        one slot per request for a decode step
    rollback(req, kv_len, end) drop the KV of rejected speculative positions
    cache(req)                 share freshly prefilled whole pages through the prefix cache
    evict_window(reqs)         free the SWA slots that left each request's window
    release(req, insert)       give everything back (finished: into the prefix cache)
    retract(req)               release a running request (its KV saved to the host first
                               with host offload); restore() loads it on readmission
    preallocate(req, ...)      a row + KV reserved for a transfer (disagg decode side)
    quarantine(full, swa, reqs, rows) never hand out corrupt slots again; drop the
                               requests that reference them (or hold one of ``rows``)
                               and free what nothing holds any more

``pool_need`` is the sizing rule admission applies: the smallest pools one request runs in
alone (a larger request is refused up front, never half-run).

There is no separate ``can_extend``: allocators change nothing when they fail, so an
allocation is its own exact check (``extend`` returns False / ``extend_decode`` None with
nothing held). Each allocation that fails first evicts unlocked prefix-cache entries and
retries once.

The window policy is decided once, in :class:`KVSpec` (``window`` is None for pools
without sliding layers); the prefix cache and the disagg pre-allocation read it from here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvcanary.engine.request import PrefixLock, Req
from kvcanary.engine.stats import KVStats
from kvcanary.memory import host_pool
from kvcanary.memory.base import HOST, KVPool, PageAllocator, PrefixCache, WindowedAllocator
from kvcanary.memory.radix_cache import RadixCache, RadixNode
from kvcanary.memory.req_to_token import ReqToTokenPool
from kvcanary.utils import cdiv, ceil_page, floor_page

log = logging.getLogger("kvcanary.engine")


class PoolNeed(NamedTuple):
    num_full_tokens: int
    num_swa_tokens: int  # 0: no SWA pool


def pool_need(
    prompt_len: int, max_new_tokens: int, chunked_prefill_size: int, page_size: int,
    window: int | None, *, prefix_cache: bool, prefix_len: int = 0,
) -> PoolNeed:  # fmt: skip
    """The smallest pools in which one request of ``prompt_len`` + ``max_new_tokens`` runs
    to completion alone (``prefix_cache``: the engine caches prefilled pages as it goes,
    which changes what the SWA pool must keep), starting from ``prefix_len`` tokens found
    in the prefix cache (page aligned; 0: computed from the first token).

    Full pool: every position but the last sampled token keeps its slot to the end,
    ``ceil_page(prompt_len + max_new_tokens - 1)``. SWA pool: the peak of
    :func:`_lone_swa_peak`, which replays the request's schedule with the scheduler's and
    :class:`KVManager`'s arithmetic; exact, not a bound (tests/engine/test_admission.py
    runs both sides of it)."""
    full = ceil_page(prompt_len + max_new_tokens - 1, page_size)
    if window is None:
        return PoolNeed(full, 0)
    swa = _lone_swa_peak(prompt_len, max_new_tokens, chunked_prefill_size, page_size, window,
                         prefix_cache, prefix_len)  # fmt: skip
    return PoolNeed(full, swa)


def _lone_swa_peak(
    prompt_len: int, max_new_tokens: int, chunked_prefill_size: int, page_size: int,
    window: int, prefix_cache: bool, prefix_len: int,
) -> int:  # fmt: skip
    """SWA slots held at the fullest moment of a lone request's run: right after a forward's
    slots are allocated, before the window eviction that follows it.

    Held before a forward (``W = window``, ``P = page_size``)::

        positions   0 ...... lock ....... prot ....... own ........ kv_len
                             [ tree-locked )            [ own, held  )  + the forward's pages
                                          [ own, freed )

    ``own = max(swa_evicted_seqlen, prot)``: :meth:`KVManager.evict_window` frees own SWA
    before ``floor_page(kv_len - W - P)`` after every forward. With the prefix cache,
    ``prot`` (:meth:`KVManager.cache`, after each prefill chunk) is the last whole page; the
    tree SWA-locks ``[floor_page(prot - W), prot)`` until ``kv_len - W >= prot`` and its
    SWA outside the lock is evictable, so it counts as free (allocation evicts it on
    failure). Without it ``prot = lock = 0``. A cached prefix starts the run at
    ``kv_len = prot = swa_evicted_seqlen = prefix_len``, its window locked (at most: the
    lock stops early at a tombstone).

    Prefill runs in chunks of ``chunked_prefill_size`` (the last one short) while more
    than one prompt token lacks KV; decode then adds one position a forward up to
    ``prompt_len + max_new_tokens - 1``. Decode is evaluated at page starts only (within a
    page the forward's page is the same and the held span only shrinks) and stops once the
    held span is periodic: O(prompt_len / chunk + W / P) steps.
    """
    p, w = page_size, window
    chunk = chunked_prefill_size if chunked_prefill_size > 0 else prompt_len
    end_len = prompt_len + max_new_tokens - 1  # positions that get KV
    kv = prot = evicted = prefix_len
    lock, peak = floor_page(max(0, prefix_len - w), p), 0

    def evict_window(kv: int) -> None:  # KVManager.evict_window for one request
        nonlocal lock, evicted
        if lock < prot and kv - w >= prot:
            lock = prot
        frontier = floor_page(kv - w - p, p)
        if frontier > max(evicted, prot):
            evicted = frontier

    while kv < prompt_len - 1:
        end = min(prompt_len, kv + chunk)
        peak = max(peak, prot - lock + ceil_page(end, p) - max(evicted, prot))
        kv = end
        if prefix_cache and floor_page(kv, p) > prot:
            prot = floor_page(kv, p)
            lock = floor_page(max(0, prot - w), p)
        evict_window(kv)
    while kv < end_len:  # one decode forward, at the first position of each page
        held = prot - lock + ceil_page(kv, p) - max(evicted, prot)
        peak = max(peak, held + ceil_page(kv + 1, p) - ceil_page(kv, p))
        if kv % p == 0 and lock == prot and evicted >= prot and evicted == floor_page(kv - w - p, p):
            break  # steady: every later page start holds the same
        kv = floor_page(kv, p) + p
        evict_window(kv)  # (the forwards in between evict monotonically: the last one is what counts)
    return peak


@dataclass(frozen=True)
class KVSpec:
    """The KV policy of one engine, decided once.

    ``window``: the sliding window when the pools have sliding layers (an SWA allocator),
    else None; SWA slots of positions before ``kv_len - window - page_size`` (page floored)
    are freed after every forward. ``page_size``: slots per page in both pools.
    """

    page_size: int
    window: int | None

    @property
    def windowed(self) -> bool:
        return self.window is not None


class KVManager:
    def __init__(
        self,
        allocator: PageAllocator | WindowedAllocator,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        spec: KVSpec,
        *,
        enable_prefix_cache: bool,
        enable_host_offload: bool,
        stats: KVStats,
    ):
        windowed = allocator if isinstance(allocator, WindowedAllocator) else None
        if spec.windowed != (windowed is not None):
            raise ValueError(
                f"KVSpec.window={spec.window} does not match the allocator "
                f"({type(allocator).__name__}): a window needs an SWA allocator and vice versa"
            )
        self.allocator = allocator
        self._windowed = windowed
        full = allocator if windowed is None else windowed.full_attn_allocator
        if not isinstance(full, PageAllocator):
            raise TypeError(f"kv manager: {type(full).__name__} has no page flags")
        self._full_pages: PageAllocator = full  # page flags of the full pool (abort reclaim)
        self.req_to_token_pool = req_to_token_pool
        self.req_to_token = req_to_token_pool.req_to_token
        # A table on the host (not "cpu:0", a stand-in device): its numpy view, for the
        # decode step's few reads and writes (torch's advanced indexing costs ~5 us an op).
        self._table_np = req_to_token_pool.host_table
        self.kv_pool = kv_pool
        self.spec = spec
        self.enable_host_offload = enable_host_offload
        self.stats = stats
        self.prefix_cache: PrefixCache | None = (
            RadixCache(allocator, spec.page_size, spec.window) if enable_prefix_cache else None
        )

    # ------------------------------------------------------------------ sizes
    def available(self) -> int:
        return self.allocator.available_size()

    def pool_sizes(self) -> tuple[int, int]:
        """(full, SWA) pool tokens; SWA 0 without sliding layers."""
        if self._windowed is not None:
            return self._windowed.size_full, self._windowed.size_swa
        return self.allocator.size, 0

    def swa(self) -> WindowedAllocator:
        """The SWA allocator (only windowed code paths ask)."""
        if self._windowed is None:
            raise RuntimeError("kv manager: an SWA-only path ran on a pool without SWA layers")
        return self._windowed

    def last_locs(self, reqs: Sequence[Req]) -> torch.Tensor:
        """Each request's last slot (-1 for none): where a paged allocation continues."""
        if self._table_np is not None:  # a host table: read the few entries where they are
            return self._last_locs_host(*_rows_and_lens(reqs))
        dev = self.req_to_token.device  # kv meets the gathered slots in torch.where
        rows = torch.tensor([r.req_pool_idx for r in reqs], device=dev)
        kv = torch.tensor([r.kv_len for r in reqs], device=dev)
        last = self.req_to_token[rows, (kv - 1).clamp(min=0)].to(torch.int64)
        return torch.where(kv > 0, last, torch.full_like(last, -1))

    def _last_locs_host(self, rows: np.ndarray, kv: np.ndarray) -> torch.Tensor:
        """:meth:`last_locs` of requests in rows ``rows`` holding ``kv`` tokens, read from the
        host table in one gather (a per-request loop: ~30 us at batch 64, this ~10)."""
        if self._table_np is None:
            raise RuntimeError("kv manager: a host read of a device req->token table")
        last = self._table_np[rows, np.maximum(kv - 1, 0)].astype(np.int64)
        last[kv <= 0] = -1
        return torch.from_numpy(last)

    def slots(self, req: Req, end: int | None = None) -> torch.Tensor:
        """Full slots of ``req``'s positions ``[0, end)`` (default ``kv_len``), int64."""
        n = req.kv_len if end is None else end
        return self.req_to_token[req.req_pool_idx, :n].to(torch.int64)

    # ------------------------------------------------------------------ admit
    def can_admit(self, need: int, headroom: int) -> bool:
        """Whether ``need`` more tokens fit with ``headroom`` to spare, after evicting
        unlocked prefix-cache entries if that is what it takes."""
        if self.available() - need >= headroom:
            return True
        self.evict_cache(need + headroom - self.available())
        return self.available() - need >= headroom

    def admit(self, req: Req, runs_from: Callable[[int], bool] = lambda _: True) -> bool:
        """Give ``req`` a row and its cached prefix (locked) or, after a retraction with
        host offload, its saved KV. False with nothing held when the saved KV does not fit.
        ``runs_from(prefix_len)``: whether ``req`` runs alone to the end from a cached prefix
        that long; a longer cached prefix is not used (its chunks would start elsewhere and
        can need more than the pools hold), the prompt is computed from the start."""
        row = self.req_to_token_pool.alloc(1)[0]
        req.req_pool_idx = row
        self.req_to_token_pool.set_tokens(row, req.all_ids())
        if req.host_copy is not None:
            if not self.restore(req):
                self.req_to_token_pool.free(row)
                req.req_pool_idx = 0
                return False
            return True
        if self.prefix_cache is not None:
            # Match at most seq_len - 1 tokens (the last one must be computed to sample);
            # truncating a longer match instead could cut where the window is not resident.
            match = self.prefix_cache.match_prefix(req.all_ids()[: req.seq_len - 1])
            if match.num_tokens and not runs_from(match.num_tokens):
                match = self.prefix_cache.match_prefix([])
            prefix_len = match.num_tokens
            if prefix_len:
                self.req_to_token[row, :prefix_len] = match.device_indices.to(torch.int32)
            self.lock_prefix(req, match.last_node)
            req.kv_len = req.cache_protected_len = prefix_len
            # SWA eviction of the tree-owned prefix is the tree's business.
            req.swa_evicted_seqlen = prefix_len if self.spec.windowed else 0
        return True

    def preallocate(
        self,
        req: Req,
        prefix_slots: torch.Tensor | None,
        prefix_len: int,
        fill_len: int,
        swa_tail_len: int = 0,
    ) -> bool:
        """Admit ``req`` with KV reserved for a transfer (a disaggregated decode worker): a
        row holding the locked cached prefix ``[0, prefix_len)`` (``prefix_slots``) and new
        slots for ``[prefix_len, fill_len)``; ``swa_tail_len`` > 0: the SWA pool gets only
        that page-aligned window tail (tail pre-allocation). False with nothing taken (the
        prefix lock stays the caller's) when either pool is short even after evicting."""
        if prefix_len and prefix_slots is None:
            raise ValueError(f"preallocate: prefix_len={prefix_len} without prefix_slots")
        pool = self.req_to_token_pool
        row = pool.alloc(1)[0]
        if prefix_len and prefix_slots is not None:
            pool.write(row, 0, prefix_slots)
        last_loc = int(self.req_to_token[row, prefix_len - 1]) if prefix_len else -1
        last = torch.tensor([last_loc], dtype=torch.int64)

        def alloc() -> torch.Tensor | None:
            if swa_tail_len:
                return self.swa().alloc_extend_swa_tail(prefix_len, fill_len, last_loc, swa_tail_len)
            return self.allocator.alloc_extend([prefix_len], [fill_len], last)

        page = self.spec.page_size
        out = self._alloc_or_evict(alloc, (cdiv(fill_len, page) - cdiv(prefix_len, page)) * page)
        if out is None:
            pool.free(row)
            return False
        pool.write(row, prefix_len, out)
        pool.set_tokens(row, req.all_ids())
        req.req_pool_idx = row
        req.kv_len = fill_len  # committed: the transfer fills it
        req.cache_protected_len = prefix_len
        if swa_tail_len:
            req.swa_evicted_seqlen = fill_len - swa_tail_len
        else:  # the tree-owned prefix's SWA is the tree's business
            req.swa_evicted_seqlen = prefix_len if self.spec.windowed else 0
        return True

    # ------------------------------------------------------------------ extend
    def extend(self, req: Req, end: int) -> bool:
        """Allocate and map slots for positions ``[kv_len, end)``; False, nothing held, when
        the pool cannot take them even after evicting the prefix cache."""
        start = req.kv_len
        last = self.last_locs([req])
        out = self._alloc_or_evict(
            lambda: self.allocator.alloc_extend([start], [end], last),
            end - start + self.spec.page_size,
        )
        if out is None:
            return False
        self.req_to_token[req.req_pool_idx, start:end] = out.to(torch.int32)
        return True

    def extend_many(self, reqs: Sequence[Req], ends: Sequence[int]) -> bool:
        """:meth:`extend` of every request in one allocation (positions ``[kv_len,
        ends[i])`` of ``reqs[i]``); False, nothing held, when they do not all fit."""
        starts = [r.kv_len for r in reqs]
        last = self.last_locs(reqs)
        need = sum(e - s for s, e in zip(starts, ends, strict=True))
        out = self._alloc_or_evict(
            lambda: self.allocator.alloc_extend(starts, list(ends), last),
            need + len(reqs) * self.spec.page_size,
        )
        if out is None:
            return False
        out = out.to(torch.int32)
        at = 0
        for req, start, end in zip(reqs, starts, ends, strict=True):
            self.req_to_token[req.req_pool_idx, start:end] = out[at : at + end - start]
            at += end - start
        return True

    def rollback(self, req: Req, kv_len: int, end: int) -> None:
        """Drop ``req``'s KV of positions ``[kv_len, end)`` (speculative drafts the target
        rejected; ``end``: past the last position allocated): set ``kv_len`` and free the
        pages wholly past it. The slots of the kept last page beyond ``kv_len`` stay the
        request's (pages are the allocation unit) and are rewritten before any read: the
        next allocation continues that page in place. Never below the protected prefix."""
        if not req.cache_protected_len <= kv_len <= req.kv_len <= end:
            raise ValueError(
                f"kv manager: rollback of request {req.rid} to {kv_len} (kv_len {req.kv_len}, "
                f"protected {req.cache_protected_len}, allocated to {end})"
            )
        start = ceil_page(kv_len, self.spec.page_size)
        if end > start:
            self.allocator.free(self.req_to_token[req.req_pool_idx, start:end].to(torch.int64))
        req.kv_len = kv_len

    def extend_decode(self, reqs: Sequence[Req]) -> torch.Tensor | None:
        """One slot per request at position ``kv_len`` (mapped); None, nothing held, when
        they do not all fit."""
        table, host_rows = self._table_np, None
        if table is not None:  # each request's row and length gathered once
            host_rows = _rows_and_lens(reqs)
            seq_lens = (host_rows[1] + 1).tolist()
            last_locs = self._last_locs_host(*host_rows)
        else:
            seq_lens = [r.kv_len + 1 for r in reqs]
            last_locs = self.last_locs(reqs)
        out = self._alloc_or_evict(
            lambda: self.allocator.alloc_decode(seq_lens, last_locs),
            len(reqs) * self.spec.page_size,
        )
        if out is not None and table is not None and host_rows is not None and out.device == HOST:
            table[host_rows] = out.numpy()
        elif out is not None:
            rows = torch.tensor([r.req_pool_idx for r in reqs])
            # An advanced-index write: CPU indices are fine, the values must be on the table's device.
            self.req_to_token[rows, torch.tensor([r.kv_len for r in reqs])] = out.to(
                self.req_to_token.device, torch.int32
            )
        return out

    def _alloc_or_evict(
        self, alloc: Callable[[], torch.Tensor | None], num_tokens: int
    ) -> torch.Tensor | None:
        """``alloc()``; when it fails, evict ``num_tokens`` from the prefix cache and retry
        once (allocators mutate nothing on failure, so the retry is clean)."""
        out = alloc()
        if out is None and self.prefix_cache is not None:
            self.evict_cache(num_tokens)
            out = alloc()
        return out

    def evict_cache(self, num_tokens: int) -> int:
        """Evict up to ``num_tokens`` unlocked prefix-cache tokens; full tokens freed."""
        if self.prefix_cache is None:
            return 0
        freed_full, freed_swa = self.prefix_cache.evict(num_tokens, num_tokens if self.spec.windowed else 0)
        self.stats.num_swa_slots_tombstoned += freed_swa
        return freed_full

    # ------------------------------------------------------------------ prefix cache
    def lock_prefix(self, req: Req, node: RadixNode) -> None:
        """Lock ``node`` (a prefix-cache match's last node) for ``req``."""
        if self.prefix_cache is None:
            raise RuntimeError("kv manager: lock_prefix without a prefix cache")
        req.prefix = PrefixLock(node, self.prefix_cache.inc_lock_ref(node))

    def unlock_prefix(self, req: Req) -> None:
        """Drop ``req``'s prefix lock (if it holds one)."""
        if self.prefix_cache is not None and req.prefix is not None:
            self.prefix_cache.dec_lock_ref(req.prefix.node, req.prefix.lock)
        req.prefix = None

    def cache(self, req: Req) -> None:
        """Share a request's freshly prefilled whole pages (after every prefill chunk,
        before window eviction can free their SWA) through the prefix cache while it still
        runs, so requests arriving meanwhile reuse them and find the window resident; the
        request adopts the tree's slots and locks them."""
        page = self.spec.page_size
        if self.prefix_cache is None or floor_page(req.kv_len, page) <= req.cache_protected_len:
            return
        match = self.prefix_cache.cache_unfinished(
            req.all_ids()[: req.kv_len], self.slots(req), req.swa_evicted_seqlen
        )
        if match is None:
            return
        self.req_to_token[req.req_pool_idx, : match.num_tokens] = match.device_indices.to(torch.int32)
        old = req.prefix
        self.lock_prefix(req, match.last_node)
        if old is not None:
            self.prefix_cache.dec_lock_ref(old.node, old.lock)
        req.cache_protected_len = match.num_tokens

    # ------------------------------------------------------------------ window
    def evict_window(self, reqs: Sequence[Req]) -> None:
        """Free, in one call, the SWA slots that left each request's window:
        ``frontier = floor_page(max(swa_evicted, protected, kv_len - W - P))``."""
        window = self.spec.window
        if window is None:
            return
        p = self.spec.page_size
        spans = []
        for req in reqs:
            held = req.prefix
            if (
                held is not None
                and held.lock.swa_start < held.lock.path_len
                and req.kv_len - window >= req.cache_protected_len
            ):
                # The window left the cached prefix: the tree may tombstone its SWA now.
                if self.prefix_cache is None:
                    raise RuntimeError("kv manager: a prefix lock without a prefix cache")
                req.prefix = PrefixLock(held.node, self.prefix_cache.dec_swa_lock_only(held.node, held.lock))
            start = max(req.swa_evicted_seqlen, req.cache_protected_len)
            edge = req.kv_len - window - p
            if edge <= start:  # frontier = floor_page(start) <= start: nothing left the window
                continue
            frontier = edge - edge % p  # floor_page(edge, p) inline (edge > start >= 0)
            if frontier > start:
                spans.append((req.req_pool_idx, start, frontier))
                req.swa_evicted_seqlen = frontier
        if not spans:
            return
        swa = self.swa()
        mapping = swa.mapping
        if self._table_np is not None and mapping.tensor.device == HOST:  # on the host: one call
            spans_np = np.array(spans, dtype=np.int64)
            self.stats.num_swa_slots_evicted += swa.free_swa_rows(self._table_np, spans_np)
            return
        slots = torch.cat([self.req_to_token[row, a:b] for row, a, b in spans]).to(torch.int64)
        self.stats.num_swa_slots_evicted += int((mapping.translate(slots) > 0).sum())
        swa.free_swa(slots)

    # ------------------------------------------------------------------ release
    def release(self, req: Req, insert: bool) -> None:
        """Give back everything ``req`` holds: its own slots go to the cache (``insert``,
        a finished request) or the free lists, the protected prefix is unlocked, the row
        is freed."""
        if self.prefix_cache is not None and insert:
            slots = self.slots(req)
            # The tree takes whole pages (duplicates of cached pages it frees itself);
            # the partial last page stays ours.
            self.prefix_cache.insert(req.all_ids()[: req.kv_len], slots, req.swa_evicted_seqlen)
            self.allocator.free(slots[floor_page(req.kv_len, self.spec.page_size) :])
        else:
            row = self.req_to_token[req.req_pool_idx]
            self.allocator.free(row[req.cache_protected_len : req.kv_len].to(torch.int64))
        self._drop_row(req)

    def _drop_row(self, req: Req) -> None:
        """Unlock ``req``'s protected prefix and give its row back; its slots are the
        caller's business."""
        self.unlock_prefix(req)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = 0
        req.kv_len = req.cache_protected_len = req.swa_evicted_seqlen = 0

    # ------------------------------------------------------------------ retract / restore
    def retract(self, req: Req) -> None:
        """Release a running request's KV (saved to host memory first with host offload;
        :meth:`restore` reloads it when the request is admitted again)."""
        if self.enable_host_offload and req.kv_len > 0:
            req.host_copy = host_pool.get_cpu_copy(self.kv_pool, self.slots(req))
            req.host_kv_len = req.kv_len
        self.release(req, insert=False)
        req.num_retractions += 1
        self.stats.num_retractions += 1

    def restore(self, req: Req) -> bool:
        """Reallocate ``[0, host_kv_len)`` and load the saved KV (SWA: only the window
        tail). A saved copy lacking part of the window is dropped (recomputed instead)."""
        n = req.host_kv_len
        if req.host_copy is None:
            raise RuntimeError(f"kv manager: request {req.rid} has no host copy to restore")
        window, page = self.spec.window, self.spec.page_size
        if window is not None:
            tail = n - floor_page(max(0, n - window), page)
            if not bool(req.host_copy["swa_mask"][n - tail :].all()):
                req.host_copy = None
                return True
            out = self._alloc_or_evict(lambda: self.swa().alloc_extend_swa_tail(0, n, -1, tail), n)
            req.swa_evicted_seqlen = n - tail
        else:
            no_prefix = torch.full((1,), -1, dtype=torch.int64)
            out = self._alloc_or_evict(lambda: self.allocator.alloc_extend([0], [n], no_prefix), n)
        if out is None:
            req.swa_evicted_seqlen = 0
            return False
        host_pool.load_cpu_copy(self.kv_pool, req.host_copy, out)
        self.req_to_token[req.req_pool_idx, :n] = out.to(torch.int32)
        req.kv_len = n
        req.host_copy = None
        return True

    # ------------------------------------------------------------------ quarantine
    def quarantine(
        self, full_slots: torch.Tensor, swa_slots: torch.Tensor | None, running: Sequence[Req],
        req_rows: torch.Tensor | None = None,
    ) -> list[Req]:
        """Quarantine ``full_slots`` / ``swa_slots`` (never handed out again), drop the rows
        of the ``running`` requests whose KV includes them (or maps to them) or whose
        req->token row is one of ``req_rows`` (state of their own gone bad: nothing to
        quarantine), free every page nothing references any more and invalidate the prefix
        cache's copies. Returns the dropped requests (the caller aborts them); the others
        keep everything."""
        # On the table's device: they meet its slots (isin) and the SWA mapping (isin, cat).
        dev = self.req_to_token.device
        full_slots = full_slots.reshape(-1).to(dev, torch.int64)
        swa = (
            swa_slots.reshape(-1).to(dev, torch.int64)
            if swa_slots is not None and self.spec.windowed
            else torch.zeros(0, dtype=torch.int64, device=dev)
        )
        full_slots, swa = full_slots[full_slots > 0], swa[swa > 0]
        rows = set() if req_rows is None else set(req_rows.reshape(-1).tolist()) - {0}
        hit = [req for req in running
               if req.req_pool_idx in rows or self.references(req, full_slots, swa)]  # fmt: skip
        if hit:  # pages nothing referenced even before the drop: leaked from elsewhere
            leaked_full, leaked_swa = self._unreferenced_full_pages(running), self._orphan_swa_pages()
        self.allocator.quarantine(full_slots)
        if swa.numel():
            self.swa().quarantine_swa(swa)
        # A corrupt entry can make the dropped requests share pages with each other, a
        # survivor or the prefix cache: drop their rows, then free what nothing holds.
        for req in hit:
            self._drop_row(req)
        if hit:
            survivors = [r for r in running if all(r is not h for h in hit)]
            self._free_unreferenced_pages(survivors)
            self._report_leak(leaked_full, leaked_swa)
        if self.prefix_cache is not None:
            # No later request may be served the corrupt KV from the prefix cache.
            corrupt = full_slots
            if swa.numel():
                mapping = self.swa().full_to_swa_index_mapping[:-1]
                corrupt = torch.cat([corrupt, torch.nonzero(torch.isin(mapping, swa)).reshape(-1)])
            self.prefix_cache.invalidate(corrupt)
        return hit

    def references(self, req: Req, full_slots: torch.Tensor, swa_slots: torch.Tensor) -> bool:
        """Whether ``req``'s KV includes one of ``full_slots`` or maps to one of ``swa_slots``."""
        slots = self.slots(req)
        if bool(torch.isin(slots, full_slots).any()):
            return True
        if not swa_slots.numel():
            return False
        return bool(torch.isin(self.swa().full_to_swa_index_mapping[slots], swa_slots).any())

    def _unreferenced_full_pages(self, running: Sequence[Req]) -> torch.Tensor:
        """The allocated full pages no request in ``running``, other row or prefix-cache
        node references."""
        pages = torch.nonzero(self._full_pages.page_allocated).reshape(-1)
        return pages[~torch.isin(pages, self._referenced_slots(running) // self.spec.page_size)]

    def _orphan_swa_pages(self) -> torch.Tensor | None:
        """SWA pools: the allocated SWA pages no full slot maps to (else None)."""
        swa = self._windowed
        if swa is None:
            return None
        mapping = swa.full_to_swa_index_mapping[:-1]
        pages = torch.nonzero(swa.swa_attn_allocator.page_allocated).reshape(-1)
        return pages[~torch.isin(pages, mapping[mapping > 0] // self.spec.page_size)]

    def _free_unreferenced_pages(self, running: Sequence[Req]) -> None:
        """Free, each exactly once, the allocated pages nothing references any more: the
        own pages of requests whose rows were just dropped (pages they shared included) and
        the slot a corrupt req->token entry orphaned. Never a page a live row or the prefix
        cache holds. SWA pools: then every allocated SWA page no full slot maps to."""
        p = self.spec.page_size
        self.allocator.free(self._unreferenced_full_pages(running) * p)
        orphans = self._orphan_swa_pages()  # (after the full pages: freeing them unmaps)
        if orphans is not None:
            self.swa().swa_attn_allocator.free(orphans * p)

    def _report_leak(self, full_pages: torch.Tensor, swa_pages: torch.Tensor | None) -> None:
        """Count and log the pages :meth:`quarantine` reclaimed that nothing referenced
        before it dropped a request (unreferenced with every running request still in place):
        a leak from elsewhere, not the aborted requests' own KV."""
        p = self.spec.page_size
        full, orphans = int(full_pages.numel()) * p, 0 if swa_pages is None else int(swa_pages.numel()) * p
        if not (full or orphans):
            return
        self.stats.num_leaked_full_slots += full
        self.stats.num_leaked_swa_slots += orphans
        log.warning(
            "kv manager: suspected KV leak: quarantine reclaimed %d full slots (pages no request, "
            "row or prefix-cache node referenced) and %d SWA slots (pages no full slot mapped to) "
            "before it dropped the aborted requests", full, orphans)  # fmt: skip

    def _referenced_slots(self, running: Sequence[Req]) -> torch.Tensor:
        """Every full slot still referenced: running requests' KV, the sequences of rows
        held outside ``running`` (a disaggregated decode worker's transfers), the tree."""
        pool, rows = self.req_to_token_pool, {r.req_pool_idx for r in running}
        spans = [self.req_to_token[r.req_pool_idx, : r.kv_len] for r in running]
        for row in torch.nonzero(pool.token_lens > 0).reshape(-1).tolist():
            if row not in rows:
                spans.append(self.req_to_token[row, : int(pool.token_lens[row])])
        if self.prefix_cache is not None:
            spans.append(self.prefix_cache.all_values())
        spans.append(torch.zeros(0, dtype=torch.int64, device=self.req_to_token.device))
        return torch.cat([s.to(torch.int64) for s in spans])

    # ------------------------------------------------------------------ accounting
    def track_peak(self) -> None:
        """Peak slots allocated, and peak slots requests actually need ("active": minus
        what the prefix cache could give back right now)."""
        a, swa, st = self.allocator, self._windowed, self.stats
        if swa is not None:
            full_used = swa.size_full - swa.full_available_size()
            swa_used = swa.size_swa - swa.swa_available_size()
        else:
            full_used, swa_used = a.size - a.available_size(), 0
        full_idle = self.prefix_cache.evictable_size() if self.prefix_cache is not None else 0
        swa_idle = self.prefix_cache.swa_evictable_size() if self.prefix_cache is not None and self.spec.windowed else 0
        st.peak_full_used = max(st.peak_full_used, full_used)
        st.peak_swa_used = max(st.peak_swa_used, swa_used)
        st.peak_full_active = max(st.peak_full_active, full_used - full_idle)
        st.peak_swa_active = max(st.peak_swa_active, swa_used - swa_idle)

    def check_integrity(self) -> bool:
        self.allocator.check_integrity()
        self.req_to_token_pool.check_integrity()
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        return True


def _rows_and_lens(reqs: Sequence[Req]) -> tuple[np.ndarray, np.ndarray]:
    """Each request's req->token row and cached length, as int64 arrays."""
    n = len(reqs)
    return (np.fromiter((r.req_pool_idx for r in reqs), np.int64, n),
            np.fromiter((r.kv_len for r in reqs), np.int64, n))  # fmt: skip
