"""``kvcanary bench serve`` end to end: a clean run reports latencies and no errors, leaks or
violations (exit 0); a deadline that cuts streams counts errors (exit 1) and the cut
requests still give all their memory back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcanary.cli.command import main

SMALL = ["--num-requests", "12", "--concurrency", "6", "--input-len", "48", "--shared-prefix-len", "16",
         "--max-total-tokens", "4096", "--no-progress"]  # fmt: skip


def test_bench_serve_clean_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", *SMALL, "--output-len", "12", "--kv-canary", "log",
                 "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["completed"] == data["requests"] == 12 and data["errors"] == 0
    assert data["output_tokens"] == 12 * 12
    assert 0 < data["ttft_p50_ms"] <= data["ttft_p99_ms"]
    assert 0 < data["itl_p50_ms"] <= data["itl_p99_ms"]
    assert data["output_tokens_per_s"] > 0
    assert data["integrity_check"] == "pass"
    assert data["leaked_full_slots"] == data["leaked_swa_slots"] == data["leaked_req_rows"] == 0
    assert data["canary_protected_tokens"] > 0 and data["canary_violations"] == 0
    printed = capsys.readouterr().out
    assert "ttft_p99_ms" in printed and "leaked_full_slots" in printed


def test_bench_serve_deadline_cuts_streams_and_frees_their_kv(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", *SMALL, "--output-len", "180", "--deadline", "0.3",
                 "--json", str(out)]) == 1  # fmt: skip
    data = json.loads(out.read_text())
    assert data["errors"] > 0 and data["completed"] < 12
    assert data["first_error"]
    assert data["unfinished_after_load"] == 0  # the cut streams were aborted in the engine
    assert data["leaked_full_slots"] == data["leaked_swa_slots"] == data["leaked_req_rows"] == 0


def test_bench_serve_bad_flags_fail_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--concurrency", "0", "--no-progress"]) == 2
    assert "--concurrency=0 is invalid: allowed an integer >= 1" in capsys.readouterr().err
    assert main(["bench", "serve", "--input-len", "5000", "--shared-prefix-len", "0", "--no-progress"]) == 2
    assert "--input-len=5000 is invalid" in capsys.readouterr().err
