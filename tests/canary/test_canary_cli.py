"""The canary on the command line: `kvcanary run` flags and summary keys, bad canary flags,
and `kvcanary bench overhead` on a tiny workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvcanary.cli.command import main

SMALL = ["--num-requests", "4", "--input-len", "60", "--shared-prefix-len", "24",
         "--output-len", "8", "--max-total-tokens", "1024", "--no-progress"]  # fmt: skip
CANARY_KEYS = (
    "kv_canary_real_data", "canary_protected_tokens", "canary_verify_entries",
    "canary_write_entries", "canary_violations", "canary_violations_by_tag",
    "canary_violations_by_reason", "canary_verify_overflow_steps", "canary_aborted_requests",
    "canary_sweep_passes", "canary_launch_tags_active", "canary_swa_divergence",
)  # fmt: skip


def test_run_with_canary_reports_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    assert main(["run", "--model", "builtin:tiny-swa", *SMALL, "--kv-canary", "raise",
                 "--kv-canary-real-data", "partial", "--kv-canary-v-half",
                 "--kv-canary-verify-tokens", "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert (data["kv_canary"], data["kv_canary_real_data"]) == ("raise", "partial")
    assert data["canary_violations"] == 0 and data["canary_violations_by_tag"] == {}
    assert data["canary_verify_entries"] > 0 and data["canary_write_entries"] > 0
    assert data["canary_protected_tokens"] == (
        data["canary_verify_entries"] + data["canary_write_entries"]
    )


def test_run_with_sweep_stats_and_divergence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    assert main(["run", "--model", "builtin:tiny-swa", *SMALL, "--output-len", "40",
                 "--kv-canary", "log", "--kv-canary-sweep-interval", "3",
                 "--kv-canary-stats-interval", "10", "--kv-canary-health-check-interval", "5",
                 "--kv-canary-swa-divergence-interval", "4", "--log-level", "info",
                 "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["canary_violations"] == 0 and data["canary_sweep_passes"] > 0
    assert data["canary_launch_tags_active"] == "6/12"  # HEAD, TAIL, SWEEP x K x FULL, SWA
    assert data["canary_swa_divergence"]["samples"] > 0
    assert data["canary_swa_divergence"]["swa_out_of_window_tokens"] > 0  # 60 + 40 tokens > 32
    err = capsys.readouterr().err
    assert "[canary] step=10 protected_tokens=" in err and "kv_canary_swa_divergence={" in err
    assert "[canary] sweep succeeded 1 times (last_step=0)" in err


def test_run_without_canary_has_zero_figures(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    assert main(["run", "--model", "builtin:tiny-mha", *SMALL, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert all(k in data for k in CANARY_KEYS)
    assert data["canary_protected_tokens"] == 0 and data["canary_violations_by_reason"] == {}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-canary", "log", "--kv-canary-ring-capacity", "0"], "--kv-canary-ring-capacity"),
        (["--kv-canary-real-data", "partial"], 'while --kv-canary is "none"'),
        (["--kv-canary", "log", "--kv-canary-verify-capacity", "-3"], "-3"),
        (["--kv-canary-sweep-interval", "4"], "--kv-canary-sweep-interval (kv_canary_sweep_interval)=4"),
        (["--kv-canary", "log", "--kv-canary-stats-interval", "-1"], "allowed an integer >= 0 (0 = off)"),
        (["--kv-canary", "log", "--kv-canary-swa-divergence-interval", "-2"],
         "--kv-canary-swa-divergence-interval"),
    ],
)
def test_bad_canary_flags_fail_cleanly(args: list[str], needle: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "run.json"
    assert main(["run", *args, *SMALL, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err
    assert not out.exists()


@pytest.fixture
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("keep_torch_threads")
def test_bench_overhead_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "overhead", "--model", "builtin:tiny-mha", "--repeats", "1",
                 "--variants", "none,log+partial", "--batches", "2", "--input-len", "24",
                 "--shared-prefix-len", "8", "--output-len", "4", "--prefill-len", "32",
                 "--max-total-tokens", "512", "--threads", "1", "--no-progress",
                 "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["repeats"] == 1 and data["torch_threads"] == 1 and data["batches"] == [2]
    rows = {(r["phase"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {(p, v) for p in ("decode", "prefill") for v in ("none", "log+partial")}
    assert rows["decode", "none"]["overhead_pct"] == 0.0
    assert all(r["identical_outputs"] and r["violations"] == 0 for r in rows.values())
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    # the canary touches bytes only when it is on, and fewer than attention reads here
    assert rows["decode", "none"]["canary_bytes_per_forward"] == 0
    assert 0 < rows["decode", "log+partial"]["canary_bytes_per_forward"] < rows[
        "decode", "log+partial"]["kv_read_bytes_per_forward"]  # fmt: skip
    assert "overhead %" in capsys.readouterr().out


def test_bench_overhead_rejects_unknown_variants(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overhead", "--variants", "log,fast", "--no-progress"]) == 2
    assert '--variants="log,fast" is invalid' in capsys.readouterr().err


def test_canary_flags_come_from_the_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """One --kv-canary* flag per CanaryConfig field that is a flag; parsed back, the defaults
    are CanaryConfig()'s and every given value lands in its field."""
    import argparse
    import dataclasses

    from kvcanary.canary.config import CanaryConfig
    from kvcanary.engine.args import add_dataclass_flags, dataclass_from_args

    monkeypatch.setenv("KVCANARY_KV_CANARY_RING_CAPACITY", "77")
    p = argparse.ArgumentParser()
    add_dataclass_flags(p, CanaryConfig)
    flags = {f.metadata["flag"] for f in dataclasses.fields(CanaryConfig)} - {None}
    assert {a.option_strings[0] for a in p._actions[1:]} == flags
    assert dataclass_from_args(CanaryConfig, p.parse_args([])) == CanaryConfig()
    assert CanaryConfig().ring_capacity == 77
    a = p.parse_args(["--kv-canary", "abort", "--kv-canary-real-data", "all", "--kv-canary-v-half",
                      "--kv-canary-sweep-interval", "3", "--kv-canary-ring-capacity", "9"])  # fmt: skip
    assert dataclass_from_args(CanaryConfig, a) == CanaryConfig(
        mode="abort", real_data="all", v_half=True, sweep_interval=3, ring_capacity=9
    )

    @dataclasses.dataclass
    class Undecided:
        x: int = 0  # no "flag" in its metadata: neither a flag nor marked as none

    with pytest.raises(TypeError, match="Undecided.x"):
        add_dataclass_flags(argparse.ArgumentParser(), Undecided)
