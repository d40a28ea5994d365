"""EngineLoop edge cases found in review: a submit racing the loop's close, a request that
fits the context but not the KV pools, and a stop string matched only when the text is
finished."""

from __future__ import annotations

import threading

import pytest

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.engine.kv_manager import pool_need
from kvcanary.engine.pool_check import check_pools
from kvcanary.server.engine_loop import (
    EngineLoop,
    EngineLoopStopped,
    InvalidRequestError,
    Submission,
)
from kvcanary.utils import floor_page


def _engine(**overrides: object) -> Engine:
    base: dict[str, object] = dict(model="builtin:tiny-swa", page_size=4, max_total_tokens=4096,
                                   max_context_len=256, graph_batch_sizes=())  # fmt: skip
    base.update(overrides)
    return Engine(EngineConfig(**base))  # type: ignore[arg-type]


def test_submit_after_the_loop_closed_fails_the_future_instead_of_hanging() -> None:
    loop = EngineLoop(_engine(max_total_tokens=256))
    loop.start()
    loop.stop()
    futures = []
    t = threading.Thread(target=lambda: futures.append(
        loop.submit(Submission("hi", SamplingParams(max_new_tokens=2)))), daemon=True)  # fmt: skip
    t.start()
    t.join(10)
    assert not t.is_alive(), "submit deadlocked on the loop's lock"
    with pytest.raises(EngineLoopStopped):
        futures[0].result(1)
    assert loop.num_in_flight == 0


def test_a_request_too_large_for_the_pools_fails_alone_and_the_loop_keeps_serving() -> None:
    loop = EngineLoop(_engine(max_total_tokens=256, max_context_len=1024))
    loop.start()
    try:
        ok = loop.submit(Submission("hello", SamplingParams(max_new_tokens=40, ignore_eos=True)))
        big = loop.submit(Submission([i % 250 + 1 for i in range(600)], SamplingParams(max_new_tokens=4)))
        with pytest.raises(InvalidRequestError, match="even alone"):
            big.result(60)
        assert len(ok.result(60).output_ids) == 40
        assert loop.alive
        after = loop.submit(Submission("hi", SamplingParams(max_new_tokens=2, ignore_eos=True)))
        assert len(after.result(60).output_ids) == 2
    finally:
        loop.stop()


def test_a_stop_string_matched_when_the_text_finishes_reports_stop() -> None:
    engine = _engine()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = engine.generate("hello kv canary", params)[0]
    decode = engine.tokenizer.decode
    full, prev = decode(ref.output_ids), decode(ref.output_ids[:-1])
    assert len(full) > len(prev)
    stop = full[len(prev):]  # the text of the last token only
    cut = full.find(stop)
    loop = EngineLoop(engine)
    loop.start()
    try:
        out = loop.submit(Submission("hello kv canary", params, (stop,))).result(60)
    finally:
        loop.stop()
    assert out.text == full[:cut]
    assert out.finish_reason == "stop"


def test_the_suggested_max_total_tokens_is_enough_when_the_window_is_not_whole_pages() -> None:
    kw = dict(prompt_len=40, max_new_tokens=200, chunked_prefill_size=0, page_size=16, window=100,
              swa_full_tokens_ratio=0.5, prefix_cache=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"--max-total-tokens to (\d+) or more") as e:
        check_pools(num_full_tokens=4096, num_swa_tokens=64, max_total_tokens=4096, **kw)  # type: ignore[arg-type]
    import re

    suggested = int(re.search(r"--max-total-tokens to (\d+) or more", str(e.value)).group(1))  # type: ignore[union-attr]
    swa = max(floor_page(int(floor_page(suggested, 16) * 0.5), 16), 32)
    assert swa >= pool_need(40, 200, 0, 16, 100, prefix_cache=True).num_swa_tokens
    check_pools(num_full_tokens=floor_page(suggested, 16), num_swa_tokens=swa,
                max_total_tokens=suggested, **kw)  # type: ignore[arg-type]  # fmt: skip
