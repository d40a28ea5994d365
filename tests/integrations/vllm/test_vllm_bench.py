"""``kvcanary bench vllm`` end to end on a tiny random Llama: plain vLLM, vLLM with the
canary connector and vLLM with a connector that does nothing (the connector control), each
in its own process; greedy outputs agree and each figure is the ratio it names."""

from __future__ import annotations

import argparse

from kvcanary.integrations.vllm.bench import add_bench_vllm_flags, bench_vllm


def test_bench_vllm_runs_the_connector_control_beside_the_canary() -> None:
    ap = argparse.ArgumentParser()
    add_bench_vllm_flags(ap)
    a = ap.parse_args(["--rounds", "1", "--num-prompts", "2", "--input-len", "16",
                       "--output-len", "4", "--no-control"])  # fmt: skip
    r = bench_vllm(a)
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


def _is_ratio_pct(pct: float, num: float, den: float) -> bool:
    """``pct`` (rounded to 0.1) is ``100 * (num / den - 1)`` of the unrounded tok/s that
    ``num`` and ``den`` are rounded from (to 0.1): within the range those roundings allow
    (a few tok/s, as this tiny workload's decode, make that range wider than 0.1)."""
    corners = [100 * ((num + a) / (den + b) - 1) for a in (-0.05, 0.05) for b in (-0.05, 0.05)]
    return min(corners) - 0.051 <= pct <= max(corners) + 0.051
