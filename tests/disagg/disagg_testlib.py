"""Shared helpers of the disaggregation tests: a decode-side scheduler over real pools but
no model (arbitrary window / page geometry), and tiny engine configs for the workers."""

from __future__ import annotations

import random
from collections import deque
from types import SimpleNamespace
from typing import Any

import torch

from kvcanary.canary.config import CanaryConfig
from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.disagg.config import DisaggConfig
from kvcanary.disagg.prealloc import DecodePreallocQueue
from kvcanary.engine.request import Req
from kvcanary.engine.scheduler import Scheduler
from kvcanary.memory.allocator import make_allocator
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.req_to_token import ReqToTokenPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool


def memory_scheduler(
    *,
    window: int | None = 128,
    page_size: int = 64,
    full_tokens: int = 64 * 64,
    swa_tokens: int = 16 * 64,
    rows: int = 16,
    prefix_cache: bool = False,
    max_context_len: int = 4096,
) -> Scheduler:
    """A real Scheduler over real pools (1 head x 4 dims: cheap) with a stand-in runner;
    ``window`` None builds an MHA pool."""
    if window is None:
        pool: Any = MHAKVPool(full_tokens, page_size, torch.float32, 1, 4, 1)
        alloc: Any = make_allocator(full_tokens, page_size)
    else:
        pool = SWAKVPool(full_tokens, swa_tokens, page_size, torch.float32, 1, 4, [0], [1])
        alloc = SWAAllocator(full_tokens, swa_tokens, page_size, kvcache=pool)
    runner = SimpleNamespace(
        allocator=alloc, token_to_kv_pool=pool,
        req_to_token_pool=ReqToTokenPool(rows, max_context_len), sliding_window=window,
        is_swa=window is not None, tokenizer=SimpleNamespace(eos_token_ids=[]),
        max_context_len=max_context_len,
    )  # fmt: skip
    config = EngineConfig(page_size=page_size, max_total_tokens=full_tokens, graph_batch_sizes=(),
                          enable_prefix_cache=prefix_cache, max_running_requests=rows)  # fmt: skip
    return Scheduler(config, runner)


def prealloc_queue(sched: Scheduler, **disagg: Any) -> DecodePreallocQueue:
    disagg.setdefault("transfer_backend", "inproc")
    return DecodePreallocQueue(sched.kv, sched, DisaggConfig(**disagg))


_rids = iter(range(1, 1 << 30))


def make_req(prompt_len: int, max_new_tokens: int = 1, outputs: int = 0) -> Req:
    req = Req(rid=next(_rids), prompt_ids=[1] * prompt_len,
              params=SamplingParams(max_new_tokens=max_new_tokens))  # fmt: skip
    req.output_ids = [2] * outputs
    return req


def memory_state(sched: Scheduler) -> tuple[Any, ...]:
    """Everything a leak would change."""
    a = sched.kv.allocator
    sizes = (a.full_available_size(), a.swa_available_size()) if isinstance(a, SWAAllocator) \
        else (a.available_size(),)  # fmt: skip
    return (*sizes, sched.kv.req_to_token_pool.available_size(), deque(sched.running))


# ---------------------------------------------------------------------------- engines


def tiny_config(model: str = "builtin:tiny-swa", **overrides: Any) -> EngineConfig:
    base: dict[str, Any] = dict(model=model, page_size=4, max_total_tokens=4096,
                                max_context_len=1024,
                                canary=CanaryConfig(mode="raise", real_data="partial"))  # fmt: skip
    base.update(overrides)
    return EngineConfig(**base)


def prompts(num: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def assert_side_clean(report: dict[str, Any] | None, canary: bool = True) -> None:
    """Integrity holds, every slot and row is free, no canary violation."""
    assert report is not None
    assert report["integrity_ok"], report["integrity_error"]
    assert report["memory_free"], report
    if canary:
        assert report["canary"] is not None
        assert report["canary"]["stats"]["violations"] == 0
        assert report["canary"]["stats"]["protected_tokens"] > 0
