"""Scheduler: continuous batching; the KV lifecycle itself is :class:`KVManager`'s.

One forward per ``step()``: an extend batch when there is prefill work (continuing
chunked prefills first, then newly admitted requests, up to ``chunked_prefill_size``
tokens), otherwise one decode batch of every decode-ready request.

Batching policy:
  * admission keeps headroom of ``new_token_ratio × remaining new tokens`` for the
    running requests' decodes (the KV manager matches and locks the cached prefix);
  * a decode step that does not fit retracts the newest running request (its KV freed
    or, with host offload, saved to CPU) and raises ``new_token_ratio`` so it is not
    readmitted straight away; a lone request that cannot fit is a
    :class:`KVPoolTooSmallError`;
  * after every forward the KV manager frees the SWA slots that left each window;
  * with speculative decoding (``config.speculative``), a decode step whose requests got
    drafts is one extend forward verifying them (``_schedule_verify``); the KV of rejected
    drafts is rolled back before the window eviction (``kv.rollback``);
  * finished requests insert their KV into the prefix cache (or free it) and unlock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from kvcanary.config import EngineConfig
from kvcanary.engine.errors import ContextLengthError, KVPoolTooSmallError, RequestTooLargeError
from kvcanary.engine.forward_batch import ForwardBatch, build_decode_batch, build_extend_batch
from kvcanary.engine.graph_runner import GraphRunner
from kvcanary.engine.kv_manager import KVManager, KVSpec, PoolNeed, pool_need
from kvcanary.engine.model_runner import ModelRunner
from kvcanary.engine.request import Req
from kvcanary.engine.sampling import oracle_token, record_logprobs, sample_batch
from kvcanary.engine.speculative import Proposer, accept_greedy, make_proposer
from kvcanary.engine.stats import SchedulerStats

INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.005


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner):
        self.config = config
        self.runner = runner
        self.stats = SchedulerStats()
        self.kv = KVManager(
            runner.allocator,
            runner.req_to_token_pool,
            runner.token_to_kv_pool,
            KVSpec(config.page_size, runner.sliding_window if runner.is_swa else None),
            enable_prefix_cache=config.enable_prefix_cache,
            enable_host_offload=config.enable_host_offload,
            stats=self.stats,
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
        self.eos_ids = set(runner.tokenizer.eos_token_ids)
        self.proposer: Proposer | None = make_proposer(config, runner)
        # (req_pool_idx, position) of each request whose last verify step rejected a draft
        # and kept the page of its bonus token's position (that slot still holds the first
        # rejected draft's KV until the next forward rewrites it): fault injection reads it
        # (kvcanary.engine.spec_faults).
        self.spec_rejections: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ api
    def add(self, req: Req) -> None:
        self.check(req)
        self.waiting.append(req)

    def check(self, req: Req) -> None:
        """Raise :class:`ContextLengthError` / :class:`RequestTooLargeError` when ``req`` can
        never run here (its context past the limit, or more KV than the pools hold even
        alone); changes nothing."""
        limit = self.runner.max_context_len
        if req.seq_len + req.params.max_new_tokens > limit:
            raise ContextLengthError(
                f"request {req.rid}: prompt ({req.seq_len}) + max_new_tokens "
                f"({req.params.max_new_tokens}) exceeds max_context_len={limit}",
                prompt_len=req.seq_len, max_new_tokens=req.params.max_new_tokens, limit=limit,
            )  # fmt: skip
        need = self._lone_need(req)
        full, swa = self.kv.pool_sizes()
        if not self._fits(need):
            raise RequestTooLargeError(
                f"request {req.rid}: prompt ({req.seq_len}) + max_new_tokens "
                f"({req.params.max_new_tokens}) needs {need.num_full_tokens} full / "
                f"{need.num_swa_tokens} SWA KV tokens even alone; the pools hold {full} / {swa}"
            )

    def _lone_need(self, req: Req, prefix_len: int = 0) -> PoolNeed:
        """The pools ``req`` runs to the end in alone, from here (its sequence so far as the
        prompt) and a cached prefix of ``prefix_len`` tokens."""
        return pool_need(req.seq_len, req.remaining_new_tokens(), self.config.chunked_prefill_size,
                         self.config.page_size, self.kv.spec.window,
                         prefix_cache=self.config.enable_prefix_cache, prefix_len=prefix_len)  # fmt: skip

    def _fits(self, need: PoolNeed) -> bool:
        full, swa = self.kv.pool_sizes()
        return need.num_full_tokens <= full and need.num_swa_tokens <= swa

    def adopt(self, req: Req) -> None:
        """A request whose KV is already in place (a disaggregated decode worker's, after
        its transfer landed) joins the running batch."""
        self.running.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def abort_requests_referencing(
        self, full_slots: torch.Tensor, swa_slots: torch.Tensor | None = None,
        req_rows: torch.Tensor | None = None,
    ) -> list[int]:  # fmt: skip
        """Abort every running request whose KV includes ``full_slots`` (or, SWA pools,
        whose in-use full slots map to ``swa_slots``) or that holds req->token row one of
        ``req_rows``; quarantine those slots so they are never handed out again. The aborted
        requests come back from the next ``step()`` with ``finish_reason="abort"``; everyone
        else keeps running. Returns their ids."""
        hit = self.kv.quarantine(full_slots, swa_slots, self.running, req_rows)
        for req in hit:
            self.running.remove(req)
            self._leave(req)
            req.finish_reason = "abort"
            self._aborted.append(req)
        return [r.rid for r in hit]

    def step(self) -> list[Req]:
        """Run one forward; return the requests that finished in it (and any aborted
        since the last step)."""
        aborted, self._aborted = self._aborted, []
        return aborted + self._step()

    def _step(self) -> list[Req]:
        batch, reqs = self._schedule_extend()
        drafts: list[list[int]] | None = None
        draft_s = 0.0  # drafting counts as decode time
        if batch is None and self.proposer is not None:
            draft_s = -self.stats.spec_draft_time_s
            batch, reqs, drafts = self._schedule_verify()
            draft_s += self.stats.spec_draft_time_s
        if batch is None:
            batch, reqs = self._schedule_decode()
        if batch is None:
            self._unstall()
            return []
        self.kv.track_peak()
        t0 = time.perf_counter() - draft_s
        if batch.is_decode and self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits = self.graph_runner.replay(batch)
            self.stats.graph_replays += 1
            self.stats.padded_rows += self.graph_runner.bucket_for(batch.batch_size) - batch.batch_size
        else:
            logits = self.runner.forward(batch)
        if drafts is None:
            finished = self._process(batch, reqs, logits)
        else:
            finished = self._process_verify(batch, reqs, drafts, logits)
        dt = time.perf_counter() - t0
        self.stats.num_forwards += 1
        if batch.is_decode or drafts is not None:
            self.stats.num_decode_forwards += 1
            if drafts is None:
                self.stats.num_decode_tokens += batch.batch_size
            self.stats.decode_time_s += dt
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        else:
            self.stats.num_extend_forwards += 1
            self.stats.num_prefill_tokens += batch.num_tokens
            self.stats.prefill_time_s += dt
        self.kv.evict_window(self.running)
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
                if self.kv.extend(req, end):
                    plan.append((req, req.kv_len, end))
                    budget -= end - req.kv_len
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if not self._admit(req, budget):
                break
            end = min(req.seq_len, req.kv_len + budget)
            if not req.decode_ready and not self.kv.extend(req, end):
                self.kv.release(req, insert=False)  # back to waiting, nothing held
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
        if self.running and not self.kv.can_admit(need, self._headroom_tokens([req])):
            return False
        if not self.kv.admit(req, lambda prefix_len: self._fits(self._lone_need(req, prefix_len))):
            return False
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_prompt_tokens = req.kv_len
            self.stats.num_prompt_tokens += len(req.prompt_ids)
            self.stats.num_cached_prompt_tokens += req.kv_len
        return True

    def _schedule_decode(self) -> tuple[ForwardBatch | None, list[Req]]:
        reqs = [r for r in self.running if r.decode_ready]
        while reqs:
            out = self.kv.extend_decode(reqs)
            if out is not None:
                return self._build_decode(reqs, out), reqs
            if len(self.running) == 1:
                raise KVPoolTooSmallError(
                    f"KV pool too small: request {reqs[0].rid} at {reqs[0].seq_len} tokens cannot "
                    f"decode even alone (max_total_tokens={self.config.max_total_tokens}, "
                    f"swa_full_tokens_ratio={self.config.swa_full_tokens_ratio})"
                )
            victim = max(self.running, key=lambda r: (r.admitted_once, self.running.index(r)))
            self._retract(victim)
            reqs = [r for r in reqs if r is not victim]
        return None, []

    def _schedule_verify(self) -> tuple[ForwardBatch | None, list[Req], list[list[int]] | None]:
        """A verify batch: every decode-ready request at positions ``[p, p + len(drafts)]``
        with tokens ``[last, d1 .. dK]`` (no drafts: the one decode position). None when no
        request got drafts or their slots do not fit (a plain decode step follows, with
        its retraction policy); nothing is held then."""
        reqs = [r for r in self.running if r.decode_ready]
        if self.proposer is None or not reqs:
            return None, [], None
        t0 = time.perf_counter()
        drafts = self.proposer.propose(reqs, [self._draft_budget(r) for r in reqs])
        self.stats.spec_draft_time_s += time.perf_counter() - t0
        if not any(drafts):
            return None, [], None
        ends = [req.seq_len + len(d) for req, d in zip(reqs, drafts, strict=True)]
        if not self.kv.extend_many(reqs, ends):  # (nothing held)
            self.stats.spec_fallbacks += 1
            return None, [], None
        plan = [(r, r.kv_len, e, [r.all_ids()[-1], *d]) for r, e, d in zip(reqs, ends, drafts, strict=True)]
        batch = build_extend_batch(self.runner.device, self.kv.req_to_token, plan)
        batch.all_logits = True
        return batch, reqs, drafts

    def _draft_budget(self, req: Req) -> int:
        """Drafts ``req`` may get this step: K, fewer near ``max_new_tokens`` or the context
        limit; none for sampled requests, ones asking for logprobs, or the token oracle."""
        if not req.params.greedy or req.params.logprobs is not None or self.config.token_oracle:
            return 0
        k = self.config.speculative.num_speculative_tokens
        return max(0, min(k, req.remaining_new_tokens() - 1, self.runner.max_context_len - req.seq_len - 1))

    def _unstall(self) -> None:
        """No forward could be scheduled: free memory by retracting the newest running
        request, or fail loudly when a lone request cannot fit."""
        if not (self.waiting or self.running):
            return
        if len(self.running) > 1:
            self._retract(self.running[-1])
            return
        who = self.running[0] if self.running else self.waiting[0]
        raise KVPoolTooSmallError(
            f"KV pool too small: request {who.rid} ({who.seq_len} tokens) cannot be scheduled "
            f"even alone (max_total_tokens={self.config.max_total_tokens}, "
            f"swa_full_tokens_ratio={self.config.swa_full_tokens_ratio}, "
            f"page_size={self.config.page_size})"
        )

    def _retract(self, req: Req) -> None:
        """Free ``req``'s KV (host offload: save it first) and requeue it at the front."""
        self.kv.retract(req)
        if req in self.running:
            self.running.remove(req)
        self._leave(req)
        self.waiting.appendleft(req)
        self.new_token_ratio = 1.0

    # ------------------------------------------------------------ batches
    def _build_extend(self, plan: list[tuple[Req, int, int]]) -> ForwardBatch:
        return build_extend_batch(self.runner.device, self.kv.req_to_token,
                                  [(r, s, e, r.all_ids()[s:e]) for r, s, e in plan])  # fmt: skip

    def _build_decode(self, reqs: list[Req], out: torch.Tensor) -> ForwardBatch:
        return build_decode_batch(self.runner.device, reqs, out)

    # ------------------------------------------------------------ results
    def _process(self, batch: ForwardBatch, reqs: list[Req], logits: torch.Tensor) -> list[Req]:
        sample_rows = []
        extend = not batch.is_decode  # (a property: read once, not per request)
        for i, (req, seq_len) in enumerate(zip(reqs, batch.seq_lens_cpu, strict=True)):
            req.kv_len = seq_len
            if extend:
                self.kv.cache(req)
            if req.kv_len == req.seq_len:  # the whole known sequence is in the cache
                sample_rows.append(i)
        if not sample_rows:
            return []
        to_sample = [reqs[i] for i in sample_rows]
        # (a decode step samples every row: no gathered copy of the logits)
        rows = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
        if self.config.token_oracle:
            vocab = self.runner.vocab_size
            tokens = [oracle_token(r.rid, r.seq_len, vocab) for r in to_sample]
        else:
            tokens = sample_batch(rows, [r.params for r in to_sample], [r.generator for r in to_sample])
        self.kv.req_to_token_pool.append_tokens(
            [r.req_pool_idx for r in to_sample], [r.seq_len for r in to_sample], tokens
        )
        record_logprobs(to_sample, rows, tokens)
        finished = []
        for req, tok in zip(to_sample, tokens, strict=True):
            req.output_ids.append(tok)
            if self.check_finish(req, tok):
                self.finish(req)
                self.running.remove(req)
                finished.append(req)
        return finished

    def _process_verify(
        self, batch: ForwardBatch, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor
    ) -> list[Req]:
        """Accept each request's drafts (the longest prefix its argmax agrees with, then its
        own token; sampled requests: one token as in a decode step), truncated at a stop
        token or ``max_new_tokens``; roll the KV of every position past the new ``kv_len``
        back."""
        starts = np.cumsum([0, *batch.extend_seq_lens_cpu[:-1]]).tolist()
        plain = [i for i, d in enumerate(drafts) if not d]
        sampled: dict[int, int] = {}
        if plain:
            to_sample = [reqs[i] for i in plain]
            rows = logits[[starts[i] for i in plain]]
            tokens = sample_batch(rows, [r.params for r in to_sample], [r.generator for r in to_sample])
            record_logprobs(to_sample, rows, tokens)
            sampled = dict(zip(plain, tokens, strict=True))
        argmax = logits.argmax(dim=-1).tolist() if len(plain) < len(reqs) else []
        finished, st = [], self.stats
        self.spec_rejections = []
        page = self.config.page_size
        for i, (req, d, start, n) in enumerate(zip(reqs, drafts, starts, batch.extend_seq_lens_cpu, strict=True)):
            end = req.kv_len + n  # past the last position this forward wrote
            if d:
                emitted, accepted = accept_greedy(d, argmax[start : start + n])
                st.spec_num_drafted_reqs += 1
                st.spec_num_proposed += len(d)
                st.spec_num_accepted += accepted
                rejected = accepted < len(d)
            else:
                emitted, rejected = [sampled[i]], False
            for tok in emitted:
                self.kv.req_to_token_pool.append_tokens([req.req_pool_idx], [req.seq_len], [tok])
                req.output_ids.append(tok)
                st.num_decode_tokens += 1
                if self.check_finish(req, tok):
                    break
            req.kv_len = end
            self.kv.rollback(req, req.seq_len - 1, end)  # every kept token has its KV but the last
            if rejected and not req.finished and req.kv_len % page:
                self.spec_rejections.append((req.req_pool_idx, req.kv_len))
            if req.finished:
                self.finish(req)
                self.running.remove(req)
                finished.append(req)
        return finished

    def _leave(self, req: Req) -> None:
        """``req`` left the running batch: the proposer forgets it."""
        if self.proposer is not None:
            self.proposer.drop(req)

    def abort_request(self, rid: int) -> Req | None:
        """Drop request ``rid`` (a client went away, a stop string matched): a waiting one
        leaves the queue (and any host copy), a running one gives its KV back without
        inserting it into the prefix cache. It is not reported by ``step()``. Returns the
        request (``finish_reason="abort"``), or None when ``rid`` is not unfinished here."""
        req = next((r for r in (*self.waiting, *self.running) if r.rid == rid), None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req, insert=False)
            self._leave(req)
        else:
            self.waiting.remove(req)
            req.host_copy = None
        req.finish_reason = "abort"
        return req

    def check_finish(self, req: Req, tok: int) -> bool:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.runner.max_context_len:
            req.finish_reason = "length"
        return req.finished

    def finish(self, req: Req) -> None:
        """A finished request's KV goes to the prefix cache (``before_release`` first)."""
        if self.before_release is not None:
            self.before_release(req)
        self.kv.release(req, insert=True)
        self._leave(req)

    def check_integrity(self) -> bool:
        if self.proposer is not None:
            self.proposer.check_integrity()
        return self.kv.check_integrity()
