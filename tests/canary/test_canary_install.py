"""install_canary and the per-forward runtime on a model-less host: launch order around
the model, the explicit before_forward / after_forward path and its misuse, the host
protocols (satisfied by the fake runner and by our engine's objects), the delayed pump,
modes, overflow, config validation, DSV4 groups at run time, and "none" installing nothing."""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys

import pytest
import torch
from canary_fake_runner import FakeRunner
from engine_utils import tiny_engine

import kvcanary.canary
from kvcanary import SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.errors import KVCanaryViolation
from kvcanary.canary.host import (
    CanaryHost,
    ForwardBatchView,
    KVPool,
    PrefixCacheView,
    ReqToTokenTable,
    TokenMirror,
)
from kvcanary.canary.install import install_canary
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.kernels import fused_rows
from kvcanary.canary.manager import CanaryManager
from kvcanary.canary.plan.inputs import compress_plan_inputs
from kvcanary.canary.plan.reference import PlanInputs
from kvcanary.canary.wire.constants import CANARY_FIELD_REAL_KV_HASH, CanaryLaunchTag
from kvcanary.canary.wire.records import as_int64_records
from kvcanary.canary.wire.violation import parse_violation_line
from kvcanary.config import EngineConfig
from kvcanary.engine.hooks import ForwardHooks
from kvcanary.memory.allocator import make_allocator
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool

P = 4


def mha_runner(**kw) -> FakeRunner:
    return FakeRunner(MHAKVPool(64, P, torch.float32, 2, 8, 2), make_allocator(64, P), **kw)


def swa_runner(**kw) -> FakeRunner:
    pool = SWAKVPool(64, 32, P, torch.float32, 2, 8, (0, 1), (2,))
    return FakeRunner(pool, SWAAllocator(64, 32, P, kvcache=pool), sliding_window=8, **kw)


