"""Every scheduling/memory path produces the same greedy tokens as the plain path, leaves
the memory system intact and frees everything at the end."""

from __future__ import annotations

from typing import Any

import pytest
from engine_utils import assert_all_memory_free, greedy_outputs, make_prompts, tiny_engine

PROMPTS = make_prompts(8, 40, 120, shared=48, seed=7)
NEW_TOKENS = 40


def _run(waves: int = 2, **overrides: Any) -> tuple[list[list[int]], Any]:
    engine = tiny_engine(**overrides)
    outs = greedy_outputs(engine, PROMPTS, NEW_TOKENS, waves=waves)
    return outs, engine


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    outs, engine = _run(enable_prefix_cache=False, chunked_prefill_size=0, graph_batch_sizes=())
    assert_all_memory_free(engine)
    return outs


def test_chunked_prefill_equals_unchunked(baseline: list[list[int]]) -> None:
    outs, engine = _run(enable_prefix_cache=False, chunked_prefill_size=16, graph_batch_sizes=())
    assert outs == baseline
    # Chunking really happened: more extend forwards than prompts.
    assert engine.scheduler.stats.num_extend_forwards > len(PROMPTS)
    assert_all_memory_free(engine)


def test_prefix_cache_equals_no_cache(baseline: list[list[int]]) -> None:
    outs, engine = _run(enable_prefix_cache=True)
    assert outs == baseline
    assert engine.scheduler.stats.num_cached_prompt_tokens > 0
    assert_all_memory_free(engine)


def test_graph_runner_equals_eager(baseline: list[list[int]]) -> None:
    outs, engine = _run(enable_prefix_cache=False, graph_batch_sizes=(1, 2, 8))
    assert outs == baseline
    stats = engine.scheduler.stats
    assert stats.graph_replays > 0 and stats.padded_rows > 0  # padding rows really ran
    assert_all_memory_free(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_size_does_not_change_output(baseline: list[list[int]], page_size: int) -> None:
    outs, engine = _run(page_size=page_size)
    assert outs == baseline
    assert_all_memory_free(engine)


@pytest.mark.parametrize("offload", [False, True])
def test_retraction_resume_equals_uninterrupted(baseline: list[list[int]], offload: bool) -> None:
    outs, engine = _run(
        waves=1, max_total_tokens=320, swa_full_tokens_ratio=0.5, enable_host_offload=offload,
        chunked_prefill_size=64,
    )
    assert outs == baseline
    assert engine.scheduler.stats.num_retractions > 0
    assert_all_memory_free(engine)


def test_mha_model_paths_agree() -> None:
    ref, e0 = _run(model="builtin:tiny-mha", enable_prefix_cache=False, graph_batch_sizes=())
    outs, e1 = _run(model="builtin:tiny-mha", chunked_prefill_size=24, max_total_tokens=512,
                    page_size=8)
    assert outs == ref
    assert_all_memory_free(e0)
    assert_all_memory_free(e1)


def test_window_eviction_frees_swa_slots(baseline: list[list[int]]) -> None:
    # Small prefill chunks: a prompt's early SWA slots are freed before its later chunks run.
    outs, engine = _run(enable_prefix_cache=False, chunked_prefill_size=32)
    assert outs == baseline
    stats = engine.scheduler.stats
    window = engine.runner.sliding_window
    assert window is not None and max(len(p) for p in PROMPTS) > 2 * window
    assert stats.num_swa_slots_evicted > 0
    assert stats.peak_swa_used < stats.peak_full_used / 2  # no prefix cache: all is active
    assert_all_memory_free(engine)


def test_padded_static_key_tables_equal_eager(baseline: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The key-table padding a captured CUDA graph uses (full tables rounded up to 64 keys,
    padding masked out) changes nothing: run it eagerly on CPU."""
    from kvcanary.engine import graph_runner

    monkeypatch.setattr(
        graph_runner.GraphRunner, "key_width_for",
        lambda self, lens: min(-(-max(lens) // 64) * 64, self.max_keys),
    )  # fmt: skip
    outs, engine = _run(enable_prefix_cache=False, graph_batch_sizes=(2, 8))
    assert outs == baseline
    gr = engine.scheduler.graph_runner
    assert gr is not None and gr.num_replays > 0
    assert_all_memory_free(engine)
