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
from typing import Any, NamedTuple

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.model_runner import ModelRunner
from kvcanary.engine.request import Req
from kvcanary.engine.sampling import make_generator
from kvcanary.engine.scheduler import Scheduler

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


class RunningRequest(NamedTuple):
    """A snapshot of one running request (what tests and the canary's tooling look at)."""

    rid: int
    req_pool_idx: int  # its req->token row (0: holds none right now)
    prompt_ids: list[int]
    output_ids: list[int]
    kv_len: int  # positions [0, kv_len) have K/V in the cache


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self.runner)
        self.tokenizer = self.runner.tokenizer
        self._rids = itertools.count(1)
        self.canary: Any = self._install_canary()

    def _install_canary(self) -> Any:
        """The KV canary (kvcanary.canary.manager.CanaryManager), or None when it is off."""
        if self.config.kv_canary == "none":
            return None
        from kvcanary.canary.install import install_canary  # the canary is a guest: lazy

        canary = install_canary(self.runner, self.config.canary_config())
        if canary is None:
            return None
        if self.config.kv_canary == "abort":
            abort = getattr(self.scheduler, "abort_requests_referencing", None)
            if abort is None:
                raise NotImplementedError(
                    "--kv-canary=abort needs Scheduler.abort_requests_referencing"
                )
            canary.set_abort_handler(abort)
        canary.attach_radix_cache(self.scheduler.cache)  # the radix sweep walks it
        if self.config.token_oracle:  # every fed token is known: arm the write-input assert
            from kvcanary.canary.token_oracle import TokenOracleExpectations

            canary.set_expected_inputs(
                TokenOracleExpectations(self.runner.vocab_size, self._prompt_lens)
            )
        canary.mark_init_finished()  # no warm-up or capture to wait for
        return canary

    def _prompt_lens(self, rids: list[int]) -> list[int]:
        """Prompt length of each running request id (0 for padding / unknown ids)."""
        lens = {r.rid: len(r.prompt_ids) for r in self.scheduler.running}
        return [lens.get(rid, 0) for rid in rids]

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

    def step(self) -> list[RequestOutput]:
        """One forward; the requests that finished in it."""
        finished = self.scheduler.step()
        if self.canary is not None:
            self.canary.end_step()  # abort mode: abort requests implicated by violations
        return [self._output(r) for r in finished]

    def running_requests(self) -> list[RunningRequest]:
        return [
            RunningRequest(r.rid, r.req_pool_idx, list(r.prompt_ids), list(r.output_ids), r.kv_len)
            for r in self.scheduler.running
        ]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]  # one prompt
        else:
            batch = list(prompts)  # type: ignore[arg-type]
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
        if self.canary is not None:
            self.canary.flush()  # report what a delayed pump has not read yet
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
        )

    def check_integrity(self) -> bool:
        return self.scheduler.check_integrity()
