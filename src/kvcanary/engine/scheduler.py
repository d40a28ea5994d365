"""Scheduler: continuous batching over the KV memory system.

One forward per ``step()``: an extend batch when there is prefill work (continuing
chunked prefills first, then newly admitted requests, up to ``chunked_prefill_size``
tokens), otherwise one decode batch of every decode-ready request.

Memory policy:
  * admission matches the radix prefix cache (page aligned, at most ``seq_len - 1``),
    locks the matched node and only allocates the rest; it keeps headroom of
    ``new_token_ratio × remaining new tokens`` for the running requests' decodes;
  * an allocation that fails first evicts unlocked cache entries, then (decode only)
    retracts the newest running request (its KV freed or, with host offload, saved to
    CPU) and raises ``new_token_ratio`` so it is not readmitted straight away;
  * SWA pools: after every forward each request frees the SWA slots that left its
    window: ``frontier = floor_page(max(swa_evicted, protected, kv_len - W - P))``;
  * finished requests insert their KV into the cache (or free it) and unlock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from kvcanary.config import EngineConfig
from kvcanary.engine.forward_batch import ForwardBatch, ForwardMode
from kvcanary.engine.graph_runner import GraphRunner
from kvcanary.engine.model_runner import ModelRunner
from kvcanary.engine.request import Req
from kvcanary.engine.sampling import oracle_token, sample_batch
from kvcanary.memory import host_pool
from kvcanary.memory.radix_cache import RadixCache, RadixNode, SwaLock
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.utils import floor_page

INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.005


@dataclass
class SchedulerStats:
    num_forwards: int = 0
    num_extend_forwards: int = 0
    num_decode_forwards: int = 0
    num_prefill_tokens: int = 0  # tokens computed by extend forwards
    num_decode_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    num_prompt_tokens: int = 0  # at first admission
    num_cached_prompt_tokens: int = 0  # of those, served by the prefix cache
    num_retractions: int = 0
    num_swa_slots_evicted: int = 0  # SWA slots freed by window eviction
    peak_full_used: int = 0
    peak_swa_used: int = 0
    peak_full_active: int = 0  # minus the prefix cache's evictable part
    peak_swa_active: int = 0
    num_swa_slots_tombstoned: int = 0  # SWA slots the prefix cache gave back (tombstones)
    graph_replays: int = 0
    padded_rows: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner):
        self.config = config
        self.runner = runner
        self.allocator = runner.allocator
        self.req_to_token_pool = runner.req_to_token_pool
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.page_size = config.page_size
        self.window = runner.sliding_window if runner.is_swa else None
        self.cache: RadixCache | None = (
            RadixCache(self.allocator, config.page_size, self.window)
            if config.enable_prefix_cache
            else None
        )
        self.graph_runner = (
            GraphRunner(runner, config.graph_batch_sizes) if config.graph_batch_sizes else None
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._aborted: list[Req] = []  # reported by the next step()
        # Called with a finished request just before its KV is released (e.g. a
        # disaggregated prefill worker ships the KV from here).
        self.before_release: Callable[[Req], None] | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self.eos_ids = set(runner.tokenizer.eos_token_ids)

    # ------------------------------------------------------------------ api
    def add(self, req: Req) -> None:
        limit = self.runner.max_context_len
        if req.seq_len + req.params.max_new_tokens > limit:
            raise ValueError(
                f"request {req.rid}: prompt ({req.seq_len}) + max_new_tokens "
                f"({req.params.max_new_tokens}) exceeds max_context_len={limit}"
            )
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def abort_requests_referencing(
        self, full_slots: torch.Tensor, swa_slots: torch.Tensor | None = None
    ) -> list[int]:
        """Abort every running request whose KV includes ``full_slots`` (or, SWA pools,
        whose in-use full slots map to ``swa_slots``); quarantine those slots so they are
        never handed out again. The aborted requests come back from the next ``step()``
        with ``finish_reason="abort"``; everyone else keeps running. Returns their ids."""
        full_slots = full_slots.reshape(-1).to(torch.int64)
        swa_slots = (
            swa_slots.reshape(-1).to(torch.int64)
            if swa_slots is not None and self.runner.is_swa
            else torch.zeros(0, dtype=torch.int64)
        )
        full_slots, swa_slots = full_slots[full_slots > 0], swa_slots[swa_slots > 0]
        hit = [req for req in self.running if self._references(req, full_slots, swa_slots)]
        self.allocator.quarantine(full_slots)
        if swa_slots.numel():
            self._swa().quarantine_swa(swa_slots)
        for req in hit:
            # A corrupt entry can make aborted requests share pages with each other, a
            # survivor or the prefix cache: drop their rows, then free what nothing holds.
            self.running.remove(req)
            self._drop_row(req)
            req.finish_reason = "abort"
            self._aborted.append(req)
        if hit:
            self._free_unreferenced_pages()
        if self.cache is not None:
            # No later request may be served the corrupt KV from the prefix cache.
            corrupt = full_slots
            if swa_slots.numel():
                mapping = self._swa().full_to_swa_index_mapping[:-1]
                corrupt = torch.cat([corrupt, torch.nonzero(torch.isin(mapping, swa_slots)).reshape(-1)])
            self.cache.invalidate(corrupt)
        return [r.rid for r in hit]

    def _references(self, req: Req, full_slots: torch.Tensor, swa_slots: torch.Tensor) -> bool:
        """Whether ``req``'s KV includes one of ``full_slots`` or maps to one of ``swa_slots``."""
        slots = self.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
        if bool(torch.isin(slots, full_slots).any()):
            return True
        if not swa_slots.numel():
            return False
        return bool(torch.isin(self._swa().full_to_swa_index_mapping[slots], swa_slots).any())

    def step(self) -> list[Req]:
        """Run one forward; return the requests that finished in it (and any aborted
        since the last step)."""
        aborted, self._aborted = self._aborted, []
        return aborted + self._step()

    def _step(self) -> list[Req]:
        batch, reqs = self._schedule_extend()
        if batch is None:
            batch, reqs = self._schedule_decode()
        if batch is None:
            self._unstall()
            return []
        self._track_peak()
        t0 = time.perf_counter()
        if batch.is_decode and self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits = self.graph_runner.replay(batch)
            self.stats.graph_replays += 1
            self.stats.padded_rows += self.graph_runner.bucket_for(batch.batch_size) - batch.batch_size
        else:
            logits = self.runner.forward(batch)
        finished = self._process(batch, reqs, logits)
        dt = time.perf_counter() - t0
        self.stats.num_forwards += 1
        if batch.is_decode:
            self.stats.num_decode_forwards += 1
            self.stats.num_decode_tokens += batch.batch_size
            self.stats.decode_time_s += dt
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        else:
            self.stats.num_extend_forwards += 1
            self.stats.num_prefill_tokens += batch.num_tokens
            self.stats.prefill_time_s += dt
        self._evict_window()
        return finished

    # ------------------------------------------------------------ scheduling
    def _headroom_tokens(self, extra: list[Req]) -> int:
        reqs = self.running + extra
        return int(self.new_token_ratio * sum(r.remaining_new_tokens() for r in reqs))

    def _schedule_extend(self) -> tuple[ForwardBatch | None, list[Req]]:
        budget = self.config.chunked_prefill_size
        budget = budget if budget > 0 else 1 << 62
        plan: list[tuple[Req, int, int]] = []  # (req, start, end)
        for req in self.running:
            if budget <= 0:
                break
            if req.has_row and req.kv_len < req.seq_len - 1:
                end = min(req.seq_len, req.kv_len + budget)
                if self._alloc_extend(req, end):
                    plan.append((req, req.kv_len, end))
                    budget -= end - req.kv_len
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if not self._admit(req, budget):
                break
            end = min(req.seq_len, req.kv_len + budget)
            if not req.decode_ready and not self._alloc_extend(req, end):
                self.release(req, insert=False)  # back to waiting, nothing held
                break
            self.waiting.popleft()
            self.running.append(req)
            if not req.decode_ready:  # else: whole prompt cached or restored from host
                plan.append((req, req.kv_len, end))
                budget -= end - req.kv_len
        if not plan:
            return None, []
        return self._build_extend(plan), [r for r, _, _ in plan]

    def _admit(self, req: Req, budget: int) -> bool:
        """Give ``req`` a row and its cached/restored prefix; False (nothing held) if the
        pool cannot take it with decode headroom for everyone."""
        need = min(req.seq_len - req.kv_len, budget)
        headroom = self._headroom_tokens([req])
        if self.running and self._available() - need < headroom:
            self.evict_cache(need + headroom - self._available())
            if self._available() - need < headroom:
                return False
        row = self.req_to_token_pool.alloc(1)[0]
        req.req_pool_idx = row
        self.req_to_token_pool.set_tokens(row, req.all_ids())
        if req.host_copy is not None:
            if not self._restore_from_host(req):
                self.req_to_token_pool.free(row)
                req.req_pool_idx = 0
                return False
            return True
        if self.cache is not None:
            # Match at most seq_len - 1 tokens (the last one must be computed to sample);
            # truncating a longer match instead could cut where the window is not resident.
            match = self.cache.match_prefix(req.all_ids()[: req.seq_len - 1])
            prefix_len = match.num_tokens
            if prefix_len:
                self.req_to_token[row, :prefix_len] = match.device_indices.to(torch.int32)
            self.lock_prefix(req, match.last_node)
            req.kv_len = req.cache_protected_len = prefix_len
            # SWA eviction of the tree-owned prefix is the tree's business.
            req.swa_evicted_seqlen = prefix_len if self.window is not None else 0
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_prompt_tokens = req.kv_len
            self.stats.num_prompt_tokens += len(req.prompt_ids)
            self.stats.num_cached_prompt_tokens += req.kv_len
        return True

    def _alloc_extend(self, req: Req, end: int) -> bool:
        """Allocate and map slots for positions ``[kv_len, end)``."""
        start = req.kv_len
        last = self._last_locs([req])
        out = self._alloc_or_evict(
            lambda: self.allocator.alloc_extend([start], [end], last), end - start + self.page_size
        )
        if out is None:
            return False
        self.req_to_token[req.req_pool_idx, start:end] = out.to(torch.int32)
        return True

    def _schedule_decode(self) -> tuple[ForwardBatch | None, list[Req]]:
        reqs = [r for r in self.running if r.decode_ready]
        while reqs:
            seq_lens = [r.kv_len + 1 for r in reqs]
            last_locs = self._last_locs(reqs)
            out = self._alloc_or_evict(
                partial(self.allocator.alloc_decode, seq_lens, last_locs), len(reqs) * self.page_size
            )
            if out is not None:
                rows = torch.tensor([r.req_pool_idx for r in reqs])
                self.req_to_token[rows, torch.tensor([r.kv_len for r in reqs])] = out.to(torch.int32)
                return self._build_decode(reqs, out), reqs
            if len(self.running) == 1:
                raise RuntimeError(
                    f"KV pool too small: request {reqs[0].rid} at {reqs[0].seq_len} tokens cannot "
                    f"decode even alone (max_total_tokens={self.config.max_total_tokens}, "
                    f"swa_full_tokens_ratio={self.config.swa_full_tokens_ratio})"
                )
            victim = max(self.running, key=lambda r: (r.admitted_once, self.running.index(r)))
            self._retract(victim, requeue_front=True)
            reqs = [r for r in reqs if r is not victim]
        return None, []

    def _unstall(self) -> None:
        """No forward could be scheduled: free memory by retracting the newest running
        request, or fail loudly when a lone request cannot fit."""
        if not (self.waiting or self.running):
            return
        if len(self.running) > 1:
            self._retract(self.running[-1], requeue_front=True)
            return
        who = self.running[0] if self.running else self.waiting[0]
        raise RuntimeError(
            f"KV pool too small: request {who.rid} ({who.seq_len} tokens) cannot be scheduled "
            f"even alone (max_total_tokens={self.config.max_total_tokens}, "
            f"swa_full_tokens_ratio={self.config.swa_full_tokens_ratio}, "
            f"page_size={self.config.page_size})"
        )

    # ------------------------------------------------------------ batches
    def _last_locs(self, reqs: list[Req]) -> torch.Tensor:
        rows = torch.tensor([r.req_pool_idx for r in reqs])
        kv = torch.tensor([r.kv_len for r in reqs])
        last = self.req_to_token[rows, (kv - 1).clamp(min=0)].to(torch.int64)
        return torch.where(kv > 0, last, torch.full_like(last, -1))

    def _build_extend(self, plan: list[tuple[Req, int, int]]) -> ForwardBatch:
        dev = self.runner.device
        ids: list[int] = []
        pos: list[int] = []
        locs = []
        for req, start, end in plan:
            all_ids = req.all_ids()
            ids.extend(all_ids[start:end])
            pos.extend(range(start, end))
            locs.append(self.req_to_token[req.req_pool_idx, start:end])
        prefix = [s for _, s, _ in plan]
        seq = [e for _, _, e in plan]
        ext = [e - s for _, s, e in plan]
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            req_pool_indices=torch.tensor([r.req_pool_idx for r, _, _ in plan], device=dev),
            seq_lens=torch.tensor(seq, device=dev),
            prefix_lens=torch.tensor(prefix, device=dev),
            extend_seq_lens=torch.tensor(ext, device=dev),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            out_cache_loc=torch.cat(locs).to(torch.int64),
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=ext,
            rids=[r.rid for r, _, _ in plan],
        )

    def _build_decode(self, reqs: list[Req], out: torch.Tensor) -> ForwardBatch:
        dev = self.runner.device
        seq = [r.kv_len + 1 for r in reqs]
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], device=dev),
            seq_lens=torch.tensor(seq, device=dev),
            prefix_lens=torch.tensor([r.kv_len for r in reqs], device=dev),
            extend_seq_lens=torch.ones(len(reqs), dtype=torch.int64, device=dev),
            input_ids=torch.tensor([r.all_ids()[-1] for r in reqs], dtype=torch.int64, device=dev),
            positions=torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=dev),
            out_cache_loc=out.to(torch.int64),
            seq_lens_cpu=seq,
            prefix_lens_cpu=[r.kv_len for r in reqs],
            extend_seq_lens_cpu=[1] * len(reqs),
            rids=[r.rid for r in reqs],
        )

    # ------------------------------------------------------------ results
    def _process(self, batch: ForwardBatch, reqs: list[Req], logits: torch.Tensor) -> list[Req]:
        sample_rows = []
        for i, (req, seq_len) in enumerate(zip(reqs, batch.seq_lens_cpu, strict=True)):
            req.kv_len = seq_len
            if not batch.is_decode:
                self._cache_prefilled(req)
            if req.kv_len == req.seq_len:  # the whole known sequence is in the cache
                sample_rows.append(i)
        if not sample_rows:
            return []
        to_sample = [reqs[i] for i in sample_rows]
        if self.config.token_oracle:
            vocab = self.runner.vocab_size
            tokens = [oracle_token(r.rid, r.seq_len, vocab) for r in to_sample]
        else:
            tokens = sample_batch(
                logits[sample_rows], [r.params for r in to_sample], [r.generator for r in to_sample]
            )
        self.req_to_token_pool.append_tokens(
            [r.req_pool_idx for r in to_sample], [r.seq_len for r in to_sample], tokens
        )
        finished = []
        for req, tok in zip(to_sample, tokens, strict=True):
            req.output_ids.append(tok)
            if self.check_finish(req, tok):
                self.release(req, insert=True)
                self.running.remove(req)
                finished.append(req)
        return finished

    def _cache_prefilled(self, req: Req) -> None:
        """Share a request's freshly prefilled whole pages (after every prefill chunk, before
        window eviction can free their SWA) through the prefix cache while it still runs, so
        requests arriving meanwhile reuse them and find the window resident; the request
        adopts the tree's slots and locks them."""
        if self.cache is None or floor_page(req.kv_len, self.page_size) <= req.cache_protected_len:
            return
        slots = self.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
        match = self.cache.cache_unfinished(req.all_ids()[: req.kv_len], slots, req.swa_evicted_seqlen)
        if match is None:
            return
        self.req_to_token[req.req_pool_idx, : match.num_tokens] = match.device_indices.to(torch.int32)
        old_node, old_lock = req.last_node, req.cache_lock
        self.lock_prefix(req, match.last_node)
        self.unlock_prefix(old_node, old_lock)
        req.cache_protected_len = match.num_tokens

    def lock_prefix(self, req: Req, node: RadixNode) -> None:
        assert self.cache is not None
        req.cache_lock = self.cache.inc_lock_ref(node)
        req.last_node = node

    def unlock_prefix(self, node: RadixNode | None, lock: SwaLock | None) -> None:
        if self.cache is not None and node is not None and lock is not None:
            self.cache.dec_lock_ref(node, lock)

    def check_finish(self, req: Req, tok: int) -> bool:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.runner.max_context_len:
            req.finish_reason = "length"
        return req.finished

    # ------------------------------------------------------------ memory
    def _available(self) -> int:
        return self.allocator.available_size()

    def _alloc_or_evict(
        self, alloc: Callable[[], torch.Tensor | None], num_tokens: int
    ) -> torch.Tensor | None:
        """``alloc()``; when it fails, evict ``num_tokens`` from the prefix cache and retry
        once (allocators mutate nothing on failure, so the retry is clean)."""
        out = alloc()
        if out is None and self.cache is not None:
            self.evict_cache(num_tokens)
            out = alloc()
        return out

    def evict_cache(self, num_tokens: int) -> int:
        if self.cache is None:
            return 0
        freed_full, freed_swa = self.cache.evict(num_tokens, num_tokens if self.runner.is_swa else 0)
        self.stats.num_swa_slots_tombstoned += freed_swa
        return freed_full

    def _own_slots(self, req: Req) -> torch.Tensor:
        row = self.req_to_token[req.req_pool_idx]
        return row[req.cache_protected_len : req.kv_len].to(torch.int64)

    def release(self, req: Req, insert: bool) -> None:
        """Give back everything ``req`` holds: its own slots go to the cache (finished) or
        the free lists, the protected prefix is unlocked, the row is freed."""
        if req.finished and self.before_release is not None:
            self.before_release(req)
        if self.cache is not None and insert:
            slots = self.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
            # The tree takes whole pages (duplicates of cached pages it frees itself);
            # the partial last page stays ours.
            self.cache.insert(req.all_ids()[: req.kv_len], slots, req.swa_evicted_seqlen)
            self.allocator.free(slots[floor_page(req.kv_len, self.page_size) :])
        else:
            self.allocator.free(self._own_slots(req))
        self._drop_row(req)

    def _drop_row(self, req: Req) -> None:
        """Unlock ``req``'s protected prefix and give its row back; its slots are the
        caller's business."""
        self.unlock_prefix(req.last_node, req.cache_lock)
        req.cache_lock = None
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = 0
        req.last_node = None
        req.kv_len = req.cache_protected_len = req.swa_evicted_seqlen = 0

    def _free_unreferenced_pages(self) -> None:
        """Free, each exactly once, the allocated pages nothing references any more: the
        own pages of requests whose rows were just dropped (pages they shared included) and
        the slot a corrupt req->token entry orphaned. Never a page a live row or the prefix
        cache holds. SWA pools: then every allocated SWA page no full slot maps to."""
        p, alloc = self.page_size, self.allocator
        full = alloc.full_attn_allocator if isinstance(alloc, SWAAllocator) else alloc
        pages = torch.nonzero(full.page_allocated).reshape(-1)
        alloc.free(pages[~torch.isin(pages, self._referenced_slots() // p)] * p)
        if isinstance(alloc, SWAAllocator):
            mapping = alloc.full_to_swa_index_mapping[:-1]
            pages = torch.nonzero(alloc.swa_attn_allocator.page_allocated).reshape(-1)
            alloc.swa_attn_allocator.free(pages[~torch.isin(pages, mapping[mapping > 0] // p)] * p)

    def _referenced_slots(self) -> torch.Tensor:
        """Every full slot still referenced: running requests' KV, the sequences of rows
        held outside ``running`` (a disaggregated decode worker's transfers), the tree."""
        pool, running = self.req_to_token_pool, {r.req_pool_idx for r in self.running}
        spans = [self.req_to_token[r.req_pool_idx, : r.kv_len] for r in self.running]
        for row in torch.nonzero(pool.token_lens > 0).reshape(-1).tolist():
            if row not in running:
                spans.append(self.req_to_token[row, : int(pool.token_lens[row])])
        if self.cache is not None:
            spans.append(self.cache.all_values())
        spans.append(torch.zeros(0, dtype=torch.int64, device=self.req_to_token.device))
        return torch.cat([s.to(torch.int64) for s in spans])

    def _retract(self, req: Req, requeue_front: bool) -> None:
        if self.config.enable_host_offload and req.kv_len > 0:
            slots = self.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
            req.host_copy = host_pool.get_cpu_copy(self.runner.token_to_kv_pool, slots)
            req.host_kv_len = req.kv_len
        self.release(req, insert=False)
        if req in self.running:
            self.running.remove(req)
        if requeue_front:
            self.waiting.appendleft(req)
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.new_token_ratio = 1.0

    def _restore_from_host(self, req: Req) -> bool:
        """Reallocate ``[0, host_kv_len)`` and load the saved KV (SWA: only the window tail)."""
        n = req.host_kv_len
        assert req.host_copy is not None
        if self.runner.is_swa and self.window is not None:
            tail = n - floor_page(max(0, n - self.window), self.page_size)
            if not bool(req.host_copy["swa_mask"][n - tail :].all()):
                # The saved copy lacks part of the window: recompute instead.
                req.host_copy = None
                return True
            out = self._alloc_or_evict(lambda: self._swa().alloc_extend_swa_tail(0, n, -1, tail), n)
            req.swa_evicted_seqlen = n - tail
        else:
            no_prefix = torch.full((1,), -1, dtype=torch.int64)
            out = self._alloc_or_evict(lambda: self.allocator.alloc_extend([0], [n], no_prefix), n)
        if out is None:
            req.swa_evicted_seqlen = 0
            return False
        host_pool.load_cpu_copy(self.runner.token_to_kv_pool, req.host_copy, out)
        self.req_to_token[req.req_pool_idx, :n] = out.to(torch.int32)
        req.kv_len = n
        req.host_copy = None
        return True

    def _evict_window(self) -> None:
        """Free, in one call, the SWA slots that left each running request's window."""
        if self.window is None:
            return
        p = self.page_size
        spans = []
        for req in self.running:
            lock = req.cache_lock
            if (
                lock is not None
                and lock.swa_start < lock.path_len
                and req.kv_len - self.window >= req.cache_protected_len
            ):
                # The window left the cached prefix: the tree may tombstone its SWA now.
                assert self.cache is not None
                req.cache_lock = self.cache.dec_swa_lock_only(req.last_node, lock)
            start = max(req.swa_evicted_seqlen, req.cache_protected_len)
            frontier = floor_page(max(start, req.kv_len - self.window - p), p)
            if frontier > start:
                spans.append(self.req_to_token[req.req_pool_idx, start:frontier])
                req.swa_evicted_seqlen = frontier
        if not spans:
            return
        slots = torch.cat(spans).to(torch.int64)
        swa = self._swa()
        self.stats.num_swa_slots_evicted += int((swa.full_to_swa_index_mapping[slots] > 0).sum())
        swa.free_swa(slots)

    def _track_peak(self) -> None:
        """Peak slots allocated, and peak slots requests actually need ("active": minus
        what the prefix cache could give back right now)."""
        a, st = self.allocator, self.stats
        if isinstance(a, SWAAllocator):
            full_used = a.size_full - a.full_available_size()
            swa_used = a.size_swa - a.swa_available_size()
        else:
            full_used, swa_used = a.size - a.available_size(), 0
        full_idle = self.cache.evictable_size() if self.cache is not None else 0
        swa_idle = self.cache.swa_evictable_size() if self.cache is not None and self.runner.is_swa else 0
        st.peak_full_used = max(st.peak_full_used, full_used)
        st.peak_swa_used = max(st.peak_swa_used, swa_used)
        st.peak_full_active = max(st.peak_full_active, full_used - full_idle)
        st.peak_swa_active = max(st.peak_swa_active, swa_used - swa_idle)

    def _swa(self) -> SWAAllocator:
        """The SWA allocator (only SWA code paths ask)."""
        if not isinstance(self.allocator, SWAAllocator):
            raise RuntimeError("scheduler: an SWA-only path ran on a pool without SWA layers")
        return self.allocator

    def check_integrity(self) -> bool:
        self.allocator.check_integrity()
        self.req_to_token_pool.check_integrity()
        if self.cache is not None:
            self.cache.check_integrity()
        return True
