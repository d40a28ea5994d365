"""Engine.abort_request (a client went away: its KV comes back, nobody else notices) and
per-token logprobs (SamplingParams.logprobs)."""

from __future__ import annotations

import math

import pytest
from engine_utils import assert_all_memory_free, make_prompts, start_decoding, tiny_engine

from kvcanary import SamplingParams

PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha"])
def test_abort_running_request_frees_its_kv_and_spares_the_others(model: str) -> None:
    prompts = make_prompts(3, 30, 50, seed=1)
    alone = tiny_engine(model=model).generate(prompts, PARAMS)
    engine = tiny_engine(model=model)
    rids = start_decoding(engine, prompts, max_new_tokens=24)
    for _ in range(12):  # decoded tokens are the request's own slots (the prompt is cached)
        assert engine.step() == []
    before = engine.runner.allocator.available_size()
    out = engine.abort_request(rids[1])
    assert out is not None and out.finish_reason == "abort" and out.rid == rids[1]
    assert 0 < len(out.output_ids) < 24
    assert engine.runner.allocator.available_size() > before  # its slots are free again
    assert [r.rid for r in engine.running_requests()] == [rids[0], rids[2]]
    engine.check_integrity()
    done = {}
    while engine.has_unfinished():
        done.update({o.rid: o for o in engine.step()})
    assert set(done) == {rids[0], rids[2]}  # the aborted one is never reported
    assert done[rids[0]].output_ids == alone[0].output_ids
    assert done[rids[2]].output_ids == alone[2].output_ids
    assert_all_memory_free(engine)
    assert engine.abort_request(rids[1]) is None  # already gone


def test_abort_waiting_request_and_unknown_id() -> None:
    engine = tiny_engine(max_running_requests=1)
    a = engine.add_request([1, 2, 3], PARAMS)
    b = engine.add_request([4, 5, 6], PARAMS)
    engine.step()  # a runs, b waits
    assert engine.queue_lengths() == (1, 1)
    out = engine.abort_request(b)
    assert out is not None and out.output_ids == [] and engine.queue_lengths() == (1, 0)
    assert engine.abort_request(12345) is None
    while engine.has_unfinished():
        finished = engine.step()
        assert all(o.rid == a for o in finished)
    assert_all_memory_free(engine)


def test_logprobs_of_greedy_tokens_are_the_top_alternative() -> None:
    engine = tiny_engine()
    (out,) = engine.generate([[7, 8, 9, 10]], SamplingParams(max_new_tokens=6, logprobs=3))
    assert out.logprobs is not None and len(out.logprobs) == len(out.output_ids)
    for tok, lp in zip(out.output_ids, out.logprobs, strict=True):
        assert lp.token == tok and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the argmax
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    (plain,) = engine.generate([[7, 8, 9, 10]], SamplingParams(max_new_tokens=6))
    assert plain.logprobs is None and plain.output_ids == out.output_ids
    (zero,) = engine.generate([[7, 8, 9, 10]], SamplingParams(max_new_tokens=2, logprobs=0))
    assert zero.logprobs is not None and all(lp.top == () for lp in zero.logprobs)


def test_logprobs_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"logprobs=21 is invalid: allowed null or an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)
