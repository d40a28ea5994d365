"""The engine's greedy output equals a dense single-sequence reference computation on the
same weights: the absolute anchor for every equivalence test."""

from __future__ import annotations

import pytest
from dense_backend import DenseRunner
from engine_utils import assert_all_memory_free, greedy_outputs, make_prompts, tiny_engine


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha"])
def test_batched_engine_matches_dense_reference(model: str) -> None:
    engine = tiny_engine(model=model, chunked_prefill_size=48)
    window = engine.runner.sliding_window
    prompts = make_prompts(5, 40, 90, seed=1)
    if window is not None:
        assert all(len(p) > window for p in prompts)  # the window really cuts
    outs = greedy_outputs(engine, prompts, max_new_tokens=20)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == DenseRunner(engine.runner.model).greedy(prompt, 20)
    assert_all_memory_free(engine)
