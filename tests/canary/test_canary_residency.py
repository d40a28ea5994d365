"""Premature sliding-window eviction (item 2 of the detection-gap campaign): a position
attention reads must hold a slot. Faults are written straight into engine state (the SWA
allocator, the scheduler's eviction policy, the req->token table), not through perturb."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_utils import make_prompts, start_decoding, tiny_engine

from kvcanary import Engine
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.explain import explain

PROMPTS = make_prompts(3, 44, 60, seed=5)
WINDOW = 32  # builtin:tiny-swa


def _finish(engine: Engine) -> dict[int, list[int]]:
    outs = {}
    while engine.has_unfinished():
        outs.update({o.rid: o.output_ids for o in engine.step()})
    return outs


@pytest.mark.parametrize("page_size", [1, 4])
def test_raw_free_swa_of_an_in_window_page_is_not_resident(page_size: int) -> None:
    engine = tiny_engine(canary=CanaryConfig(mode="log"), page_size=page_size,
                         graph_batch_sizes=())
    start_decoding(engine, PROMPTS)
    a = engine.running_requests()[0]
    row = engine.runner.req_to_token_pool.req_to_token[a.req_pool_idx]
    positions = list(range(a.kv_len - 12, a.kv_len - 12 + max(page_size, 2)))  # in the window
    full = row[positions].to(torch.int64)
    prefix_len = a.kv_len  # the next decode verifies [prefix_len - W, prefix_len)
    engine.runner.allocator.free_swa(full)  # the SWA KV of in-window tokens is gone
    engine.step()
    rows = [r for r in engine.canary.violations if "verify_not_resident" in r.fail_reasons]
    assert rows, engine.canary.violations
    assert {r.launch_tag for r in rows} == {"HEAD_K_SWA"}  # reported once per forward
    assert {r.slot_idx for r in rows} == set(full.tolist())  # names the full slots
    assert {r.position for r in rows} == set(positions)
    assert all(r.expected_aux == prefix_len for r in rows)


NO_CACHE = dict(graph_batch_sizes=(), enable_prefix_cache=False)  # requests own their prompts


def test_eviction_frontier_off_by_pages_is_detected_and_explained() -> None:
    engine = tiny_engine(canary=CanaryConfig(mode="log"), **NO_CACHE)
    clean = _finish_clean()
    start_decoding(engine, PROMPTS)
    engine.kv.spec = replace(engine.kv.spec, window=WINDOW - 12)  # evicts 3 pages too early
    outs = _finish(engine)
    rows = [r for r in engine.canary.violations if "verify_not_resident" in r.fail_reasons]
    assert rows and all(r.launch_tag == "HEAD_K_SWA" for r in rows)
    # Every reported position was inside its window: [len - W + 1, len).
    assert all(r.expected_aux - WINDOW + 1 <= r.position < r.expected_aux for r in rows)
    assert outs != clean  # the fault really changed what attention read
    lines = "\n".join(
        f"kv_canary violation: launch_tag={r.launch_tag} fail_reason={'+'.join(r.fail_reasons)} "
        f"slot_idx={r.slot_idx} position={r.position} stored_token={r.stored_token} "
        f"expected_token={r.expected_token} stored_chain_hash=0x0 expected_aux={r.expected_aux}"
        for r in rows
    )
    causes = {c["cause"] for c in explain(lines)["causes"]}
    assert causes == {"premature_window_eviction"}


def _finish_clean() -> dict[int, list[int]]:
    engine = tiny_engine(canary=CanaryConfig(mode="log"), **NO_CACHE)
    start_decoding(engine, PROMPTS)
    outs = _finish(engine)
    assert engine.canary.violations == []
    return outs


@pytest.mark.parametrize(("policy_window", "violates"), [(WINDOW - 2, False), (WINDOW - 3, True)])
def test_the_position_just_outside_what_attention_reads_may_be_evicted(
    policy_window: int, violates: bool
) -> None:
    """Position len - W is verified when resident but attention never reads it. Page 1:
    frontier = kv_len - policy_window - 1, so W - 2 frees exactly up to len - W (legal:
    silent, same tokens) and W - 3 one position more (read by attention: reported)."""
    engine = tiny_engine(canary=CanaryConfig(mode="log"), page_size=1, **NO_CACHE)
    start_decoding(engine, PROMPTS)
    engine.kv.spec = replace(engine.kv.spec, window=policy_window)
    outs = _finish(engine)
    rows = engine.canary.violations
    assert bool(rows) == violates
    assert all(r.fail_reasons == ("verify_not_resident",) for r in rows)
    assert all(r.position == r.expected_aux - WINDOW + 1 for r in rows)  # the one extra position
    if not violates:
        assert outs == _finish_clean()


@pytest.mark.parametrize("model", ["builtin:tiny-mha", "builtin:tiny-swa"])
def test_a_zeroed_req_to_token_entry_is_a_missing_slot(model: str) -> None:
    engine = tiny_engine(model=model, canary=CanaryConfig(mode="log"), graph_batch_sizes=())
    start_decoding(engine, PROMPTS)
    a = engine.running_requests()[1]
    engine.runner.req_to_token_pool.req_to_token[a.req_pool_idx, 7] = 0
    engine.step()
    rows = [r for r in engine.canary.violations if "verify_not_resident" in r.fail_reasons]
    assert [(r.launch_tag, r.slot_idx, r.position) for r in rows] == [("HEAD_K_FULL", 0, 7)]


@pytest.mark.parametrize("check", [1, 2])
def test_hosts_that_read_the_window_start_count_a_hole_there(check: int) -> None:
    """Row 1 reads positions 1..4 (prefix 5, window 4): position 1 = prefix - window is read
    by SGLang's sliding layers (``check_residency=2``, ``reads_window_start``) and not by
    ours or vLLM's (1). Its mapping is 0, as is position 3's: every planner lists position 3
    as a hole, and position 1 only where the host reads it."""
    from kvcanary.canary.plan.reference import build_plans
    from kvcanary.canary.plan.rows import HostInputs, RowPlanner
    from kvcanary.canary.plan.static import build_static_decode_plans
    from kvcanary.canary.plan.types import PlanInputs

    r2t = torch.zeros(4, 16, dtype=torch.int32)
    r2t[1, :6] = torch.tensor([11, 12, 13, 14, 15, 16])
    r2t[2, :3] = torch.tensor([21, 22, 23])
    lut = torch.arange(40)
    lut[12] = lut[14] = 0  # positions 1 and 3 of row 1: not resident
    inputs = PlanInputs(
        req_to_token=r2t, req_pool_indices=torch.tensor([1, 2, 0]),
        prefix_lens=torch.tensor([5, 2, 0]), extend_lens=torch.ones(3, dtype=torch.int64),
        input_ids=torch.tensor([7, 8, 0]), positions=torch.tensor([5, 2, 0]),
        out_cache_loc=torch.tensor([16, 23, 0]),
    )  # fmt: skip
    want = [3] if check == 1 else [1, 3]
    for backend in ("torch", "numba"):
        plans = build_plans(inputs, verify_capacity=100, window=4, lut=lut, backend=backend,
                            check_residency=check)  # fmt: skip
        assert plans.holes is not None and plans.holes[1].tolist() == want, backend
    rows = RowPlanner(verify_capacity=100, window=4, lut=lut, check_residency=check)
    holes = rows.plan(HostInputs.of(inputs)).holes
    assert holes is not None and holes[1].tolist() == want
    static = build_static_decode_plans(inputs, 8, window=4, lut=lut, check_residency=check)
    assert static.hole_rows[static.hole_mask, 2].tolist() == want
