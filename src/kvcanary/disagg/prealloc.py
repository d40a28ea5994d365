"""Decode-side pre-allocation: admit incoming requests against two budgets (full pool and
SWA pool) and reserve their KV before the prefill side ships it (after SGLang's
``DecodePreallocQueue``; ``reference/swa_pools.md`` §6).

Tail pre-allocation (SWA pools, page size > 1): the full pool gets the whole sequence, the
SWA pool only the page-aligned window tail, allocated as a fresh sequence::

    positions   0 ............. window_start ............. fill_len
    full        [==========================================)
    SWA                         [==========================)   tail = fill_len - window_start
                window_start = floor_page(max(0, fill_len - W)) = the request's swa_evicted_seqlen

    W=128 P=64  L=1000: window_start 832, tail 168 -> 3 SWA pages (16 without the tail path)
    W=128 P=256 L=1000: window_start 768, tail 232 -> charged 256 (whole pages)

``fill_len`` = prompt + max(outputs - 1, 0): the last sampled token has no KV yet.

A decode-side prefix-cache hit (``prefix_len`` tokens already held, page aligned) shrinks
the allocation to ``[prefix_len, fill_len)``. The tail path needs the window to start inside
that delta; otherwise the SWA side gets the delta, which is never more pages than the tail.
One function, :meth:`DecodePreallocQueue._prealloc_plan`, decides tail vs delta and the page
counts; admission charges exactly what ``_pre_alloc`` then allocates.

Non-SWA pools, page size 1, or ``swa_tail_prealloc=False``: no tail; both budgets are the
same number (``min(full, swa)`` free for SWA pools, so the SWA pool is charged whole).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from kvcanary.disagg.config import DisaggConfig
from kvcanary.engine.kv_manager import KVManager
from kvcanary.engine.request import Req
from kvcanary.utils import cdiv, swa_tail_len


class PreallocPlan(NamedTuple):
    prefix_len: int  # tokens the decode side already holds (prefix-cache hit)
    fill_len: int
    takes_tail_path: bool
    swa_tail_len: int  # SWA tokens the tail path allocates (0 off the tail path)
    num_full_pages: int  # pages each allocation takes
    num_swa_pages: int


class TokenBudgets(NamedTuple):
    full: int
    swa: int


class ActiveRequests(Protocol):
    """The decode side's requests holding KV besides the transferring ones (the
    scheduler's queues: ``running`` decode, ``waiting`` holds only retracted requests)."""

    @property
    def running(self) -> Sequence[Req]: ...

    @property
    def waiting(self) -> Sequence[Req]: ...