def install(runner: FakeRunner, **cfg) -> FakeRunner:
    manager = install_canary(runner, CanaryConfig(**{"mode": "log", **cfg}))
    assert manager is not None and runner.canary is None  # the host keeps it, not install
    runner.canary = manager
    manager.mark_init_finished()
    return runner


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Spy on every kernel launch; returns the shared log (the fake model appends too)."""
    log: list[object] = []

    def spy(name: str, fn):
        def launch(records, plan, ring, tag, **kw):
            log.append((name, CanaryLaunchTag(tag).name))
            return fn(records, plan, ring, tag, **kw)

        return launch

    def spy_launch(fn):  # one launch = verify then write (a CPU row plan: one compiled call)
        def launch(records, verify_plan, write_plan, ring, tag, **kw):
            log.extend([("verify", CanaryLaunchTag(tag).name), ("write", CanaryLaunchTag(tag).name)])
            return fn(records, verify_plan, write_plan, ring, tag, **kw)

        return launch

    def spy_fused(fn, stage_launches):  # fused HEAD / TAIL: every launch of its tuple
        def run(self, *args, **kw):
            for t in stage_launches(self):
                log.extend([("verify", CanaryLaunchTag(t[1]).name), ("write", CanaryLaunchTag(t[1]).name)])
            return fn(self, *args, **kw)

        return run

    monkeypatch.setattr(kernels, "verify", spy("verify", kernels.verify))
    monkeypatch.setattr(kernels, "write", spy("write", kernels.write))
    monkeypatch.setattr(kernels, "launch", spy_launch(kernels.launch))
    fused = fused_rows.FusedRowLaunches
    monkeypatch.setattr(fused, "head", spy_fused(fused.head, lambda f: f.launches))
    monkeypatch.setattr(fused, "tail", spy_fused(fused.tail, lambda f: f.tails))
    return log


def _stage(stage: str, groups: list[str], halves: str) -> list[object]:
    return [(fn, f"{stage}_{h}_{g}") for g in groups for h in halves for fn in ("verify", "write")]


# ------------------------------------------------------------------ orchestration


@pytest.mark.parametrize(("make", "groups"), [(mha_runner, ["FULL"]), (swa_runner, ["FULL", "SWA"])])
@pytest.mark.parametrize("v_half", [False, True])
def test_head_before_model_tail_after(make, groups: list[str], v_half: bool,
                                      launches: list[object]) -> None:  # fmt: skip
    runner = install(make(), v_half=v_half)
    runner.log = runner.model.log = launches
    runner.forward([(1, 6)])
    halves = "KV" if v_half else "K"
    assert launches == _stage("HEAD", groups, halves) + ["model"] + _stage("TAIL", groups, halves)
    assert runner.canary.violations == []


def test_install_patches_no_model_and_the_host_calls_the_canary(launches: list[object]) -> None:
    runner = install(mha_runner())
    runner.log = runner.model.log = launches
    assert "forward" not in vars(runner.model)  # model.forward is the class's, untouched
    fb = runner.batch([(1, 5)])
    runner.model.forward(fb.input_ids, fb.positions, fb)  # no hooks called: no canary work
    assert launches == ["model"] and runner.canary.step == 0
    launches.clear()
    runner.canary.before_forward(fb)
    assert launches == _stage("HEAD", ["FULL"], "K") and runner.canary.forward_open
    runner.model.forward(fb.input_ids, fb.positions, fb)
    runner.canary.after_forward(fb)
    assert launches == _stage("HEAD", ["FULL"], "K") + ["model"] + _stage("TAIL", ["FULL"], "K")
    assert not runner.canary.forward_open and runner.canary.step == 1


def test_before_and_after_forward_must_alternate() -> None:
    runner = install(mha_runner())
    canary = runner.canary
    fb = runner.batch([(1, 3)])
    with pytest.raises(RuntimeError, match="after_forward called without before_forward"):
        canary.after_forward(fb)
    canary.before_forward(fb)
    with pytest.raises(RuntimeError, match="before_forward called while forward 0 is still open"):
        canary.before_forward(fb)
    canary.after_forward(fb)
    with pytest.raises(RuntimeError, match="after_forward called without before_forward"):
        canary.after_forward(fb)
    with pytest.raises(ValueError, match=r"forward_index=1; allowed: \[0, 1\)"):
        canary.before_forward(runner.batch([(1, 1)]), forward_index=1)
    assert not canary.forward_open and canary.step == 1
    runner.forward([(2, 4)])  # the refused calls left nothing behind
    assert canary.step == 2 and canary.violations == []


def test_forward_scope_is_before_and_after_forward(launches: list[object]) -> None:
    runner = install(mha_runner())
    runner.log = runner.model.log = launches
    fb = runner.batch([(1, 4)])
    with runner.canary.forward_scope(fb):
        assert launches == _stage("HEAD", ["FULL"], "K") and runner.canary.forward_open
        runner.model.forward(fb.input_ids, fb.positions, fb)
    assert launches == _stage("HEAD", ["FULL"], "K") + ["model"] + _stage("TAIL", ["FULL"], "K")
    assert runner.canary.step == 1
    with pytest.raises(ZeroDivisionError), runner.canary.forward_scope(runner.batch([(1, 1)])):
        raise ZeroDivisionError  # a failed forward stays open: its host cannot go on
    assert runner.canary.forward_open and runner.canary.step == 1


# ------------------------------------------------------------------ the host protocols


@pytest.mark.parametrize("make", [mha_runner, swa_runner])
def test_the_fake_runner_satisfies_the_host_protocols(make) -> None:
    runner = make()
    assert isinstance(runner, CanaryHost)
    assert isinstance(runner.token_to_kv_pool, KVPool)
    assert isinstance(runner.req_to_token_pool, ReqToTokenTable)
    assert isinstance(runner.req_to_token_pool, TokenMirror)
    assert isinstance(runner.batch([(1, 2)]), ForwardBatchView)
    install(runner)
    assert isinstance(runner.canary, CanaryManager) and isinstance(runner.canary, ForwardHooks)


@pytest.mark.parametrize("model", ["builtin:tiny-mha", "builtin:tiny-swa"])
def test_our_engine_is_a_canary_host(model: str) -> None:
    engine = tiny_engine(model=model, canary=CanaryConfig(mode="log"))
    runner = engine.runner
    assert isinstance(runner, CanaryHost) and not runner.is_draft_worker
    assert isinstance(runner.token_to_kv_pool, KVPool)
    assert isinstance(runner.req_to_token_pool, ReqToTokenTable)
    assert isinstance(runner.req_to_token_pool, TokenMirror)
    assert isinstance(engine.kv.prefix_cache, PrefixCacheView)
    # The engine keeps the manager; its runner calls it as its forward hooks.
    assert isinstance(engine.canary, CanaryManager) and runner.canary is engine.canary
    assert isinstance(runner.canary, ForwardHooks)
    assert engine.canary.pool is runner.token_to_kv_pool and engine.canary.init_finished
    assert engine.canary.sweep.cache is engine.kv.prefix_cache
    seen: list[object] = []
    hooks, metadata = engine.canary, runner.attn_backend.init_forward_metadata

    def before_forward(fb, forward_index=0):
        assert isinstance(fb, ForwardBatchView)
        seen.append("before_forward")
        CanaryManager.before_forward(hooks, fb, forward_index)

    def init_forward_metadata(fb):
        seen.append("init_forward_metadata")
        metadata(fb)

    def after_forward(fb):
        seen.append("after_forward")
        CanaryManager.after_forward(hooks, fb)

    hooks.before_forward, hooks.after_forward = before_forward, after_forward
    runner.attn_backend.init_forward_metadata = init_forward_metadata
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    # Host pre-ops (fault injection) and HEAD run before attention gathers its slot tables.
    assert seen == ["before_forward", "init_forward_metadata", "after_forward"] * 2
    assert engine.canary.step == 2 and engine.canary.violations == []


def test_the_canary_knows_no_host() -> None:
    """Nothing engine-specific inside kvcanary.canary: no import of the engine or of an
    integration (hosts import the canary, never the other way round)."""
    root = pathlib.Path(kvcanary.canary.__file__).parent
    offenders = [
        str(path.relative_to(root)) for path in sorted(root.rglob("*.py"))
        for line in path.read_text().splitlines()
        if line.lstrip().startswith(("import ", "from "))
        and ("kvcanary.engine" in line or "kvcanary.integrations" in line
             or "kvcanary.server" in line or "kvcanary.disagg" in line)
    ]  # fmt: skip
    assert offenders == []


def test_clean_steps_verify_the_prefix_and_write_new_tokens() -> None:
    runner = install(swa_runner(), real_data="partial", v_half=True)
    runner.forward([(1, 10), (2, 3)])
    for _ in range(6):
        runner.forward([(1, 1), (2, 1)])
    stats = runner.canary.stats()
    assert stats["violations"] == 0 and runner.canary.violations == []
    # Decode steps re-verify whole prefixes (FULL) but only the window (SWA, W = 8).
    full = sum(10 + i + 3 + i for i in range(6))
    swa = sum(min(10 + i, 8) + min(3 + i, 8) for i in range(6))
    assert stats["verify_entries_by_tag"]["HEAD_K_FULL"] == full
    assert stats["verify_entries_by_tag"]["TAIL_V_SWA"] == swa
    assert stats["write_entries_by_tag"]["HEAD_K_SWA"] == 13 + 12
    assert stats["kernel_runs_by_tag"]["TAIL_K_FULL"] == 2 * 7  # verify + write per step


def test_graph_padding_rows_contribute_nothing() -> None:
    runner = install(swa_runner(), real_data="partial", verify_tokens=False)
    runner.forward([(1, 6), (2, 3)])
    fb = runner.batch([(1, 1), (2, 1)])
    pad = 3  # a static-shape bucket of 5: rows 0, slot 0, position 0
    z = torch.zeros(pad, dtype=torch.int64)
    for name, fill in (("req_pool_indices", z), ("prefix_lens", z), ("input_ids", z),
                       ("positions", z), ("out_cache_loc", z), ("extend_seq_lens", z + 1)):
        setattr(fb, name, torch.cat([getattr(fb, name), fill]))  # fmt: skip
    before = runner.canary.stats()
    with runner.canary.forward_scope(fb):
        runner.model.forward(fb.input_ids, fb.positions, fb)
    after = runner.canary.stats()
    assert after["violations"] == 0
    assert after["write_entries_by_tag"]["HEAD_K_FULL"] - before["write_entries_by_tag"][
        "HEAD_K_FULL"
    ] == 2  # only the two real tokens
    for group in runner.canary.groups:
        assert all(not bool(b[0].any()) for b in group.buffers())  # slot 0 never written


def test_double_install_is_refused() -> None:
    runner = install(mha_runner())
    infos = runner.token_to_kv_pool.get_contiguous_buf_infos
    with pytest.raises(RuntimeError, match="already installed on this host's pool"):
        install_canary(runner, CanaryConfig(mode="log"))
    assert runner.token_to_kv_pool.get_contiguous_buf_infos is infos  # nothing re-attached


# ------------------------------------------------------------------ pump and modes


def _corrupt_head_record(runner: FakeRunner, row: int, pos: int) -> int:
    """HEAD records never hold a real-KV hash: a non-zero one is one violation per verify
    (it is not part of the chain, so the successor stays clean)."""
    slot = int(runner.req_to_token_pool.req_to_token[row, pos])
    as_int64_records(runner.canary.groups[0].k_head)[slot, CANARY_FIELD_REAL_KV_HASH] = 5
    return slot


@pytest.mark.parametrize("delay", [0, 1])
def test_pump_reports_after_the_configured_delay(delay: int) -> None:
    runner = install(mha_runner(), pump_delay_steps=delay)
    runner.forward([(1, 6)])
    slot = _corrupt_head_record(runner, 1, 2)
    runner.forward([(1, 1)])  # step 2 detects
    assert len(runner.canary.violations) == (1 if delay == 0 else 0)
    runner.forward([(1, 1)])  # step 3 detects again (the record stays corrupt)
    rows = runner.canary.violations
    assert rows[0].step == 2 + delay
    assert (rows[0].launch_tag, rows[0].fail_reasons, rows[0].slot_idx) == (
        "HEAD_K_FULL", ("verify_real_kv_hash",), slot,
    )  # fmt: skip
    runner.canary.flush()
    assert len(runner.canary.violations) == 2


def test_raise_mode_logs_every_row_then_raises_once(caplog: pytest.LogCaptureFixture) -> None:
    runner = install(mha_runner(), mode="raise")
    runner.forward([(1, 6)])
    _corrupt_head_record(runner, 1, 2)
    _corrupt_head_record(runner, 1, 4)
    with caplog.at_level(logging.WARNING, "kvcanary.canary"), pytest.raises(KVCanaryViolation) as e:
        runner.forward([(1, 1)])
    assert isinstance(e.value, RuntimeError)
    logged = [parse_violation_line(r.getMessage()) for r in caplog.records]
    assert len(logged) == 2 and all(x is not None for x in logged)
    assert str(e.value).count("kv_canary violation:") == 2
    runner.forward([(1, 1)])  # later rows are logged, not raised again
    assert len(runner.canary.violations) == 4


def test_log_mode_warns_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    runner = install(mha_runner(), mode="log")
    runner.forward([(1, 6)])
    _corrupt_head_record(runner, 1, 3)
    with caplog.at_level(logging.WARNING, "kvcanary.canary"):
        for _ in range(3):
            runner.forward([(1, 1)])
    lines = [r.getMessage().split("\n")[0] for r in caplog.records]
    assert len(lines) == 3 and all(line.startswith("kv_canary violation: ") for line in lines)
    parsed = parse_violation_line(lines[0])
    row = runner.canary.violations[0]
    assert parsed is not None and parsed.slot_idx == row.slot_idx
    assert parsed.stored_chain_hash == row.stored_chain_hash


def test_abort_mode_hands_violating_slots_to_the_handler() -> None:
    runner = install(swa_runner(), mode="abort")
    calls: list[tuple[list[int], list[int]]] = []
    runner.canary.set_abort_handler(lambda f, s, r: calls.append((f.tolist(), s.tolist())) or [7])
    runner.forward([(1, 10)])
    swa_group = runner.canary.groups[1]
    full_slot = int(runner.req_to_token_pool.req_to_token[1, 9])
    swa_slot = int(runner.token_to_kv_pool.full_to_swa_index_mapping[full_slot])
    as_int64_records(swa_group.k_head)[swa_slot, CANARY_FIELD_REAL_KV_HASH] = 99
    runner.forward([(1, 1)])
    assert runner.canary.end_step() == [7]
    assert calls == [([], [swa_slot])]
    assert runner.canary.end_step() == []  # reported rows are handed over once


def test_verify_overflow_skips_verify_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    runner = install(mha_runner(), verify_capacity=4)
    runner.forward([(1, 6)])
    with caplog.at_level(logging.WARNING, "kvcanary.canary"):
        runner.forward([(1, 1)])  # wants 6 verify entries > 4
    (message,) = [r.getMessage() for r in caplog.records]
    assert "verify skipped this step due to overflow (total=1, capacity=4)" in message
    assert "requested_entries=6" in message
    stats = runner.canary.stats()
    assert stats["verify_entries"] == 0 and stats["write_entries"] == 2 * 7  # HEAD + TAIL
    assert stats["verify_overflow_steps"] == 1 and stats["violations"] == 0


# ------------------------------------------------------------------ DSV4 at run time


def test_compressed_plan_inputs_follow_complete_blocks() -> None:
    r2t = torch.arange(2 * 16, dtype=torch.int32).reshape(2, 16)
    inputs = PlanInputs(
        req_to_token=r2t, req_pool_indices=torch.tensor([1, 0]),
        prefix_lens=torch.tensor([6, 0]), extend_lens=torch.tensor([4, 1]),
        input_ids=torch.tensor([60, 70, 80, 90, 0]), positions=torch.tensor([6, 7, 8, 9, 0]),
        out_cache_loc=torch.tensor([22, 23, 24, 25, 0]),
    )  # fmt: skip
    c = compress_plan_inputs(inputs, 4)
    assert (c.prefix_lens.tolist(), c.extend_lens.tolist()) == ([1, 0], [1, 0])
    assert (c.input_ids.tolist(), c.positions.tolist(), c.out_cache_loc.tolist()) == (
        [70], [1], [23],
    )  # fmt: skip
    assert c.req_to_token[1].tolist() == [19, 23, 27, 31]  # each block's last position


def test_dsv4_groups_run_clean_and_catch_a_remap() -> None:
    pool = DSV4KVPool(64, 32, P, [0, 4, 4], 8, 4, torch.float32)
    runner = install(FakeRunner(pool, SWAAllocator(64, 32, P, kvcache=pool), sliding_window=6),
                     mode="log", real_data="partial")  # fmt: skip
    runner.forward([(1, 9), (2, 5)])
    for _ in range(4):
        runner.forward([(1, 1), (2, 1)])
    stats = runner.canary.stats()
    assert stats["violations"] == 0
    assert stats["write_entries_by_tag"]["TAIL_K_C4"] == 13 // 4 + 9 // 4
    assert stats["verify_entries_by_tag"]["HEAD_K_INDEXER"] > 0
    r2t = runner.req_to_token_pool.req_to_token
    r2t[1, 3] = r2t[2, 7]  # block 0 of row 1 now names row 2's block 1
    runner.forward([(1, 1), (2, 1)])
    tags = {v.launch_tag for v in runner.canary.violations}
    assert {"HEAD_K_C4", "HEAD_K_INDEXER", "TAIL_K_C4"} <= tags


# ------------------------------------------------------------------ config and "none"


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("mode", "loud", "--kv-canary"),
        ("real_data", "some", "--kv-canary-real-data"),
        ("real_data_layers", "last", "--kv-canary-real-data-layers"),
        ("ring_capacity", 0, "--kv-canary-ring-capacity"),
        ("verify_capacity", -1, "--kv-canary-verify-capacity"),
    ],
)
def test_bad_canary_config_names_flag_value_and_allowed(field: str, value: object,
                                                        flag: str) -> None:  # fmt: skip
    with pytest.raises(ValueError) as e:
        CanaryConfig(**{"mode": "log", field: value})
    dest = flag[2:].replace("-", "_")  # the flag's argparse dest
    assert str(e.value).startswith(f"{flag} ({dest})={json.dumps(value)} is invalid: allowed ")


def test_canary_options_without_a_mode_are_refused() -> None:
    with pytest.raises(ValueError, match=r"--kv-canary-v-half \(kv_canary_v_half\)=true is invalid"):
        EngineConfig(canary=CanaryConfig(v_half=True))


def test_none_installs_nothing() -> None:
    runner = mha_runner()
    forward = runner.model.forward
    infos = runner.token_to_kv_pool.get_contiguous_buf_infos
    assert install_canary(runner, CanaryConfig(mode="none")) is None
    assert runner.canary is None and runner.model.forward == forward
    assert runner.token_to_kv_pool.get_contiguous_buf_infos == infos
    assert runner.token_to_kv_pool.extra_slot_buffers == []


def test_engine_without_canary_never_imports_it() -> None:
    code = (
        "import sys; from kvcanary import Engine, EngineConfig\n"
        "e = Engine(EngineConfig(model='builtin:tiny-mha', max_total_tokens=64))\n"
        "assert e.canary is None and e.runner.canary is None\n"
        "print(' '.join(m for m in sys.modules if m.startswith(('kvcanary.canary.', "
        "'kvcanary.integrations'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    runtime = {"install", "adapters", "manager", "kernels", "buffers", "single_forward", "pump",
               "host"}  # fmt: skip
    loaded = set(out.stdout.split())
    assert not {f"kvcanary.canary.{m}" for m in runtime} & loaded
    assert not {"kvcanary.integrations", "kvcanary.integrations.native.host"} & loaded
