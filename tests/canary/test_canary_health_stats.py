"""The canary's heartbeat: the delayed device->host handler, the `[canary] step=...` stats
line, and the kernel-run-counter health check (fires when a tag stops running; silent with
a sweep interval longer than its period and without a prefix cache)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from engine_utils import make_prompts, tiny_engine

from kvcanary import SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.errors import KVCanaryHealthError
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.kernels import fused_rows
from kvcanary.canary.observe.delayed import DelayedDeviceHostHandler, FutureTensors
from kvcanary.canary.wire.constants import CanaryLaunchTag

PROMPTS = make_prompts(3, 20, 40, seed=21)
LONG = SamplingParams(max_new_tokens=30, ignore_eos=True)
STATS_RE = re.compile(
    r"^\[canary\] step=(\d+) protected_tokens=(\d+) sweep_passes=(\d+) violations=(\d+) "
    r"launch_tags_active=(\d+)/(\d+)$"
)


def test_delayed_handler_posts_the_staged_values_one_step_later() -> None:
    handler = DelayedDeviceHostHandler(torch.device("cpu"))
    counter = torch.zeros(1, dtype=torch.int64)
    posted: list[tuple[int, int]] = []

    def compute(step: int):
        return {"step": step, "value": counter} if step % 2 == 0 else None

    for step in range(1, 6):
        counter += 10  # the device keeps counting after the staging
        handler.step(lambda s=step: compute(s), lambda v: posted.append((v["step"], int(v["value"][0]))))
        if step == 2:
            assert posted == [] and handler.pending  # staged, not posted yet
    assert posted == [(2, 20), (4, 40)]  # posted at steps 3 and 5 with step 2's / 4's values
    handler.flush()
    assert not handler.pending


def test_future_tensors_contract() -> None:
    t = torch.tensor([5])
    marker = object()
    future = FutureTensors({"t": t, "n": 3, "obj": marker})
    t += 1  # frozen at staging
    out = future.wait()
    assert int(out["t"][0]) == 5 and out["n"] == 3 and out["obj"] is marker
    with pytest.raises(RuntimeError, match="twice"):
        future.wait()
    with pytest.raises(ValueError, match="at least one tensor"):
        FutureTensors({"n": 3})


def test_stats_line_format_and_cadence(caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine(model="builtin:tiny-swa",
                         canary=CanaryConfig(mode="log", stats_interval=5, sweep_interval=7))  # fmt: skip
    with caplog.at_level(logging.INFO, "kvcanary.canary"):
        engine.generate(PROMPTS, LONG)
    messages = [r.getMessage() for r in caplog.records]
    lines = [STATS_RE.match(m) for m in messages if m.startswith("[canary] step=")]
    assert lines and all(lines)
    steps = [int(m.group(1)) for m in lines]
    assert steps == list(range(5, 5 * len(steps) + 1, 5))
    assert engine.canary.stats()["steps"] < steps[-1] + 5  # one line per 5 steps, none missed
    protected = [int(m.group(2)) for m in lines]
    assert protected == sorted(protected) and protected[0] > 0
    assert {m.group(4) for m in lines} == {"0"}
    # FULL + SWA groups, K only: HEAD, TAIL, SWEEP x 2 groups = 6 of SGLang's 12 tags.
    assert {(m.group(5), m.group(6)) for m in lines} == {("6", "12")}
    assert 0 < int(lines[-1].group(3)) <= engine.canary.sweep.num_passes


def test_stats_line_off_with_interval_zero(caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine(model="builtin:tiny-mha",
                         canary=CanaryConfig(mode="log", stats_interval=0))
    with caplog.at_level(logging.INFO, "kvcanary.canary"):
        engine.generate(PROMPTS, LONG)
    assert "[canary] step=" not in caplog.text


def _drop_launches(monkeypatch: pytest.MonkeyPatch, engine, tags: set[CanaryLaunchTag]) -> None:
    """From now on the launches of ``tags`` silently do not run (a lost launch): per-forward
    launches (verify + write; fused HEAD / TAIL calls lose them from their launch tuples)
    and the sweep's verify alike."""
    real_verify, real_launch = kernels.verify, kernels.launch
    real_build = fused_rows.FusedRowLaunches.build

    def build(*args, **kwargs):
        fused = real_build(*args, **kwargs)
        if fused is not None:
            fused.launches = tuple(t for t in fused.launches if t[1] not in tags)
            keep = [i for i, t in enumerate(fused.tails) if t[1] not in tags]
            fused.tails = tuple(fused.tails[i] for i in keep)
            fused.tail_watches = [fused.tail_watches[i] for i in keep]
            if not (fused.launches and fused.tails):
                return None  # nothing left to fuse: the per-launch path (patched above)
            fused.bind()
        return fused

    monkeypatch.setattr(fused_rows.FusedRowLaunches, "build", staticmethod(build))
    for sfm in engine.canary.single_forward_managers:
        sfm.bind_store_checker()  # fused launches are rebuilt on the next forward

    def verify(records, plan, ring, tag, **kw):
        if tag not in tags:
            real_verify(records, plan, ring, tag, **kw)

    def launch(records, verify_plan, write_plan, ring, tag, **kw):
        if tag not in tags:
            real_launch(records, verify_plan, write_plan, ring, tag, **kw)

    monkeypatch.setattr(kernels, "verify", verify)
    monkeypatch.setattr(kernels, "launch", launch)


