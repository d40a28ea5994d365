"""Violation log lines both ways: SGLang's own ``ViolationReporter`` against our formatter,
parser and ``kvcanary explain``.

Rows come from SGLang's kernels on random scenarios (real violations) and from a synthetic
sweep over every SGLang launch tag and every combination of SGLang's six fail bits, with
extreme field values. For each row: our message is byte-identical to SGLang's, our parser
reads SGLang's first line back to the row, and ``explain`` accounts for every SGLang line.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import sglang_xref as X
import torch
from sglang.kernels.ops.kv_canary.consts import FailReason as SgFailReason
from sglang.kernels.ops.kv_canary.verify import CanaryLaunchTag as SgTag
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
from sglang.srt.kv_canary.runner.violation_reporter import ViolationReporter
from sglang.srt.kv_canary.state import CanaryDeviceState

from kvcanary.canary.explain import CAUSES, explain, parse_log
from kvcanary.canary.wire.constants import FailReason, KvHalf, RealKvHashMode
from kvcanary.canary.wire.violation import (
    ViolationRecord,
    format_violation_line,
    format_violation_message,
    parse_violation_line,
)

REPORTER_LOGGER = "sglang.srt.kv_canary.runner.violation_reporter"
LINES_PER_MESSAGE = 7  # frozen line, header, canary_kind, fail_reasons, 2 body lines, footer


def sglang_messages(rows: list[list[int]], *, capacity: int | None = None, total: int | None = None,
                    step: int = 7, mode: CanaryMode = CanaryMode.LOG,
                    caplog: pytest.LogCaptureFixture | None = None) -> list[str]:  # fmt: skip
    """SGLang's reporter on a ring holding ``rows``: its log messages (log mode, one per
    row) or its RuntimeError text split per row (raise mode)."""
    capacity = capacity or max(1, len(rows))
    config = CanaryConfig(mode=mode, ring_capacity=capacity, sweep_interval=0,
                          real_kv_hash_mode=RealKvHashMode.NONE, enable_write_input_assert=False,
                          enable_verify_token_assert=False, stats_print_every_n_steps=0)  # type: ignore[arg-type]  # fmt: skip
    state = CanaryDeviceState.allocate(config=config, device=torch.device("cpu"), num_tags=12)
    log = state.violation_log
    stored = rows[:capacity]
    if stored:
        log.violation_ring[: len(stored)] = torch.tensor(stored, dtype=torch.int64)
    log.violation_write_index[0] = len(rows) if total is None else total
    reporter = ViolationReporter(config=config, device_state=state)
    if mode is CanaryMode.RAISE:
        with pytest.raises(RuntimeError) as info:
            reporter.log_or_raise_violation(outer_step_counter=step)
        assert reporter.is_raised
        lines = str(info.value).split("\n")
        return ["\n".join(lines[i : i + LINES_PER_MESSAGE])
                for i in range(0, len(lines), LINES_PER_MESSAGE)]  # fmt: skip
    assert caplog is not None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=REPORTER_LOGGER):
        reporter.log_or_raise_violation(outer_step_counter=step)
    return [r.getMessage() for r in caplog.records if r.name == REPORTER_LOGGER]


def synthetic_rows(seed: int) -> list[list[int]]:
    """Every SGLang tag x every combination of its six fail bits (incl. none), random and
    extreme field values (negative, int64 limits, hashes with the top bit set)."""
    rng = random.Random(seed)
    extremes = [0, -1, 1, 2**63 - 1, -(2**63), 0x7FFF, -123456789]

    def value() -> int:
        return rng.choice(extremes) if rng.random() < 0.3 else rng.randrange(-(2**63), 2**63)

    return [
        [int(tag), rng.randrange(0, 1 << 20), rng.randrange(-2, 1 << 16), value(), value(),
         value(), value(), bits]
        for tag in SgTag
        for bits in range(1 << len(SgFailReason))
    ]  # fmt: skip


def scenario_rows(num_scenarios: int) -> list[list[int]]:
    """Real violation rows out of SGLang's kernels (random faults, small rings, asserts)."""
    rows: list[list[int]] = []
    for seed in range(num_scenarios):
        cfg = dataclasses.replace(X.ScenarioConfig.draw(20_000 + seed), corruption_prob=0.6,
                                  ring_capacity=4096)  # fmt: skip
        _, impls = X.run_scenario(cfg, ("sglang",))
        rows += impls["sglang"].ring_state()[1].tolist()
    return rows


@pytest.fixture(scope="module")
def real_rows() -> list[list[int]]:
    rows = scenario_rows(40)
    assert len(rows) > 100
    reasons = {r[7] for r in rows}
    assert len(reasons) > 5, reasons  # many fail-bit combinations occurred
    return rows