class DecodePreallocQueue:
    """Requests waiting for decode-side KV (``queue``, FIFO) and those whose KV is reserved
    but not landed yet (``transferring``); the KV itself through the engine's KV manager."""

    def __init__(self, kv: KVManager, active: ActiveRequests, config: DisaggConfig):
        self.kv = kv
        self.active = active
        self.allocator = kv.allocator
        self.page_size = kv.spec.page_size
        self.window = kv.spec.window
        self.config = config
        self.queue: deque[Req] = deque()
        self.transferring: dict[int, Req] = {}
        self.tail_mode = self._uses_swa_tail_prealloc()
        # Why the last admission round stopped with requests still queued (None: it did not).
        self.last_rejection: str | None = None

    # ------------------------------------------------------------------ lengths
    def _uses_swa_tail_prealloc(self) -> bool:
        return self.config.swa_tail_prealloc and self.kv.spec.windowed and self.page_size > 1

    def _swa_tail_len(self, seq_len: int) -> int:
        if not self.tail_mode:
            return max(seq_len, 0)
        return swa_tail_len(seq_len, self.window, self.page_size)

    @staticmethod
    def _prealloc_fill_len(req: Req) -> int:
        return len(req.prompt_ids) + max(len(req.output_ids) - 1, 0)

    def _prealloc_kv_lens(self, req: Req) -> tuple[int, int]:
        """(fill_len, SWA tokens it needs resident): the tail in tail mode, else fill_len."""
        fill_len = self._prealloc_fill_len(req)
        return fill_len, self._swa_tail_len(fill_len)

    def _swa_retractable_len(self, req: Req) -> int:
        """SWA tokens retracting a running request would give back (at most)."""
        if self.tail_mode:
            return self._swa_tail_len(len(req.prompt_ids)) + len(req.output_ids)
        return len(req.prompt_ids) + len(req.output_ids)

    def _prealloc_plan(self, fill_len: int, prefix_len: int = 0) -> PreallocPlan:
        """What pre-allocating ``[prefix_len, fill_len)`` takes; the one predicate both the
        admission charge and the allocation use."""
        p = self.page_size
        num_full_pages = cdiv(fill_len, p) - cdiv(prefix_len, p)
        tail = self._swa_tail_len(fill_len)
        if self.tail_mode and fill_len - tail >= prefix_len:
            return PreallocPlan(prefix_len, fill_len, True, tail, num_full_pages, cdiv(tail, p))
        return PreallocPlan(prefix_len, fill_len, False, 0, num_full_pages, num_full_pages)

    def _prealloc_required_tokens(self, req: Req, prefix_len: int = 0) -> tuple[int, int]:
        """(full, SWA) tokens admission charges: whole pages plus the decode reserve."""
        plan = self._prealloc_plan(self._prealloc_fill_len(req), prefix_len)
        reserve = self.config.num_reserved_decode_tokens
        p = self.page_size
        return plan.num_full_pages * p + reserve, plan.num_swa_pages * p + reserve

    # ------------------------------------------------------------------ budgets
    def _max_new(self, req: Req) -> int:
        return min(req.params.max_new_tokens, self.config.clip_max_new_tokens)

    def _allocatable_token_budgets(self, count_retracted: bool = True) -> TokenBudgets:
        """(full, SWA) tokens new pre-allocations may take now.

        Both keep ``num_reserved_decode_tokens`` per active request (running, transferring,
        retracted) for decode growth, and room for the largest running request to finish
        alone once every other is retracted. The SWA reserve is capped by how far active
        requests can still grow towards a window each (``n_active * W - swa_used``).
        Retracted requests' own needs come off the top (``count_retracted``).
        """
        alloc, cache = self.allocator, self.kv.prefix_cache
        running, retracted = self.active.running, list(self.active.waiting)
        n_active = len(running) + len(self.transferring) + len(retracted)
        reserved = self.config.num_reserved_decode_tokens * n_active
        retractable = sum(len(r.prompt_ids) + len(r.output_ids) for r in running)
        need = max(
            (self._max_new(r) + len(r.prompt_ids) - retractable for r in running), default=0
        )
        swa_alloc = self.kv.swa() if self.tail_mode else None
        available = alloc.available_size() if swa_alloc is None else swa_alloc.full_available_size()
        if cache is not None:
            available += cache.evictable_size()
        full = available - max(reserved, need)
        if count_retracted:
            full -= sum(self._prealloc_required_tokens(r)[0] for r in retracted)
        if swa_alloc is None or self.window is None:
            return TokenBudgets(full, full)
        swa_available = swa_alloc.swa_available_size()
        swa_retractable = sum(self._swa_retractable_len(r) for r in running)
        swa_need = max(
            (self._swa_tail_len(len(r.prompt_ids)) + self._max_new(r) - swa_retractable
             for r in running),
            default=0,
        )  # fmt: skip
        growth = max(0, n_active * self.window - (swa_alloc.size_swa - swa_available))
        swa = swa_available - max(min(reserved, growth), swa_need)
        if count_retracted:
            swa -= sum(self._prealloc_required_tokens(r)[1] for r in retracted)
        return TokenBudgets(full, swa)

    # ------------------------------------------------------------------ admission
    def capacity_error(self, req: Req) -> str | None:
        """Why ``req`` can never be admitted, even into idle pools (None: it can); the same
        checks as admission with nothing else active."""
        fill_len, swa_len = self._prealloc_kv_lens(req)
        full_req, swa_req = self._prealloc_required_tokens(req)
        alloc, max_new = self.allocator, self._max_new(req)
        swa_alloc = self.kv.swa() if self.tail_mode else None
        full_size = alloc.size if swa_alloc is None else swa_alloc.size_full
        full_need = max(full_req, fill_len + max_new)
        if full_need > full_size:
            return f"request {req.rid} needs {full_need} KV tokens; the decode pool holds {full_size}"
        swa_need = max(swa_req, swa_len + max_new)
        if swa_alloc is not None and swa_need > swa_alloc.size_swa:
            return (
                f"request {req.rid} needs {swa_need} SWA tokens; the decode SWA pool holds "
                f"{swa_alloc.size_swa}"
            )
        return None

    def pop_preallocated(self) -> list[Req]:
        """Admit queued requests in FIFO order while both budgets allow; pre-allocate each
        (row, prefix lock, KV) and move it to ``transferring``. Stops at the first request
        that does not fit (nothing of it held)."""
        admitted: list[Req] = []
        self.last_rejection = None
        if not self.queue:
            return admitted
        running = self.active.running
        full_budget, swa_budget = self._allocatable_token_budgets()
        retractable = sum(len(r.prompt_ids) + len(r.output_ids) for r in running)
        swa_retractable = sum(self._swa_retractable_len(r) for r in running)
        while self.queue:
            if self.kv.req_to_token_pool.available_size() == 0:
                self.last_rejection = "no free req_to_token row"
                break
            req = self.queue[0]
            fill_len, swa_len = self._prealloc_kv_lens(req)
            prefix_len, prefix_slots, locked_tokens = self._match_and_lock(req, fill_len)
            full_budget -= locked_tokens  # locking took those tokens out of the evictable part
            full_req, swa_req = self._prealloc_required_tokens(req, prefix_len)
            max_new = self._max_new(req)
            plan = self._prealloc_plan(fill_len, prefix_len)
            if max(full_req, fill_len - prefix_len + max_new - retractable) > full_budget:
                self.last_rejection = "full budget" if self.tail_mode else "budget"
            elif self.tail_mode and max(swa_req, swa_len + max_new - swa_retractable) > swa_budget:
                self.last_rejection = "swa budget"
            elif not self.kv.preallocate(
                req, prefix_slots, plan.prefix_len, plan.fill_len, plan.swa_tail_len
            ):
                self.last_rejection = "allocation failed"
            if self.last_rejection is not None:
                self.kv.unlock_prefix(req)
                break
            self.queue.popleft()
            self.transferring[req.rid] = req
            admitted.append(req)
            full_budget -= full_req
            swa_budget -= swa_req
        return admitted

    def _match_and_lock(self, req: Req, fill_len: int) -> tuple[int, torch.Tensor | None, int]:
        """Decode-side prefix-cache hit: (prefix_len, its slots, tokens the lock took out of
        the evictable part). The lock is held from here (``kv.unlock_prefix`` releases it)."""
        cache = self.kv.prefix_cache
        if cache is None:
            return 0, None, 0
        match = cache.match_prefix(req.prompt_ids[: fill_len - 1])
        before = cache.evictable_size()
        self.kv.lock_prefix(req, match.last_node)
        return match.num_tokens, match.device_indices, before - cache.evictable_size()

    def release(self, req: Req) -> None:
        """Give back everything a transferring request holds (its transfer failed)."""
        self.transferring.pop(req.rid, None)
        if req.has_row:
            self.kv.release(req, insert=False)
