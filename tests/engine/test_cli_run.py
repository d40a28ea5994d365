"""`kvcanary run` end to end through the CLI entry point: summary JSON and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcanary.cli.command import main

SMALL = ["--num-requests", "6", "--input-len", "160", "--shared-prefix-len", "40",
         "--output-len", "48", "--max-total-tokens", "2048", "--no-progress"]


def test_run_writes_summary_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    assert main(["run", "--model", "builtin:tiny-swa", *SMALL, "--chunked-prefill-size", "32",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 6
    assert data["output_tokens"] == 6 * 48
    assert data["swa_slots_evicted"] > 0  # 48 outputs outrun the 32-token window
    assert data["swa_translation_gathers_per_forward"] == 1.0
    assert 0.0 < data["prefix_cache_hit_rate"] < 1.0
    # Requests need far less SWA than full KV (what the cache keeps is evictable on demand).
    assert data["peak_swa_active_tokens"] < data["peak_full_active_tokens"] / 2
    printed = capsys.readouterr().out
    assert "prefix_cache_hit_rate" in printed and "swa_slots_evicted" in printed


def test_run_mha_model_has_no_swa_figures(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    assert main(["run", "--model", "builtin:tiny-mha", *SMALL, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["swa_pool_tokens"] == 0 and data["swa_slots_evicted"] == 0
    assert data["sliding_window"] is None


def test_run_speculative_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A draft equal to the target accepts (nearly) every draft; the summary says so."""
    out = tmp_path / "run.json"
    assert main(["run", "--model", "builtin:tiny-swa", *SMALL, "--speculative-method", "draft",
                 "--speculative-draft-model", "builtin:tiny-swa", "--num-speculative-tokens", "3",
                 "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["output_tokens"] == 6 * 48 and data["speculative_method"] == "draft"
    assert data["spec_draft_tokens"] > 0
    assert data["spec_acceptance_rate"] == data["spec_accepted_tokens"] / data["spec_draft_tokens"]
    assert data["spec_acceptance_rate"] > 0.9
    assert 2.5 < data["spec_mean_accepted_per_step"] <= 3
    assert "spec_acceptance_rate" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-speculative-tokens", "0", "--speculative-method", "ngram"],
         "--num-speculative-tokens (speculative.num_speculative_tokens)=0"),
        (["--speculative-method", "draft", "--speculative-draft-model", "builtin:qwen3-0.6b-shape"],
         "the target's vocab size 259 (it has 151936)"),
        (["--page-size", "0"], "page_size=0"),
        (["--swa-full-tokens-ratio", "2"], "swa_full_tokens_ratio=2.0"),
        (["--shared-prefix-len", "500", "--input-len", "100"], "--shared-prefix-len=500"),
        (["--num-requests", "0"], "--num-requests=0"),
        (["--model", "builtin:nope"], "builtin:nope"),
    ],
)
def test_bad_values_fail_cleanly(args: list[str], needle: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    assert main(["run", *args, "--no-progress", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err
    assert not out.exists()  # nothing half-written
