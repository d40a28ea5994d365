"""Prometheus metrics: the exposition names violations by tag and reason, protected tokens,
verify entries by tag, SWA divergence and sweep passes, from a real canary run."""

from __future__ import annotations

from pathlib import Path

from engine_utils import make_prompts, tiny_engine
from prometheus_client.parser import text_string_to_metric_families

from kvcanary import SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.report.metrics import write_metrics_file
from kvcanary.cli.command import main


def _samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_a_detected_remap(tmp_path: Path) -> None:
    # No prefix cache: the prompts' SWA slots are freed as the window slides.
    engine = tiny_engine(canary=CanaryConfig(mode="log", swa_divergence_interval=2),
                         enable_prefix_cache=False)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for p in make_prompts(3, 50, 60, seed=9):
        engine.add_request(p, params)
    for _ in range(30):
        engine.step()
    sched = engine.scheduler
    a, b = sched.running[0], sched.running[1]
    # Remap one of a's in-window positions to one of b's live slots for one step: a HEAD
    # chain-hash violation.
    pos = a.kv_len - 3
    saved = sched.kv.req_to_token[a.req_pool_idx, pos].clone()
    sched.kv.req_to_token[a.req_pool_idx, pos] = sched.kv.req_to_token[b.req_pool_idx, b.kv_len - 3]
    engine.step()
    sched.kv.req_to_token[a.req_pool_idx, pos] = saved
    engine.step()
    out = tmp_path / "metrics.prom"
    write_metrics_file(engine.canary, out)
    m = _samples(out)
    assert m[("kvcanary_canary_enabled", ())] == 1
    assert m[("kvcanary_violations_total", (("fail_reason", "verify_chain_hash"), ("launch_tag", "HEAD_K_FULL")))] >= 1
    assert m[("kvcanary_protected_tokens_total", ())] == engine.canary.stats()["protected_tokens"]
    assert m[("kvcanary_verify_entries_total", (("launch_tag", "HEAD_K_FULL"),))] > 0
    assert m[("kvcanary_swa_divergence", (("signal", "swa_out_of_window_tokens"),))] >= 1
    assert ("kvcanary_sweep_passes_total", ()) in m
    # constant labels (the vLLM connector's rank): on every sample, the values unchanged
    labelled = tmp_path / "rank1.prom"
    write_metrics_file(engine.canary, labelled, {"rank": "1"})
    assert _samples(labelled) == {(name, tuple(sorted((*labels, ("rank", "1"))))): v
                                  for (name, labels), v in m.items()}  # fmt: skip


def test_run_writes_metrics_file_and_rejects_a_missing_directory(tmp_path: Path) -> None:
    out = tmp_path / "m.prom"
    args = ["run", "--kv-canary", "log", "--num-requests", "2", "--input-len", "40",
            "--shared-prefix-len", "0", "--output-len", "4", "--no-progress"]
    assert main([*args, "--metrics-file", str(out)]) == 0
    m = _samples(out)
    assert m[("kvcanary_canary_enabled", ())] == 1
    assert m[("kvcanary_protected_tokens_total", ())] > 0
    assert not any(k[0] == "kvcanary_violations_total" for k in m)  # clean run: no series
    assert main([*args, "--metrics-file", str(tmp_path / "nope" / "m.prom")]) == 2
