"""`kvcanary explain` (violation lines -> likely causes) on SGLang's published lines, both
label generations and our own engine's logs; `kvcanary selftest` on the command line."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from kvcanary.canary.explain import explain, parse_log
from kvcanary.canary.perturb import ExpectedDetection
from kvcanary.canary.wire.constants import CanaryLaunchTag, FailReason
from kvcanary.canary.wire.violation import ViolationRecord, format_violation_message
from kvcanary.cli.command import main
from kvcanary.cli.selftest import FaultCase, run_case

# Verbatim from reference/kv_canary_core.md §8.2 (SGLang issues #33656 and #28971).
ISSUE_33656 = (
    "[2026-08-05 10:02:11 TP0] kv_canary violation: launch_tag=TAIL_K_SWA fail_reason=write_position "
    "slot_idx=53504 position=512 stored_token=1299 expected_token=1299 "
    "stored_chain_hash=0xe11e13af98c23f7f expected_aux=0x0000000000002100"
)
ISSUE_28971 = (
    "RuntimeError: kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash "
    "slot_idx=61390 position=6092 stored_token=2005 expected_token=-1 "
    "stored_chain_hash=0x551075b2a7b94875 expected_aux=0x551075b2a7b94875 total_violations=256"
)
# Older SGLang labels (chain_hash, position, real_kv_hash), same frozen line.
LEGACY = [
    "kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=chain_hash slot_idx=901 position=40 "
    "stored_token=17 expected_token=0 stored_chain_hash=0x1111111111111111 expected_aux=0x2222222222222222",
    "kv_canary violation: launch_tag=SWEEP_K_FULL fail_reason=real_kv_hash slot_idx=77 position=3 "
    "stored_token=9 expected_token=0 stored_chain_hash=0x0abc expected_aux=0x0abc",
    "kv_canary violation: launch_tag=HEAD_K_SWA fail_reason=chain_hash+position slot_idx=12 "
    "position=88 stored_token=4 expected_token=0 stored_chain_hash=0x33 expected_aux=0x44",
]  # fmt: skip


def _ours(tag: CanaryLaunchTag, reason: FailReason, slot: int, position: int, stored_token: int,
          expected_token: int, chain: int, aux: int) -> str:  # fmt: skip
    record = ViolationRecord(int(tag), slot, position, stored_token, expected_token, chain, aux, int(reason))
    return format_violation_message(record, total_violations=1, ring_overflow=False, step_when_pumped=9)


def _synthetic_log() -> str:
    lines = ["INFO starting server", ISSUE_33656, ISSUE_28971, *LEGACY]
    # Our own multi-line reports: two requests' next tokens swapped (mirrored write_token rows)
    lines.append(_ours(CanaryLaunchTag.HEAD_K_FULL, FailReason.WRITE_TOKEN_MISMATCH, 40, 30, 7, 9, 5, 30))
    lines.append(_ours(CanaryLaunchTag.HEAD_K_FULL, FailReason.WRITE_TOKEN_MISMATCH, 41, 31, 9, 7, 6, 31))
    # ... and a flood of never-written predecessors on the SWA sweep
    for i in range(12):
        lines.append(_ours(CanaryLaunchTag.SWEEP_K_SWA, FailReason.VERIFY_CHAIN_HASH_MISMATCH,
                           100 + i, 50 + i, 3, -1, 0x5555, 0))  # fmt: skip
    lines.append("kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=bogus slot_idx=1")
    return "\n".join(lines) + "\n"


def test_explain_names_the_causes_of_both_label_generations_and_sglangs_lines() -> None:
    report = explain(_synthetic_log())
    assert report["violations"] == 19 and len(report["unparsed"]) == 1
    assert report["label_generations"] == {"new": 16, "legacy": 3}
    causes = {c["cause"]: c for c in report["causes"]}
    assert {k: c["count"] for k, c in causes.items()} == {
        "never_written_predecessor": 12, "wrong_input_token": 2, "stale_seed": 1,
        "kv_byte_corruption": 1, "req_to_token_remap": 1, "cached_kv_byte_corruption": 1,
        "wrong_slot": 1,
    }  # fmt: skip
    # #33656: expected_aux 0x2100 = 8448 = seed position + 1 -> the seed held position 8447.
    stale = causes["stale_seed"]
    assert stale["launch_tags"] == {"TAIL_K_SWA": 1}
    assert "seed slot held position 8447, not 511" in stale["evidence"][0]
    assert "stale full->SWA mapping" in stale["explanation"]
    # #28971: the chain is intact, only the real-KV fingerprint differs.
    assert causes["kv_byte_corruption"]["launch_tags"] == {"TAIL_K_FULL": 1}
    assert "stored chain == expected (0x551075b2a7b94875)" in causes["kv_byte_corruption"]["evidence"][0]
    assert causes["req_to_token_remap"]["launch_tags"] == {"HEAD_K_FULL": 1}  # legacy chain_hash
    assert causes["cached_kv_byte_corruption"]["launch_tags"] == {"SWEEP_K_FULL": 1}
    assert causes["never_written_predecessor"]["launch_tags"] == {"SWEEP_K_SWA": 12}
    hints = " ".join(report["hints"])
    assert "expected_aux=0 flood (12 rows)" in hints and "1 pair(s) of write_token rows" in hints
    groups = {(g["launch_tag"], g["fail_reason"]): g["count"] for g in report["groups"]}
    assert groups[("SWEEP_K_SWA", "verify_chain_hash")] == 12
    assert groups[("HEAD_K_SWA", "verify_chain_hash+verify_position")] == 1  # legacy, normalised
    assert report["top_slots"][0]["count"] == 1


def test_parse_log_keeps_line_numbers_and_ignores_the_report_body() -> None:
    rows, unparsed = parse_log(_synthetic_log())
    assert rows[0].line_no == 2 and rows[0].line.startswith("kv_canary violation: launch_tag=TAIL_K_SWA")
    assert unparsed[0]["line_no"] == len(_synthetic_log().splitlines())
    assert not any("KV cache canary violation detected" in r.line for r in rows)


@pytest.mark.parametrize(
    ("model", "mode", "group", "causes", "hint"),
    [
        ("builtin:tiny-mha", "req_to_token", None, {"req_to_token_remap", "wrong_slot"}, None),
        ("builtin:tiny-mha", "real_kv_used", "full", {"kv_byte_corruption"}, None),
        ("builtin:tiny-mha", "real_kv_unused_cache", "full", {"cached_kv_byte_corruption"}, "only the radix sweep"),
        ("builtin:tiny-mha", "next_token_swap", None, {"wrong_input_token"}, "mirrored tokens"),
        ("builtin:tiny-swa", "swa_mapping", None, {"req_to_token_remap", "wrong_slot"}, "only on SWA tags"),
        # The shifted page table also points in-window positions at slots whose SWA was
        # evicted: verify_not_resident (premature_window_eviction) since the residency check.
        ("builtin:tiny-swa", "page_shift", None, {"position_shift", "unwritten_slot", "wrong_slot", "stale_seed", "premature_window_eviction"}, None),
    ],
)  # fmt: skip
def test_explain_on_our_engines_logs(caplog: pytest.LogCaptureFixture, model: str, mode: str,
                                     group: str | None, causes: set[str], hint: str | None) -> None:  # fmt: skip
    with caplog.at_level(logging.WARNING, "kvcanary.canary"):
        row, _ = run_case(model, FaultCase(mode, model, group))
    assert row["detected"]
    report = explain(caplog.text)
    assert report["violations"] == row["violations"]
    assert {c["cause"] for c in report["causes"]} == causes
    assert hint is None or any(hint in h for h in report["hints"])


# ------------------------------------------------------------------ command line


def test_explain_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    log = tmp_path / "server.log"
    log.write_text(_synthetic_log())
    out = tmp_path / "explain.json"
    assert main(["explain", str(log), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "likely cause" in text and "stale_seed" in text and "never_written_predecessor" in text
    data = json.loads(out.read_text())
    assert data["log"] == str(log) and data["violations"] == 19
    assert set(data) >= {"lines", "unparsed", "label_generations", "by_tag", "by_reason", "groups",
                         "top_slots", "causes", "hints"}  # fmt: skip
    monkeypatch.setattr("sys.stdin", io.StringIO(ISSUE_28971 + "\n"))
    assert main(["explain", "-"]) == 0
    assert "kv_byte_corruption" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("all quiet\n"))
    assert main(["explain", "-"]) == 0
    assert "no kv_canary violation lines found" in capsys.readouterr().out
    assert main(["explain", str(tmp_path / "missing.log")]) == 2
    assert "LOGFILE=" in capsys.readouterr().err


def test_selftest_cli_reduced_campaign_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "selftest.json"
    assert main(["selftest", "--models", "builtin:tiny-swa", "--faults", "real_kv_used,swa_mapping",
                 "--num-seeds", "1", "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["ok"] and data["missed"] == [] and data["false_positives"] == 0
    assert [r["fault"] for r in data["matrix"]] == ["real_kv_used[full]", "real_kv_used[swa]", "swa_mapping"]
    assert set(data["fault_runs"][0]) >= {
        "fault", "mode", "model", "seed", "target_group", "injected", "injection_step", "injection",
        "detected", "detection_step", "steps_to_detection", "expected_tags", "expected_reasons",
        "detected_tag", "detected_reasons", "tags_seen", "reasons_seen", "violations", "error", "ok",
    }  # fmt: skip
    assert "PASS: 3/3 fault classes detected" in capsys.readouterr().out


def test_selftest_cli_fails_on_a_missed_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr("kvcanary.cli.selftest.expected_detection",
                        lambda mode, group=None: ExpectedDetection(("NO_SUCH_TAG",), ("write_token",)))  # fmt: skip
    assert main(["selftest", "--models", "builtin:tiny-mha", "--faults", "page_shift",
                 "--num-seeds", "1", "--no-progress"]) == 1  # fmt: skip
    assert "FAIL: 0/1" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "needle"), [
    (["--faults", "page_shift,bogus"], '--faults="page_shift,bogus" is invalid'),
    (["--num-seeds", "0"], "--num-seeds=0 is invalid"),
    (["--models", "builtin:tiny-mha", "--faults", "rejected_kv_kept"],
     "apply to none of these models (they need the speculative workload: spec:builtin:tiny-mha)"),
    (["--models", "spec:builtin:tiny-dsv4"], "speculative decoding refuses DeepSeek-V4 models"),
])  # fmt: skip
def test_selftest_cli_rejects_bad_flags(args: list[str], needle: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert main(["selftest", *args, "--no-progress"]) == 2
    assert needle in capsys.readouterr().err
