"""Graph-safe decode plans (:mod:`kvcanary.canary.plan.static`): built from device tensors
with shapes fixed by the bucket (no host read: they build on the meta device, where any
read of data fails), and on the engine they report exactly what the per-forward planners
report, for faults injected into the engine's own state."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from engine_utils import make_prompts, start_decoding, tiny_engine

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.kernels import torch_kernels as kernels_torch
from kvcanary.canary.plan.reference import build_plans
from kvcanary.canary.plan.static import build_static_decode_plans, static_key_width
from kvcanary.canary.plan.types import PlanInputs
from kvcanary.canary.report.ring import ViolationRing
from kvcanary.config import SamplingParams


@pytest.fixture(autouse=True)
def quiet_canary_log():
    log = logging.getLogger("kvcanary.canary")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def _decode_inputs(device: str, bs: int = 4, rows: int = 8, ctx: int = 64) -> PlanInputs:
    def z(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64, device=device)

    return PlanInputs(
        req_to_token=torch.zeros(rows, ctx, dtype=torch.int32, device=device),
        req_pool_indices=z(bs), prefix_lens=z(bs), extend_lens=z(bs) + 1, input_ids=z(bs),
        positions=z(bs), out_cache_loc=z(bs),
        expected_token_table=torch.zeros(rows, ctx, dtype=torch.int64, device=device),
        expected_token_lens=z(bs), expected_input_ids=z(bs), expected_positions=z(bs),
    )  # fmt: skip


@pytest.mark.parametrize("window", [None, 16])
def test_plans_holes_and_verify_need_no_host_read(window: int | None) -> None:
    """On the meta device tensors have shapes and no data: a ``.item()``, a ``nonzero`` or
    any output sized by data raises. The planner, the hole append and the torch verify run
    there, so inside a captured graph they read nothing back either."""
    inputs = _decode_inputs("meta")
    lut = torch.zeros(300, dtype=torch.int64, device="meta") if window else None
    static = build_static_decode_plans(inputs, 32, window=window, lut=lut)
    grid = 32 if window is None else 16
    assert static.plans.verify.slots.shape == (4 * grid,)
    assert static.plans.write.total_num_tokens == 4 and static.hole_rows.shape == (4 * grid, 8)
    ring = ViolationRing(16, device="meta")
    ring.append_t(static.hole_rows, static.hole_mask)
    records = torch.zeros(300, 32, dtype=torch.uint8, device="meta")
    kernels_torch.verify(records, static.plans.verify, ring, 6, check_token=True)
    # ... while the per-forward planner does read counts back (it sizes its plans by them).
    with pytest.raises((NotImplementedError, RuntimeError)):
        build_plans(inputs, verify_capacity=1000, window=window, lut=lut, backend="torch")


def test_entries_are_build_plans_entries_plus_dead_ones() -> None:
    """A hand-made decode batch: rows 1 and 2 real, row 0 padding; the live entries, in
    order, are build_plans' entries; dead ones have slot 0; holes are the mapping's zeros
    in the window attention reads."""
    r2t = torch.zeros(4, 16, dtype=torch.int32)
    r2t[1, :6] = torch.tensor([11, 12, 13, 14, 15, 16])
    r2t[2, :3] = torch.tensor([21, 22, 23])
    lut = torch.arange(40)
    lut[14] = 0  # position 3 of row 1: evicted too early (inside its window)
    inputs = PlanInputs(
        req_to_token=r2t, req_pool_indices=torch.tensor([1, 2, 0]),
        prefix_lens=torch.tensor([5, 2, 0]), extend_lens=torch.ones(3, dtype=torch.int64),
        input_ids=torch.tensor([7, 8, 0]), positions=torch.tensor([5, 2, 0]),
        out_cache_loc=torch.tensor([16, 23, 0]),
    )  # fmt: skip
    static = build_static_decode_plans(inputs, 8, window=4, lut=lut)
    want = build_plans(inputs, verify_capacity=100, window=4, lut=lut, backend="torch")
    v = static.plans.verify
    live = v.slots != 0
    assert v.slots.shape == (12,)  # 3 rows x min(window, width)
    assert v.slots[live].tolist() == want.verify.slots[want.verify.slots != 0].tolist()
    assert v.positions[live].tolist() == want.verify.positions[want.verify.slots != 0].tolist()
    assert v.slots.tolist() == [12, 13, 0, 15, 21, 22, 0, 0, 0, 0, 0, 0]
    assert v.prev_slots.tolist()[:6] == [11, 12, 13, 0, -1, 21]  # prev of position 4: evicted
    assert want.holes is not None and want.holes.tolist() == [[14], [3], [5]]
    assert static.hole_mask.nonzero().reshape(-1).tolist() == [2]
    assert static.hole_rows[2, 1:3].tolist() == [14, 3] and static.hole_rows[2, 6] == 5
    w = static.plans.write
    assert w.slots.tolist() == [16, 23, -1] and w.seed_slots.tolist() == [15, 22, -1]
    assert static.num_live.tolist() == [want.verify.num_entries] == [6]  # the hole included
    assert static_key_width(type("B", (), {"seq_lens_cpu": [6, 3, 1]})(), 1024) == 64
    assert static_key_width(object(), 1024) == 1024


def _faulty_run(graph_safe: bool, model: str) -> tuple[list[Any], list[torch.Tensor]]:
    """A decoding batch whose engine state is corrupted between forwards, directly: a byte of
    a live slot's K (first layer of the sub-pool holding it), a req->token entry pointed at another live slot, an in-window
    SWA mapping zeroed. The violation rows and every record buffer after the run."""
    engine = tiny_engine(model=model, graph_batch_sizes=(1, 2, 4, 8), swa_full_tokens_ratio=0.5,
                         canary=CanaryConfig(mode="log", real_data="partial", verify_tokens=True,
                                             graph_safe=graph_safe))  # fmt: skip
    prompts = make_prompts(5, 20, 40, seed=3)
    start_decoding(engine, prompts, max_new_tokens=30)
    runner = engine.runner
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    running = engine.running_requests()
    for step in range(24):
        if step == 2:  # a byte of request 0's newest committed token, in the first K layer
            slot = int(r2t[running[0].req_pool_idx, running[0].kv_len - 2])
            sub = getattr(pool, "full_kv_pool", pool)
            if not sub.k_buffer:  # every layer sliding: the SWA sub-pool holds the KV
                sub, slot = pool.swa_kv_pool, int(pool.full_to_swa_index_mapping[slot])
            sub.k_buffer[0].view(torch.uint8).view(sub.k_buffer[0].shape[0], -1)[slot, 0] ^= 0xFF
        if step == 6:  # request 1's position 3 -> request 2's slot of position 4
            r2t[running[1].req_pool_idx, 3] = r2t[running[2].req_pool_idx, 4]
        if step == 10 and hasattr(pool, "full_to_swa_index_mapping"):  # an in-window hole
            row = running[3].req_pool_idx
            pool.full_to_swa_index_mapping[int(r2t[row, running[3].kv_len - 2])] = 0
        engine.step()
    engine.canary.flush()
    rows = [(r.launch_tag, r.slot_idx, r.position, tuple(r.fail_reasons))
            for r in engine.canary.violations]  # fmt: skip
    records = [b.clone() for g in engine.canary.groups for b in g.buffers()]
    return rows, records


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha", "builtin:tiny-swa-all"])
def test_engine_reports_what_the_per_forward_planners_report(model: str) -> None:
    want_rows, want_records = _faulty_run(False, model)
    got_rows, got_records = _faulty_run(True, model)
    tags = {r[0] for r in want_rows}
    assert any(t.startswith("TAIL") for t in tags) and any(t.startswith("HEAD") for t in tags)
    if model != "builtin:tiny-mha":  # the zeroed mapping: a hole attention reads
        assert any("verify_not_resident" in r[3] for r in want_rows)
    assert got_rows == want_rows
    assert all(torch.equal(a, b) for a, b in zip(got_records, want_records, strict=True))


def test_graph_safe_is_refused_without_a_mode() -> None:
    with pytest.raises(ValueError, match="graph_safe"):
        CanaryConfig(graph_safe=True)


def test_clean_graph_safe_run_is_silent_and_outputs_do_not_change() -> None:
    prompts = make_prompts(6, 10, 50, shared=8, seed=1)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = tiny_engine(graph_batch_sizes=(1, 2, 4, 8)).generate(prompts, params)
    scanned = {}
    for graph_safe in (False, True):
        engine = tiny_engine(graph_batch_sizes=(1, 2, 4, 8),
                             canary=CanaryConfig(mode="raise", real_data="partial",
                                                 graph_safe=graph_safe, sweep_interval=4,
                                                 health_check_interval=8))  # fmt: skip
        assert engine.generate(prompts, params) == plain
        assert engine.canary.violations == [] and engine.canary.step >= 40
        scanned[graph_safe] = int(engine.canary.runtime.verify_counters.slots_processed.sum())
    assert scanned[True] > scanned[False]  # the static grids' dead entries: the path ran


def test_the_fault_campaign_detects_every_class_with_graph_safe_plans() -> None:
    """kvcanary selftest --kv-canary-graph-safe (one seed): every class on every pool is
    reported with its expected tag and reason, clean runs are silent."""
    from kvcanary.cli.selftest import run_selftest

    summary = run_selftest(seeds=[0], progress=False, graph_safe=True)
    assert summary["graph_safe"] and summary["ok"], summary["missed"]
    assert summary["fault_classes"] == summary["detected_classes"] == 37  # 32 + 5 speculative
    assert summary["false_positives"] == 0


def _random_decode_inputs(gen: torch.Generator, bs: int, rows: int = 10, ctx: int = 96,
                          tokens: bool = True) -> PlanInputs:  # fmt: skip
    """A random decode batch: distinct req->token rows (some padding), prefixes up to the
    table's width, slots in [1, 400)."""
    r2t = torch.randint(1, 400, (rows, ctx), generator=gen, dtype=torch.int32)
    req = torch.randperm(rows - 1, generator=gen)[:bs] + 1
    req[torch.rand(bs, generator=gen) < 0.2] = 0  # padding rows
    prefix = torch.randint(0, ctx - 1, (bs,), generator=gen)
    table = torch.randint(0, 259, (rows, ctx), generator=gen) if tokens else None
    lens = torch.randint(0, ctx, (bs,), generator=gen) if tokens else None
    return PlanInputs(
        req_to_token=r2t, req_pool_indices=req, prefix_lens=prefix,
        extend_lens=torch.ones(bs, dtype=torch.int64), input_ids=torch.randint(0, 259, (bs,), generator=gen),
        positions=prefix.clone(), out_cache_loc=torch.randint(1, 400, (bs,), generator=gen),
        expected_token_table=table, expected_token_lens=lens,
    )  # fmt: skip