@pytest.mark.parametrize(
    ("config", "stopped"),
    [
        (dict(), {CanaryLaunchTag.TAIL_K_SWA}),
        (dict(sweep_interval=2), {CanaryLaunchTag.SWEEP_K_FULL}),
    ],
)
def test_health_check_fires_when_an_expected_tag_stops(
    monkeypatch: pytest.MonkeyPatch, config: dict, stopped: set[CanaryLaunchTag]
) -> None:
    engine = tiny_engine(model="builtin:tiny-swa",
                         canary=CanaryConfig(mode="log", health_check_interval=4, **config))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for p in PROMPTS:
        engine.add_request(p, params)
    for _ in range(9):  # checks at steps 4 and 8 (read one step later) pass
        engine.step()
    assert engine.canary.health.num_checks == 2
    _drop_launches(monkeypatch, engine, stopped)  # from forward 10 on
    for _ in range(7):  # the window (8, 12] still saw forward 9's launch: silent
        engine.step()
    with pytest.raises(KVCanaryHealthError) as e:
        engine.step()  # forward 17 reads the check staged at 16: window (12, 16] lost them all
    assert isinstance(e.value, RuntimeError)
    message = str(e.value)
    assert "kernel_run_counter did not increase since previous check" in message
    assert f"tags={sorted(t.name for t in stopped)} at step=16;" in message


@pytest.mark.parametrize(
    ("sweep_interval", "config"),
    [
        (50, dict()),  # sweeps far apart: most check windows have none
        (1, dict(enable_prefix_cache=False)),  # nothing to sweep
    ],
    ids=["sweep-interval-longer-than-check", "no-prefix-cache"],
)
def test_health_check_is_silent_when_sweeps_legitimately_do_not_run(sweep_interval: int,
                                                                     config: dict) -> None:
    """SGLang's check expects SWEEP tags whenever the sweep is on, and misfires here."""
    canary = CanaryConfig(mode="log", health_check_interval=3, sweep_interval=sweep_interval)
    engine = tiny_engine(model="builtin:tiny-swa", canary=canary, **config)
    engine.generate(PROMPTS, LONG)
    health = engine.canary.health
    assert health.num_checks >= 8
    assert engine.canary.sweep.num_passes <= 1  # at most one pass (step 0) in 8+ windows
    assert "SWEEP_K_FULL" in engine.canary.stats()["launch_tags_active"]


def test_health_check_off_with_interval_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(model="builtin:tiny-mha",
                         canary=CanaryConfig(mode="log", health_check_interval=0))
    _drop_launches(monkeypatch, engine, {CanaryLaunchTag.HEAD_K_FULL})
    engine.generate(PROMPTS, LONG)  # nothing raised
    assert engine.canary.health is None
