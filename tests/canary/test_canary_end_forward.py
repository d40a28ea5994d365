"""The host part after each forward (CanaryManager.end_forward) takes a fast path on steps
where nothing is due: the periodic observers (sweep, health check, stats line, SWA
divergence) run only at their due steps and the step after (a staged read drains), and the
pump is consulted only when the ring's index moved. Both must act on exactly the steps the
every-step path acted on."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from engine_utils import make_prompts, slot_of, start_decoding, tiny_engine

from kvcanary import SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.manager import CanaryManager
from kvcanary.canary.wire.constants import KvHalf, LaunchStage

PROMPTS = make_prompts(3, 20, 40, shared=12, seed=8)
PARAMS = SamplingParams(max_new_tokens=26, ignore_eos=True)


def _observe(engine: Any) -> list[tuple[int, ...]]:
    """Per engine step: (canary step, sweep passes, health checks, divergence samples)."""
    canary = engine.canary
    trace = []
    for _ in range(3):  # three waves: the prefix cache holds something to sweep
        for p in PROMPTS:
            engine.add_request(p, PARAMS)
        while engine.has_unfinished():
            engine.step()
            trace.append((canary.step, canary.sweep.num_passes, canary.health.num_checks,
                          len(canary.swa_divergence.samples)))  # fmt: skip
    return trace


@pytest.mark.parametrize("intervals", [(2, 3, 4, 5), (7, 1, 6, 3), (1, 5, 1, 4)])
def test_periodic_observers_act_on_the_same_steps_as_when_called_every_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    intervals: tuple[int, int, int, int],
) -> None:  # fmt: skip
    sweep, health, stats, divergence = intervals
    config = CanaryConfig(mode="log", sweep_interval=sweep, health_check_interval=health,
                          stats_interval=stats, swa_divergence_interval=divergence)  # fmt: skip

    def run(every_step: bool) -> tuple[list[tuple[int, ...]], list[str], int]:
        calls = [0]
        original = CanaryManager._periodic_observers

        def periodic(self: CanaryManager, batch: Any) -> None:
            calls[0] += 1
            original(self, batch)
            if every_step:
                self._next_periodic = 0

        monkeypatch.setattr(CanaryManager, "_periodic_observers", periodic)
        caplog.clear()
        with caplog.at_level(logging.INFO, "kvcanary.canary"):
            trace = _observe(tiny_engine(model="builtin:tiny-swa", canary=config))
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[canary]")]
        return trace, lines, calls[0]

    fast, fast_lines, fast_calls = run(every_step=False)
    slow, slow_lines, slow_calls = run(every_step=True)
    assert fast == slow and fast_lines == slow_lines
    assert fast[-1][1] > 0 and fast[-1][2] > 0 and fast[-1][3] > 0 and fast_lines  # all acted
    assert slow_calls == fast[-1][0]  # every forward
    if min(intervals) > 1:
        assert fast_calls < slow_calls  # the fast path skipped steps


def test_a_violation_is_reported_by_the_forward_that_records_it() -> None:
    """CPU pump (no delay): the ring index moved, so end_forward reads the new rows at once."""
    engine = tiny_engine(model="builtin:tiny-mha", canary=CanaryConfig(mode="log"))
    start_decoding(engine, make_prompts(2, 30, 40, seed=9))
    canary = engine.canary
    for _ in range(3):
        engine.step()
    assert canary.violations == [] and canary.pump.total_seen == 0
    # Corrupt the token field of one HEAD record the next forward re-verifies.
    group = canary.runtime.groups[0]
    records = group.records(LaunchStage.HEAD, KvHalf.K)
    slot = slot_of(engine, 0, 10)
    records[slot, 0] += 1
    engine.step()
    rows = canary.violations
    assert rows and {r.step for r in rows} == {canary.step}
    assert canary.pump.total_seen == canary.runtime.ring.num_recorded() == len(rows)
