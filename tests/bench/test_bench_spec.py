"""`kvcanary bench spec` on tiny settings: what it reports (no timing is asserted) and
one-line errors for bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvcanary.cli.command import main


@pytest.fixture(autouse=True)
def keep_torch_threads():  # --threads sets them for the process
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_spec_reports_each_workload_and_variant(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--draft-models", "builtin:tiny-swa", "--batch", "2",
                 "--input-len", "24", "--output-len", "10", "--repeats", "2", "--no-progress",
                 "--json", str(out)]) == 0  # fmt: skip
    summary = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "per workload x variant" in printed and "canary_overhead_pct" in printed
    rows = {(r["workload"], r["variant"]): r for r in summary["rows"]}
    variants = ["plain", "ngram", "ngram+canary", "draft:builtin:tiny-swa",
                "draft:builtin:tiny-swa+canary"]  # fmt: skip
    assert set(rows) == {(w, v) for w in ("repetitive", "random") for v in variants}
    assert summary["outputs_identical"] and summary["integrity_ok"]
    assert summary["violations"] == {"ngram+canary": 0, "draft:builtin:tiny-swa+canary": 0}
    for w in ("repetitive", "random"):
        plain = rows[(w, "plain")]
        assert plain["acceptance"] is None and plain["forward_reduction"] == 1
        assert plain["canary_overhead_pct"] is None
        # 2 requests x 10 tokens: 9 decode steps after the prefill's token, each repeat
        assert plain["decode_forwards"] == 2 * 9
        same = rows[(w, "draft:builtin:tiny-swa")]  # the draft is the target: all accepted
        # (K = 4; fewer drafts where max_new_tokens leaves less room)
        assert same["acceptance"] == 1.0 and 2 < same["accepted_per_verify"] <= 4
        assert same["forward_reduction"] > 1.5
        ngram = rows[(w, "ngram")]["acceptance"]  # (None: no suffix recurred, no drafts)
        assert ngram is None or 0 <= ngram <= 1
        for v in ("ngram+canary", "draft:builtin:tiny-swa+canary"):
            assert isinstance(rows[(w, v)]["canary_overhead_pct"], float)
            # the canary changes no scheduling: the same drafts, the same forwards
            base = rows[(w, v.removesuffix("+canary"))]
            assert rows[(w, v)]["decode_forwards"] == base["decode_forwards"]
            assert rows[(w, v)]["acceptance"] == base["acceptance"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--workloads", "chat"], '--workloads="chat" is invalid: allowed a comma-separated subset of'),
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens=0 is invalid: allowed an integer >= 1"),
    (["--draft-models", "builtin:qwen3-0.6b-shape"],
     "--speculative-draft-model (speculative.draft_model)"),
])  # fmt: skip
def test_bench_spec_bad_flags_are_one_line(argv: list[str], expected: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert main(["bench", "spec", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0]
