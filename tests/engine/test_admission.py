"""Admission is exact: a request is admitted iff it runs to completion alone.

``Scheduler.check`` refuses a request whose :func:`~kvcanary.engine.kv_manager.pool_need`
exceeds the pools; here the same request, queued past that check, runs alone in those pools
and must complete (every token, no retraction) exactly when it was admitted, and otherwise
stop with :class:`KVPoolTooSmallError` (a lone request that cannot be scheduled).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_utils import make_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.engine.errors import KVPoolTooSmallError, RequestTooLargeError
from kvcanary.engine.kv_manager import pool_need
from kvcanary.engine.request import Req
from kvcanary.model.presets import PRESETS


def _engine(model: str, page: int, full: int, swa: int, chunk: int, prefix_cache: bool) -> Engine:
    """Pools of ``full`` tokens and (sliding models) ``swa`` SWA tokens, both whole pages."""
    return Engine(EngineConfig(
        model=model, page_size=page, max_total_tokens=full, chunked_prefill_size=chunk,
        swa_full_tokens_ratio=min(1.0, (swa + 0.5) / full),  # (+0.5: float products round down)
        enable_prefix_cache=prefix_cache, graph_batch_sizes=(), max_context_len=1024,
        token_oracle=True,
    ))  # fmt: skip


def _admitted(engine: Engine, req: Req) -> bool:
    try:
        engine.scheduler.check(req)
    except RequestTooLargeError:
        return False
    return True


def _completes_alone(engine: Engine, req: Req) -> bool:
    """Run ``req`` alone, queued past admission: True when it finishes, False when the
    engine reports that a lone request cannot be scheduled."""
    engine.scheduler.waiting.append(req)
    try:
        while engine.has_unfinished():
            engine.step()
    except KVPoolTooSmallError:
        return False
    assert req.finish_reason == "length"
    assert len(req.output_ids) == req.params.max_new_tokens
    assert req.num_retractions == 0
    return True


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    sliding=st.booleans(),
    window=st.sampled_from([5, 8, 13, 32]),
    page=st.sampled_from([1, 2, 4, 8, 16]),
    prompt_len=st.integers(1, 120),
    new_tokens=st.integers(1, 40),
    chunk=st.sampled_from([0, 3, 8, 16, 29, 32, 64]),
    prefix_cache=st.booleans(),
    full_pages=st.integers(-1, 1),  # the full pool: its need plus this many pages
    swa_pages=st.integers(-2, 1),  # the SWA pool: likewise
)
def test_admitted_iff_it_completes_alone(
    sliding: bool, window: int, page: int, prompt_len: int, new_tokens: int, chunk: int,
    prefix_cache: bool, full_pages: int, swa_pages: int,
) -> None:  # fmt: skip
    need = pool_need(prompt_len, new_tokens, chunk, page, window if sliding else None,
                     prefix_cache=prefix_cache)  # fmt: skip
    full = max(need.num_full_tokens + full_pages * page, 2 * page)
    swa = max(need.num_swa_tokens + swa_pages * page, 2 * page)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "tiny-swa", replace(PRESETS["tiny-swa"], sliding_window=window))
        model = "builtin:tiny-swa" if sliding else "builtin:tiny-mha"
        engine = _engine(model, page, full, swa, chunk, prefix_cache)
    assert engine.runner.sliding_window == (window if sliding else None)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    req = Req(rid=1, prompt_ids=make_prompts(1, prompt_len, prompt_len)[0], params=params)
    assert _admitted(engine, req) == _completes_alone(engine, req)


def test_a_short_last_chunk_is_admitted_and_served() -> None:
    """70-73-token prompts, 64-token chunks: the second chunk holds 6-9 tokens, not 64. They
    were refused ("needs 120 full / 96 SWA KV tokens even alone; the pools hold 256 / 76")
    although each runs alone in those pools; served, they match unconstrained pools."""
    tight = EngineConfig(model="builtin:tiny-swa", max_total_tokens=256, swa_full_tokens_ratio=0.3,
                         chunked_prefill_size=64, canary=CanaryConfig(mode="raise"))  # fmt: skip
    engine, reference = Engine(tight), Engine(replace(tight, max_total_tokens=4096))
    assert engine.scheduler.kv.pool_sizes() == (256, 76)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    for prompt_len in range(70, 74):
        prompt = make_prompts(1, prompt_len, prompt_len, seed=prompt_len)[0]
        (out,) = engine.generate([prompt], params)
        (ref,) = reference.generate([prompt], params)
        assert len(out.output_ids) == 48 and out.num_retractions == 0
        assert out.output_ids == ref.output_ids


def test_a_cached_prefix_is_used_only_where_the_request_runs_alone_from_it() -> None:
    """A 16-token cache hit moves the chunks: [16, 73) with the hit's window locked needs
    76 SWA tokens, computing from 0 needs 64. In a pool of 64 the hit is left unused (the
    request used to stop with KVPoolTooSmallError); in a larger pool it is used."""
    need = pool_need(73, 48, 64, 4, 32, prefix_cache=True)
    hit = pool_need(73, 48, 64, 4, 32, prefix_cache=True, prefix_len=16)
    assert (need.num_swa_tokens, hit.num_swa_tokens) == (64, 76)
    prompt = make_prompts(1, 73, 73, seed=1)[0]
    other = prompt[:16] + make_prompts(1, 57, 57, seed=2)[0]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    for swa, cached in ((need.num_swa_tokens, 0), (128, 16)):
        engine = Engine(EngineConfig(max_total_tokens=256, swa_full_tokens_ratio=(swa + 0.5) / 256,
                                     chunked_prefill_size=64))  # fmt: skip
        engine.generate([prompt[:20]], SamplingParams(max_new_tokens=1))  # caches prompt[:16]
        (out,) = engine.generate([other], params)
        assert (out.num_cached_prompt_tokens, len(out.output_ids)) == (cached, 48)