def _check_both_ways(rows: list[list[int]], messages: list[str], *, total: int,
                     overflow: bool, step: int) -> None:  # fmt: skip
    assert messages
    for row, message in zip(rows, messages, strict=False):
        record = ViolationRecord(*row)
        ours = format_violation_message(record, total_violations=total, ring_overflow=overflow,
                                        step_when_pumped=step)  # fmt: skip
        assert ours == message, f"\nSGLang:\n{message}\nours:\n{ours}"
        first = message.split("\n", 1)[0]
        assert format_violation_line(record) == first
        assert parse_violation_line(first) == record
        assert parse_violation_line(f"[2026-11-01 12:00:00 TP0] {first}") == record


def test_synthetic_rows_both_ways(caplog: pytest.LogCaptureFixture) -> None:
    rows = synthetic_rows(0)
    messages = sglang_messages(rows, step=3, caplog=caplog)
    assert len(messages) == len(rows) == 12 * 64
    _check_both_ways(rows, messages, total=len(rows), overflow=False, step=3)


def test_kernel_rows_both_ways(real_rows: list[list[int]], caplog: pytest.LogCaptureFixture) -> None:
    messages = sglang_messages(real_rows, step=11, caplog=caplog)
    assert len(messages) == len(real_rows)
    _check_both_ways(real_rows, messages, total=len(real_rows), overflow=False, step=11)


def test_raise_mode_and_ring_overflow_both_ways() -> None:
    rows = synthetic_rows(1)[:40]
    messages = sglang_messages(rows, capacity=25, total=1000, step=0, mode=CanaryMode.RAISE)
    assert len(messages) == 25
    assert "ring_overflow=True" in messages[0] and "total_violations=1000" in messages[0]
    _check_both_ways(rows[:25], messages, total=1000, overflow=True, step=0)


def test_unknown_launch_tag_message() -> None:
    """A tag SGLang does not know (a corrupted ring row): SGLang labels the tag and the
    canary kind ``unknown(n)``; ours must print the same message."""
    rows = [[99, 5, 3, 7, -1, -5, 12, 3], [-1, 8, 0, 1, 1, 0, 0, 0]]
    messages = sglang_messages(rows, mode=CanaryMode.RAISE)
    _check_both_ways(rows, messages, total=2, overflow=False, step=7)


def test_explain_reads_sglang_logs(real_rows: list[list[int]], caplog: pytest.LogCaptureFixture) -> None:
    """``kvcanary explain`` on SGLang's log output (logger prefixes, multi-line messages,
    a raise-mode ``RuntimeError:`` text): every violation line parsed, every row a cause."""
    messages = sglang_messages(real_rows, caplog=caplog)
    log = "\n".join(f"[2026-11-01 12:00:{i % 60:02d} TP0] WARNING violation_reporter.py:66: {m}"
                    for i, m in enumerate(messages))  # fmt: skip
    summary = explain(log)
    assert summary["unparsed"] == []
    assert summary["violations"] == len(real_rows)
    assert sum(c["count"] for c in summary["causes"]) == len(real_rows)
    assert all(c["cause"] in CAUSES for c in summary["causes"])
    parsed, _ = parse_log(log)
    assert [p.record for p in parsed] == [ViolationRecord(*r) for r in real_rows]
    raised = "RuntimeError: " + "\n".join(sglang_messages(real_rows[:30], mode=CanaryMode.RAISE))
    assert explain(raised)["violations"] == 30


def test_explain_names_the_injected_fault(caplog: pytest.LogCaptureFixture) -> None:
    """Rows SGLang's kernels emit for a flipped KV byte are explained as KV byte corruption;
    for a corrupted stored position as a wrong slot / position shift."""
    cfg = dataclasses.replace(X.ScenarioConfig.draw(3, clean=True), mode=RealKvHashMode.ALL,
                              num_steps=6, write_input_assert=False, check_token=False)  # fmt: skip
    world, impls = X.run_scenario(cfg, ("sglang",), clean=True)
    req = max(world.requests.values(), key=lambda r: r.computed)
    slot = int(world.req_to_token[req.row, req.computed // 2])
    row, col = world.kv_cols(slot)
    world.full.kv[KvHalf.K][row, col] ^= 0x80
    X.run_forward(world, impls, world.build_forward([req], clean=True), "kv byte")
    rows = impls["sglang"].ring_state()[1].tolist()
    summary = explain("\n".join(sglang_messages(rows, caplog=caplog)))
    causes = {c["cause"] for c in summary["causes"]}
    assert causes == {"kv_byte_corruption"}, summary["causes"]
    assert all(r[7] == int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH) for r in rows)
