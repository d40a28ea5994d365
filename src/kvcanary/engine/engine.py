"""Engine: the offline API.

    engine = Engine(EngineConfig(model="builtin:tiny-swa"))
    outs = engine.generate(["hello", [1, 2, 3]], SamplingParams(max_new_tokens=16))
    outs[0].output_ids, outs[0].text

or drive it step by step with ``add_request`` / ``step`` / ``has_unfinished``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.hooks import CANARY_HOST, DRAFT_CANARY_HOST, load_by_name
from kvcanary.engine.kv_manager import KVManager
from kvcanary.engine.model_runner import ModelRunner
from kvcanary.engine.request import Req, TokenLogprob
from kvcanary.engine.sampling import make_generator
from kvcanary.engine.scheduler import Scheduler
from kvcanary.engine.spec_faults import SpecFaultSite
from kvcanary.engine.stats import SchedulerStats
from kvcanary.memory.base import PrefixCache

if TYPE_CHECKING:  # the canary is a guest: imported only when enabled
    from kvcanary.canary.manager import CanaryManager

Prompt = str | Sequence[int]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    rid: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    num_cached_prompt_tokens: int
    num_retractions: int
    logprobs: list[TokenLogprob] | None = None  # per output token, when params.logprobs is set


class RunningRequest(NamedTuple):
    """A snapshot of one running request (what tests and the canary's tooling look at)."""

    rid: int
    req_pool_idx: int  # its req->token row (0: holds none right now)
    prompt_ids: list[int]
    output_ids: list[int]
    kv_len: int  # positions [0, kv_len) have K/V in the cache
    output_logprobs: list[TokenLogprob] | None = None  # when params.logprobs is set


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self.runner)
        self.tokenizer = self.runner.tokenizer
        self._rids = itertools.count(1)
        self.canary: CanaryManager | None = self._install_canary()
        # Speculative decoding with a draft model: the draft runner's own canary.
        self.draft_canary: CanaryManager | None = self._install_draft_canary()

    def _install_canary(self) -> CanaryManager | None:
        """The KV canary (kvcanary.canary.manager.CanaryManager), or None when it is off,
        installed by the engine's canary host, loaded by name (:data:`CANARY_HOST`)."""
        if not self.config.canary.enabled:
            return None
        canary: CanaryManager | None = load_by_name(CANARY_HOST)(self, self.config.canary)
        self.runner.canary = canary  # ModelRunner.forward calls its before/after hooks
        return canary

    def _install_draft_canary(self) -> CanaryManager | None:
        """The canary of the speculative draft model's runner (:data:`DRAFT_CANARY_HOST`),
        or None without a draft model or a canary."""
        draft = self.scheduler.proposer
        runner = getattr(draft, "runner", None)
        if not self.config.canary.enabled or runner is None:
            return None
        canary: CanaryManager | None = load_by_name(DRAFT_CANARY_HOST)(draft, self.config.canary)
        runner.canary = canary
        return canary

    @property
    def canaries(self) -> list[CanaryManager]:
        """Every installed canary: the target's, then the draft model's."""
        return [c for c in (self.canary, self.draft_canary) if c is not None]

    @property
    def spec_fault_site(self) -> SpecFaultSite | None:
        """What the canary's speculative-decoding fault injection needs of the engine
        (:mod:`kvcanary.engine.spec_faults`); None when speculative decoding is off."""
        return None if self.scheduler.proposer is None else SpecFaultSite(self.scheduler)

    def prompt_lens(self, rids: list[int]) -> list[int]:
        """Prompt length of each running request id (0 for padding / unknown ids)."""
        lens = {r.rid: len(r.prompt_ids) for r in self.scheduler.running}
        return [lens.get(rid, 0) for rid in rids]

    def override_next_token(self, rid: int, token: int) -> None:
        """Replace running request ``rid``'s last sampled, not yet fed token, as a sampler
        mixing up rows would (fault injection: the canary's ``next_token_swap``); the
        req->token token mirror follows."""
        req = next((r for r in self.scheduler.running if r.rid == rid), None)
        if req is None or not req.output_ids:
            raise ValueError(f"request {rid} is not running with a sampled token")
        req.output_ids[-1] = token
        if req.req_pool_idx:
            self.runner.req_to_token_pool.token_ids[req.req_pool_idx, req.seq_len - 1] = token

    def _encode(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} out of range: allowed [0, {vocab})")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id."""
        params = params or SamplingParams()
        rid = next(self._rids)
        req = Req(rid=rid, prompt_ids=self._encode(prompt), params=params)
        req.generator = make_generator(params, self.config.seed, rid)
        self.scheduler.add(req)
        return rid

    def check_request(self, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Raise what :meth:`add_request` would raise for this request (``ValueError``:
        an empty prompt, token ids out of range, too long for the context or the pools),
        without queueing it or changing any state."""
        params = params or SamplingParams()
        self.scheduler.check(Req(rid=-1, prompt_ids=self._encode(prompt), params=params))

    def step(self) -> list[RequestOutput]:
        """One forward; the requests that finished in it."""
        finished = self.scheduler.step()
        for canary in self.canaries:
            canary.end_step()  # abort mode: abort requests implicated by violations
        return [self._output(r) for r in finished]

    def abort_request(self, rid: int) -> RequestOutput | None:
        """Stop request ``rid`` now and free its KV (see ``Scheduler.abort_request``); its
        output so far (``finish_reason="abort"``), or None when it is not unfinished."""
        req = self.scheduler.abort_request(rid)
        return None if req is None else self._output(req)

    def running_requests(self) -> list[RunningRequest]:
        return [
            RunningRequest(r.rid, r.req_pool_idx, list(r.prompt_ids), list(r.output_ids), r.kv_len,
                           list(r.output_logprobs) if r.params.logprobs is not None else None)
            for r in self.scheduler.running
        ]

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        one_id_prompt = bool(items) and isinstance(items[0], int)
        batch = [cast(Prompt, prompts)] if one_id_prompt else cast(list[Prompt], items)
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"got {len(plist)} sampling params for {len(batch)} prompts")
        rids = [self.add_request(p, sp) for p, sp in zip(batch, plist, strict=True)]
        done: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            finished = self.step()
            for out in finished:
                done[out.rid] = out
            if on_step is not None:
                on_step(finished)
        for canary in self.canaries:
            canary.flush()  # report what a delayed pump has not read yet
        return [done[r] for r in rids]

    def _output(self, req: Req) -> RequestOutput:
        return RequestOutput(
            rid=req.rid,
            prompt_ids=list(req.prompt_ids),
            output_ids=list(req.output_ids),
            text=self.tokenizer.decode(req.output_ids),
            finish_reason=req.finish_reason or "",
            num_cached_prompt_tokens=req.num_cached_prompt_tokens,
            num_retractions=req.num_retractions,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
        )

    @property
    def kv(self) -> KVManager:
        """The KV lifecycle (pools, allocator, req->token rows, prefix cache)."""
        return self.scheduler.kv

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.kv.prefix_cache

    def abort_requests_referencing(
        self, full_slots: torch.Tensor, swa_slots: torch.Tensor | None = None,
        req_rows: torch.Tensor | None = None,
    ) -> list[int]:  # fmt: skip
        """Abort the running requests whose KV includes ``full_slots`` (or maps to
        ``swa_slots``) or that hold one of ``req_rows``, and quarantine those slots (see the
        scheduler's method)."""
        return self.scheduler.abort_requests_referencing(full_slots, swa_slots, req_rows)

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def enqueue(self, req: Req) -> None:
        """Queue a request built by the caller (its own id and generator)."""
        self.scheduler.add(req)

    def set_before_release(self, hook: Callable[[Req], None] | None) -> None:
        """Call ``hook(req)`` with each finished request while its KV is still in place."""
        self.scheduler.before_release = hook

    def check_integrity(self) -> bool:
        return self.scheduler.check_integrity()
