"""``kvcanary bench vllm`` end to end on a tiny random Llama: plain vLLM, vLLM with the
canary connector and vLLM with a connector that does nothing (the connector control), each
in its own process; greedy outputs agree and each figure is the ratio it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcanary.cli.command import main


def test_bench_vllm_runs_the_connector_control_beside_the_canary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "vllm", "--rounds", "1", "--num-prompts", "2", "--input-len", "16",
               "--output-len", "16", "--no-control", "--json", str(out)])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["outputs_identical"] and r["connector_outputs_identical"]
    assert "noise_floor" not in r and "control_outputs_identical" not in r
    stats = r["canary_stats"]
    assert stats["verify_entries"] > 0 and stats["violations"] == 0
    assert stats["kv_connector"] == "KVCanaryConnector"
    assert r["connector_stats"]["kv_connector"] == "NoopConnector"
    for key in ("prefill_tok_s", "decode_tok_s"):
        c = r["connector_control"][key]
        assert c["plain"] == r[key]["plain"]
        assert _is_ratio_pct(c["interface_pct"], c["plain"], c["connector"])
        assert _is_ratio_pct(c["canary_beyond_interface_pct"], c["connector"], r[key]["canary"])
    # One round: each paired figure is the ratio of that round's passes, which the best
    # passes' tok/s are too (their overheads rounded from the same times).
    paired = r["paired"]
    assert paired["rounds"] == 1
    for kind, key in (("prefill_pct", "prefill_tok_s"), ("decode_pct", "decode_tok_s")):
        assert abs(paired[kind]["canary_vs_plain"] - r[key]["overhead_pct"]) <= 0.1
        c = r["connector_control"][key]
        assert abs(paired[kind]["connector_vs_plain"] - c["interface_pct"]) <= 0.1
        assert abs(paired[kind]["canary_vs_connector"] - c["canary_beyond_interface_pct"]) <= 0.1
    step = r["per_step"]
    for kind in ("decode_step", "prefill"):
        assert abs(step[f"paired_canary_vs_plain_{kind}_pct"] - step[f"canary_vs_plain_{kind}_pct"]) <= 0.1
    table = capsys.readouterr().out
    assert "paired_decode_canary_vs_plain_pct" in table and "canary_vs_plain_decode_step_pct" in table


def _is_ratio_pct(pct: float, num: float, den: float) -> bool:
    """``pct`` (rounded to 0.1) is ``100 * (num / den - 1)`` of the unrounded tok/s that
    ``num`` and ``den`` are rounded from (to 0.1): within the range those roundings allow
    (a few tok/s, as this tiny workload's decode, make that range wider than 0.1)."""
    corners = [100 * ((num + a) / (den + b) - 1) for a in (-0.05, 0.05) for b in (-0.05, 0.05)]
    return min(corners) - 0.051 <= pct <= max(corners) + 0.051
