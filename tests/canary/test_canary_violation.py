"""Wire formats: tag numbers/names, fail-reason bits/labels, the violation line, the ring."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import (
    FAIL_REASON_LABELS,
    LEGACY_FAIL_REASON_LABELS,
    NUM_LAUNCH_TAGS,
    CanaryLaunchTag,
    FailReason,
    KvHalf,
    LaunchStage,
    PoolKind,
    launch_tag,
    split_launch_tag,
)
from kvcanary.canary.wire.hashing import to_i64
from kvcanary.canary.wire.violation import (
    ViolationRecord,
    format_violation_line,
    format_violation_message,
    parse_fail_reason,
    parse_violation_line,
)

# Verbatim from reference/kv_canary_core.md §8.2 (SGLang issues #33656 and #28971).
ISSUE_33656 = (
    "kv_canary violation: launch_tag=TAIL_K_SWA fail_reason=write_position slot_idx=53504 "
    "position=512 stored_token=1299 expected_token=1299 stored_chain_hash=0xe11e13af98c23f7f "
    "expected_aux=0x0000000000002100"
)
ISSUE_28971 = (
    "RuntimeError: kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash "
    "slot_idx=61390 position=6092 stored_token=2005 expected_token=-1 "
    "stored_chain_hash=0x551075b2a7b94875 expected_aux=0x551075b2a7b94875 total_violations=256"
)


def test_sglang_launch_tags_are_wire_exact() -> None:
    sglang = [
        "HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL", "SWEEP_K_FULL", "SWEEP_V_FULL",
        "HEAD_K_SWA", "HEAD_V_SWA", "TAIL_K_SWA", "TAIL_V_SWA", "SWEEP_K_SWA", "SWEEP_V_SWA",
    ]  # fmt: skip
    assert [CanaryLaunchTag(i).name for i in range(12)] == sglang
    for tag in CanaryLaunchTag:
        kind, stage, half = split_launch_tag(tag)
        assert launch_tag(kind, stage, half) == tag
        assert tag.name == f"{stage.name}_{half.name}_{kind.name}"
    assert launch_tag(PoolKind.SWA, LaunchStage.TAIL, KvHalf.K) == CanaryLaunchTag.TAIL_K_SWA
    assert NUM_LAUNCH_TAGS == 48
    with pytest.raises(ValueError):
        split_launch_tag(NUM_LAUNCH_TAGS)


def test_fail_reason_bits_and_labels() -> None:
    # Bits 0..5 are SGLang's; 6 and 7 are kvcanary's own (never set by SGLang).
    assert [int(r) for r in FailReason] == [1, 2, 4, 8, 16, 32, 64, 128]
    for reason in FailReason:
        assert reason.name is not None
        assert FAIL_REASON_LABELS[reason] == reason.name.lower().removesuffix("_mismatch")
    assert LEGACY_FAIL_REASON_LABELS[FailReason.VERIFY_CHAIN_HASH_MISMATCH] == "chain_hash"
    assert LEGACY_FAIL_REASON_LABELS[FailReason.VERIFY_POSITION_MISMATCH] == "position"
    assert LEGACY_FAIL_REASON_LABELS[FailReason.VERIFY_REAL_KV_HASH_MISMATCH] == "real_kv_hash"
    assert FailReason.VERIFY_TOKEN_MISMATCH not in LEGACY_FAIL_REASON_LABELS  # absent in oldest


def test_literal_sglang_lines_parse_and_reformat() -> None:
    r = parse_violation_line(ISSUE_33656)
    assert r == ViolationRecord(
        launch_tag=CanaryLaunchTag.TAIL_K_SWA, slot_idx=53504, position=512, stored_token=1299,
        expected_token=1299, stored_chain_hash=to_i64(0xE11E13AF98C23F7F), expected_aux=8448,
        fail_reason=FailReason.WRITE_POSITION_MISMATCH,
    )  # fmt: skip
    assert format_violation_line(r) == ISSUE_33656
    r2 = parse_violation_line(ISSUE_28971)
    assert r2 is not None and r2.fail_reason == FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    assert r2.expected_token == -1 and r2.stored_chain_hash == r2.expected_aux
    assert ISSUE_28971.removeprefix("RuntimeError: ").startswith(format_violation_line(r2) + " ")


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("none", 0),
        ("verify_chain_hash+verify_position", 3),
        ("chain_hash+position", 3),  # legacy labels
        ("real_kv_hash", 4),
        ("VERIFY_TOKEN", 32),
        ("write_token+write_position", 24),
        ("bit9", 1 << 9),
    ],
)
def test_parse_fail_reason(text: str, bits: int) -> None:
    assert parse_fail_reason(text) == bits


records = st.builds(
    ViolationRecord,
    launch_tag=st.integers(0, 40),
    slot_idx=st.integers(0, 2**40),
    position=st.integers(-1, 2**31),
    stored_token=st.integers(-(2**40), 2**40),
    expected_token=st.integers(-1, 2**31),
    stored_chain_hash=st.integers(-(2**63), 2**63 - 1),
    expected_aux=st.integers(-(2**63), 2**63 - 1),
    fail_reason=st.integers(0, 2**12 - 1),
)


@given(records, st.sampled_from(["", "[2026-06-01 12:00:00 TP0] WARNING ", "RuntimeError: "]))
@settings(max_examples=100, deadline=None)
def test_format_parse_round_trip(record: ViolationRecord, prefix: str) -> None:
    line = format_violation_line(record)
    assert "\n" not in line
    assert parse_violation_line(prefix + line) == record
    assert parse_violation_line(prefix + line + " total_violations=3\nnext line") == record


def test_parse_rejects_and_ignores() -> None:
    assert parse_violation_line("INFO all good") is None
    unknown = parse_violation_line(ISSUE_33656.replace("TAIL_K_SWA", "unknown(99)"))
    assert unknown is not None and unknown.launch_tag == 99
    with pytest.raises(ValueError, match="lacks"):
        parse_violation_line("kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=none")
    with pytest.raises(ValueError, match="launch_tag"):
        parse_violation_line(ISSUE_33656.replace("TAIL_K_SWA", "TAIL_Q_SWA"))
    with pytest.raises(ValueError, match="label"):
        parse_violation_line(ISSUE_33656.replace("write_position", "write_magic"))


def test_unknown_tag_and_none_formatting() -> None:
    r = ViolationRecord(99, 1, 2, 3, 4, -1, 0, 0)
    assert format_violation_line(r) == (
        "kv_canary violation: launch_tag=unknown(99) fail_reason=none slot_idx=1 position=2 "
        "stored_token=3 expected_token=4 stored_chain_hash=0xffffffffffffffff "
        "expected_aux=0x0000000000000000"
    )


def test_violation_messages() -> None:
    write = parse_violation_line(ISSUE_33656)
    assert write is not None
    assert format_violation_message(
        write, total_violations=1, ring_overflow=False, step_when_pumped=7
    ).split("\n")[1:] == [
        "KV cache canary violation detected (kernel_kind=TAIL_K_SWA, slot_idx=53504, position=512)",
        "canary_kind:       per_forward_tail_k_swa",
        "  fail_reasons: write_position",
        "  actual:   token_id=1299   position=512 prev_hash=0xe11e13af98c23f7f",
        "  expected: token_id=1299   position=8448",
        "  total_violations=1 ring_overflow=False step_when_pumped=7",
    ]
    sweep = ViolationRecord(CanaryLaunchTag.SWEEP_V_FULL, 5, 6, 7, 8, 1, 2, 0b100011)
    lines = format_violation_message(
        sweep, total_violations=300, ring_overflow=True, step_when_pumped=9
    ).split("\n")
    assert lines[2:6] == [
        "canary_kind:       sweep_v_full",
        "  fail_reasons: verify_chain_hash verify_position verify_token",
        "  stored:   token_id=7   position=6 prev_hash=0x0000000000000001",
        "  expected: token_id=8 prev_hash=0x0000000000000002",
    ]
    assert lines[-1].endswith("ring_overflow=True step_when_pumped=9")


def test_violation_message_context_follows_the_frozen_line() -> None:
    """A host's fields (the vLLM connector's rank) come after the frozen line's, which
    parsers read as before."""
    write = parse_violation_line(ISSUE_33656)
    assert write is not None
    plain, ranked = (format_violation_message(write, total_violations=1, ring_overflow=False,
                                              step_when_pumped=7, context=context)
                     for context in ("", " rank=1"))  # fmt: skip
    first, rest = ranked.split("\n", 1)
    assert first == format_violation_line(write) + " rank=1"
    assert rest == plain.split("\n", 1)[1]
    assert parse_violation_line(first) == write


def test_ring_is_fill_once_with_monotonic_counter() -> None:
    ring = ViolationRing(3)
    assert ring.rows.shape == (3, 8)
    rows = torch.arange(5 * 8, dtype=torch.int64).reshape(5, 8)
    ring.append_t(rows, torch.tensor([True, False, True, True, True]))
    assert ring.num_recorded() == 4
    assert ring.rows.tolist() == [rows[0].tolist(), rows[2].tolist(), rows[3].tolist()]
    ring.append_t(rows[:1] + 100, torch.tensor([True]))
    assert ring.num_recorded() == 5
    assert ring.rows.tolist() == [rows[0].tolist(), rows[2].tolist(), rows[3].tolist()]
    assert ring.read(1) == [ViolationRecord(*rows[2].tolist()), ViolationRecord(*rows[3].tolist())]
    ring.clear()
    assert ring.num_recorded() == 0 and not ring.rows.any()
    with pytest.raises(ValueError, match="capacity"):
        ViolationRing(0)


def test_run_counters() -> None:
    c = RunCounters()
    c.add(CanaryLaunchTag.TAIL_K_SWA, 5)
    c.add(CanaryLaunchTag.TAIL_K_SWA, torch.tensor(2))
    assert c.kernel_runs[CanaryLaunchTag.TAIL_K_SWA] == 2
    assert c.slots_processed.tolist()[CanaryLaunchTag.TAIL_K_SWA] == 7
    assert c.slots_processed.sum() == 7
