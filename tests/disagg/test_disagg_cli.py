"""The command-line hooks: ``kvcanary run --disagg`` and ``kvcanary bench prealloc``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from disagg_testlib import tiny_config

from kvcanary.disagg.cli_hooks import (
    add_bench_prealloc_flags,
    add_disagg_run_flags,
    cmd_bench_prealloc,
    run_disagg,
)
from kvcanary.disagg.config import DisaggConfig


def _run_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_disagg_run_flags(p)
    for flag, default in (("--num-requests", 4), ("--input-len", 64), ("--output-len", 6),
                          ("--shared-prefix-len", 16), ("--seed", 0)):  # fmt: skip
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--no-progress", action="store_true", default=True)
    return p.parse_args(["--disagg", *argv])


@pytest.mark.parametrize("backend", ["inproc", "torch"])
def test_run_disagg_summary(backend) -> None:
    args = _run_args("--disagg-transfer-backend", backend, "--decode-max-total-tokens", "2048")
    summary = run_disagg(args, tiny_config())
    assert summary["requests"] == 4 and summary["failed_requests"] == 0
    assert summary["output_tokens"] == 4 * 6 and summary["transfers"] == 4
    assert summary["swa_tail_prealloc"] is True
    assert summary["prefill_canary_violations"] == summary["decode_canary_violations"] == 0
    assert summary["decode_canary_protected_tokens"] > 0
    for side in ("prefill", "decode"):
        assert summary[f"{side}_integrity_ok"] and summary[f"{side}_memory_free"]
    assert summary["speculative_method"] == "none" and summary["decode_spec_draft_tokens"] == 0


def test_run_disagg_speculates_on_the_decode_side_only() -> None:
    from kvcanary.config import SpeculativeConfig

    spec = SpeculativeConfig(method="draft", num_speculative_tokens=2, draft_model="builtin:tiny-mha")
    config = dataclasses.replace(tiny_config(), speculative=spec)
    summary = run_disagg(_run_args("--disagg-transfer-backend", "inproc"), config)
    assert summary["failed_requests"] == 0 and summary["output_tokens"] == 4 * 6
    assert summary["speculative_method"] == "draft" and summary["decode_spec_draft_tokens"] > 0
    assert summary["decode_draft_canary_protected_tokens"] > 0
    assert summary["decode_draft_canary_violations"] == summary["decode_canary_violations"] == 0


def test_bench_prealloc_figures() -> None:
    p = argparse.ArgumentParser()
    add_bench_prealloc_flags(p)
    args = p.parse_args(["--input-len", "160", "--output-len", "4", "--num-requests", "6",
                         "--swa-pool-tokens", "384"])  # fmt: skip
    out = cmd_bench_prealloc(args)
    assert out["tail_admitted_at_once"] > out["no_tail_admitted_at_once"] >= 1
    assert out["tail_swa_tokens_charged_per_request"] < out["no_tail_swa_tokens_charged_per_request"]
    assert out["admitted_ratio"] >= 0.8 * out["l_over_w_plus_p"] and out["target_met"]
    assert out["tail_memory_free"] and out["no_tail_memory_free"]
    assert out["tail_mean_decode_batch"] >= out["no_tail_mean_decode_batch"]


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("transfer_backend", "rdma", "--disagg-transfer-backend"),
     ("transfer_timeout_s", 0, "--disagg-transfer-timeout"),
     ("num_reserved_decode_tokens", -1, "--num-reserved-decode-tokens")],
)  # fmt: skip
def test_bad_values_name_the_flag(field, value, flag) -> None:
    with pytest.raises(ValueError, match=flag):
        DisaggConfig(**{field: value})


def test_bench_rejects_prompts_inside_the_window() -> None:
    p = argparse.ArgumentParser()
    add_bench_prealloc_flags(p)
    with pytest.raises(ValueError, match="--input-len"):
        cmd_bench_prealloc(p.parse_args(["--input-len", "16"]))