def test_compiled_planner_traces_whole_and_equals_eager() -> None:
    """``compiled=True`` builds the same plans through torch.compile (on CUDA inductor fuses
    them into a few Triton kernels a captured graph replays). Here the trace runs with the
    aot_eager backend: one graph (``fullgraph``: a graph break would raise), functionalized,
    no code generated; every tensor equal to the eager planner's, FULL and SWA (with a LUT
    that has holes), with and without expected tokens, batches with padding rows."""
    from kvcanary.canary.plan import static as static_plan

    gen = torch.Generator().manual_seed(5)
    lut = torch.arange(400)
    lut[torch.randperm(400, generator=gen)[:60]] = 0
    torch._dynamo.reset()  # the recompile limit counts every earlier trace of the code
    traced = static_plan.compiled_static_tensors("aot_eager", fullgraph=True)
    checked = 0
    for bs in (1, 3, 8):
        for tokens in (False, True):
            inputs = _random_decode_inputs(gen, bs, tokens=tokens)
            for window, table in ((None, None), (16, lut)):
                args = (inputs.req_to_token, inputs.req_pool_indices, inputs.prefix_lens,
                        inputs.out_cache_loc, table, inputs.expected_token_table,
                        inputs.expected_token_lens)  # fmt: skip
                kw = dict(width=64, window=window, offset=0, check_residency=True, hole_tag=7)
                got, want = traced(*args, **kw), static_plan.static_tensors(*args, **kw)
                assert len(got) == len(want) == 9
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
                checked += int(want[5].sum()) + int(want[8].sum())
    assert checked > 0  # holes and live entries were there to compare
    torch._dynamo.reset()


def test_engine_with_compiled_plans_reports_what_eager_plans_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS=on: the engine's graph-safe canary plans
    through the compiled planner (aot_eager here: no GPU) and reports the same rows and
    leaves the same records for faults written into the engine's state."""
    from kvcanary.canary import forward as single_forward
    from kvcanary.canary.plan import static as static_plan

    want_rows, want_records = _faulty_run(True, "builtin:tiny-swa")
    calls = []
    real = static_plan.compiled_static_tensors

    def traced(backend: str = "inductor", fullgraph: bool = False) -> Any:
        calls.append(backend)
        return real("aot_eager", fullgraph)

    monkeypatch.setenv("KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS", "on")
    monkeypatch.setattr(static_plan, "compiled_static_tensors", traced)
    assert single_forward.compile_static_plans(torch.device("cpu"))
    got_rows, got_records = _faulty_run(True, "builtin:tiny-swa")
    assert calls  # the compiled planner ran
    assert got_rows == want_rows
    assert all(torch.equal(a, b) for a, b in zip(got_records, want_records, strict=True))
    monkeypatch.setenv("KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS", "auto")
    assert not single_forward.compile_static_plans(torch.device("cpu"))
