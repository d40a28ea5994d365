"""The canary's counters on vLLM's KV connector stats path (integrations/vllm/stats.py),
the parts test_vllm_server.py's one-worker server does not reach: the sum over
tensor-parallel workers and over steps, as vLLM forms them (``KVOutputAggregator`` and
the stats logger call ``aggregate``; the API server gets ``to_dict()`` and reconstructs
with ``build_kv_connector_stats``), and what ``observe`` adds to the counters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcanary.integrations.vllm.connector import KVCanaryConnector


def _stats(steps: int, tokens: int, verify: dict[str, int],
           violations: dict[str, dict[str, int]]) -> Any:  # fmt: skip
    return KVCanaryConnector.build_kv_connector_stats({
        "steps": steps, "protected_tokens": tokens, "verify_entries": verify,
        "violations_recorded": sum(n for r in violations.values() for n in r.values()),
        "violations": violations,
    })  # fmt: skip


def test_worker_reports_sum_and_reach_the_counters() -> None:
    rank0 = _stats(4, 100, {"HEAD_K_FULL": 40, "TAIL_K_FULL": 40},
                   {"TAIL_K_FULL": {"verify_real_kv_hash": 2}})  # fmt: skip
    rank1 = _stats(4, 90, {"TAIL_K_FULL": 30},
                   {"TAIL_K_FULL": {"verify_real_kv_hash": 1, "verify_token": 1},
                    "HEAD_K_FULL": {"verify_chain_hash": 3}})  # fmt: skip
    summed = rank0.aggregate(rank1)
    assert summed.data == {
        "steps": 8, "protected_tokens": 190, "violations_recorded": 7,
        "verify_entries": {"HEAD_K_FULL": 40, "TAIL_K_FULL": 70},
        "violations": {"TAIL_K_FULL": {"verify_real_kv_hash": 3, "verify_token": 1},
                       "HEAD_K_FULL": {"verify_chain_hash": 3}},
    }  # fmt: skip
    assert summed.reduce() == {"kv_canary_steps": 8, "protected_tokens": 190, "violations": 7}
    assert not summed.is_empty() and KVCanaryConnector.build_kv_connector_stats().is_empty()

    registry = CollectorRegistry()

    class RegCounter(Counter):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, registry=registry, **kwargs)

    labels = {0: ["m", "0"], 1: ["m", "1"]}
    prom = KVCanaryConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), {Counter: RegCounter, Gauge: Gauge, Histogram: Histogram}, ["model_name", "engine"],
        labels,
    )  # fmt: skip
    prom.observe(summed.to_dict(), engine_idx=1)
    prom.observe(_stats(2, 10, {}, {}).to_dict(), engine_idx=1)  # adds to the first
    value = registry.get_sample_value
    assert value("vllm:kvcanary_steps_total", {"model_name": "m", "engine": "1"}) == 10
    assert value("vllm:kvcanary_steps_total", {"model_name": "m", "engine": "0"}) == 0
    assert value("vllm:kvcanary_protected_tokens_total", {"model_name": "m", "engine": "1"}) == 200
    assert value("vllm:kvcanary_verify_entries_total",
                 {"model_name": "m", "engine": "1", "launch_tag": "TAIL_K_FULL"}) == 70  # fmt: skip
    assert value("vllm:kvcanary_violations_total",
                 {"model_name": "m", "engine": "1", "launch_tag": "TAIL_K_FULL",
                  "fail_reason": "verify_real_kv_hash"}) == 3  # fmt: skip
    assert value("vllm:kvcanary_violations_recorded_total", {"model_name": "m", "engine": "1"}) == 7


def test_summary_is_rewritten_when_violation_rows_double() -> None:
    """The summary file's write policy under a fault read every step (one more row each
    step, ``stats_interval`` far away): the first row at once, then each time the rows
    reach twice those written, so the whole file is rewritten O(log n) times, not n."""
    reported = [0]
    fake = SimpleNamespace(
        worker=SimpleNamespace(num_steps=0),
        options=SimpleNamespace(canary=SimpleNamespace(stats_interval=1000)),
        _num_written=0, _num_reported=lambda: reported[0],
    )  # fmt: skip
    writes = []
    for step in range(1, 200):
        fake.worker.num_steps = step
        assert KVCanaryConnector._summary_due(fake) is False  # nothing new since the last
        reported[0] += 1
        if KVCanaryConnector._summary_due(fake):
            fake._num_written = reported[0]  # (what write_summary records)
            writes.append(step)
    assert writes == [1, 2, 4, 8, 16, 32, 64, 128]
