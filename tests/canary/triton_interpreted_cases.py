"""The Triton canary kernels and plan builder, run by Triton's interpreter on CPU tensors, equal
the numba and torch ones bit for bit: records, ring rows, ring counters, run counters, plans
and holes. Ring rows are compared in order, not normalised: the Triton kernels fill the
ring by prefix sums in entry order, never by racing atomics, so the order is the contract's.

Not collected by a plain ``pytest tests``: ``TRITON_INTERPRET=1`` must be set before triton
is first imported (``@triton.jit`` reads it when it decorates, and triton's own library
functions such as ``tl.cumsum`` are jitted when ``triton.language`` is imported), so
``test_canary_triton.py`` runs this module in a fresh process with it set. Two kinds of
cases:

* random worlds (:mod:`test_canary_kernels_equivalence`): legit chains with corrupted
  fields and KV bytes, mutated verify entries, bogus/duplicate/skipped write slots, seeds
  this launch stores to (remapped entries), up to 4 real-KV sources (contiguous, or strided
  like vLLM's CPU K), tiny rings, the reader chain on or off; and its false-prefix-hit
  worlds (every slot after a reader's differing token named), also with 4-entry verify
  blocks, so the reader chain's scans and walks cross blocks;
* engine-like runs (:class:`canary_testlib.ToyKvSystem`): prefill, chunked prefill, decode,
  padding rows, radix-shared prefixes, finished requests, FULL and SWA groups (full->SWA
  LUT, window eviction), K and V halves, real data none / partial / all, page size 1 and
  > 1, token checks, and injected corruptions of records, KV bytes, req->token entries, the
  LUT (holes), write inputs and positions, each forward planned by all three builders and
  run HEAD + TAIL by all three kernel sets, every verify with the reader chain (as the
  forward manager runs them).

By hand: ``TRITON_INTERPRET=1 pytest tests/canary/triton_interpreted_cases.py``. With
``KVCANARY_TEST_TRITON_LAUNCHES=PATH`` every kernel variant launched (kernel, argument
types, constexprs) is written to PATH as JSON, for the ahead-of-time CUDA compile check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest
import torch
from canary_testlib import (
    IMPLS,
    ToyKvSystem,
    make_sources,
    make_strided_sources,
    store_kv,
    written_fingerprints,
)
from test_canary_kernels_equivalence import (
    make_false_hit_world,
    make_verify_plan,
    make_world,
    make_write_plan,
    run,
    verify_false_hit,
)
from test_canary_plan_backends import assert_same
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import mangle_type

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.kernels import numba_kernels as kernels_numba
from kvcanary.canary.kernels import torch_kernels as kernels_torch
from kvcanary.canary.kernels import triton_kernels as kernels_triton
from kvcanary.canary.plan import triton_plan as plan_triton
from kvcanary.canary.plan.reference import build_plans
from kvcanary.canary.plan.rows import HostInputs, RowPlanner
from kvcanary.canary.plan.types import CanaryPlans, PlanInputs, VerifyPlan, WritePlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import KvHalf, LaunchStage, PoolKind, launch_tag
from kvcanary.canary.wire.real_kv import RealKvSource
from kvcanary.canary.wire.records import alloc_canary_buffer, as_int64_records

if not (kernels_triton.is_interpreted() and plan_triton.is_interpreted()):
    raise RuntimeError(
        "run with TRITON_INTERPRET=1 set before triton is imported (test_canary_triton.py does)"
    )


@pytest.fixture(autouse=True, scope="module")
def record_launches() -> Iterator[None]:
    """Write every launched kernel variant to $KVCANARY_TEST_TRITON_LAUNCHES (if set)."""
    path = os.environ.get("KVCANARY_TEST_TRITON_LAUNCHES")
    if not path:
        yield
        return
    seen: dict[str, tuple] = {}
    orig = InterpretedFunction.run

    def run_and_record(self, *args, grid, warmup, **kwargs):
        fixed = set(self.kwargs.get("do_not_specialize") or ())  # as a compiled launch types them
        sig = {n: mangle_type(a, n not in fixed)
               for n, a in zip(self.arg_names, args, strict=False)}  # fmt: skip
        consts = {n: a for n, a in zip(self.arg_names, args, strict=False) if sig[n] == "constexpr"}
        sig |= {k: "constexpr" for k in kwargs}
        consts |= kwargs
        key = json.dumps([self.fn.__name__, sorted(consts.items())])
        seen.setdefault(key, (self.fn.__module__, self.fn.__name__, sig, consts))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run_and_record
    try:
        yield
    finally:
        InterpretedFunction.run = orig
        with open(path, "w") as f:
            json.dump(list(seen.values()), f)


NUM_WORLD_CASES = 100
KERNEL_SETS = {"numba": kernels_numba, "torch": kernels_torch, "triton": kernels_triton}


def _counted(name: str, num_cases: int) -> None:
    print(f"{name}: {num_cases} random cases compared (triton == numba == torch)")


def test_kernels_agree_on_random_worlds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(IMPLS, "triton", kernels_triton)
    for seed in range(NUM_WORLD_CASES):
        rng = random.Random(seed)
        w = make_world(rng, rng.randint(2, 40), rng.randint(0, 4))
        vplan, wplan = make_verify_plan(rng, w), make_write_plan(rng, w)
        args = (w, vplan, wplan, rng.choice([1, 3, 64, 256]), rng.randint(0, 3),
                rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5)  # fmt: skip
        want = run("numba", *args)
        assert run("torch", *args) == want, f"seed {seed}"
        assert run("triton", *args) == want, f"seed {seed}"
    _counted("random worlds", NUM_WORLD_CASES)


NUM_FALSE_HIT_CASES = 30


def test_false_prefix_hits_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slot after a reader's differing token is named, by the Triton verify as by
    numba (rows, counters, records equal); every other world with 4-entry blocks (a row's
    scan back to its segment's start and its walk cross blocks; a walk adds violations to
    other blocks' counts)."""
    monkeypatch.setitem(IMPLS, "triton", kernels_triton)
    for seed in range(NUM_FALSE_HIT_CASES):
        rng = random.Random(f"false-hit/{seed}")
        w = make_false_hit_world(rng, rng.randint(0, 2))
        monkeypatch.setattr(kernels_triton, "_BLOCK", 4 if seed % 2 else 256)
        for reader_chain, want_named in ((True, w.named), (False, w.named_without)):
            capacity = rng.choice([3, 512])
            want, named = verify_false_hit("numba", w, reader_chain, capacity)
            assert verify_false_hit("torch", w, reader_chain, capacity)[0] == want
            assert verify_false_hit("triton", w, reader_chain, capacity)[0] == want, seed
            if capacity == 512:
                assert named == want_named, (seed, reader_chain)
    _counted("false-hit worlds", NUM_FALSE_HIT_CASES)


def test_strided_fingerprints_are_those_of_the_gathered_bytes() -> None:
    """Field 3 of strided sources (vLLM's CPU K layout), fp32 / bf16 / fp16 elements, page
    size 16, partial and whole windows: the fold of the gathered bytes as a contiguous copy,
    as the numba kernels store it."""
    from test_canary_strided_sources import _cpu_kv, _k_copy, _k_source

    slots = [1, 5, 16, 17, 40, 95]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kv = _cpu_kv(dtype, 16, 32, seed=11)
        for read_bytes in (16, 32 * kv.element_size()):
            strided, copy = _k_source(kv, read_bytes), _k_copy(kv, read_bytes)
            want = written_fingerprints(kernels_numba, [copy], slots)
            assert written_fingerprints(kernels_triton, [strided], slots) == want, dtype
            assert written_fingerprints(kernels_triton, [copy, strided], slots) == \
                written_fingerprints(kernels_numba, [copy, copy], slots), dtype


# ------------------------------------------------------------------ engine-like runs


@dataclasses.dataclass(frozen=True)
class Scenario:
    window: int | None  # None: FULL group only; else FULL + SWA groups
    page_size: int  # of the real-KV sources
    real_data: str  # none | partial | all
    v_half: bool
    verify_tokens: bool


SCENARIOS = {
    "full-p1-none": Scenario(None, 1, "none", False, False),
    "full-p4-partial-v": Scenario(None, 4, "partial", True, True),
    "swa-p1-all-v": Scenario(5, 1, "all", True, True),
    "swa-p2-partial": Scenario(4, 2, "partial", False, False),
}
SEEDS_PER_SCENARIO = 2
STEPS = 8
NUM_FULL_SLOTS, NUM_SWA_SLOTS, NUM_ROWS, MAX_CONTEXT_LEN = 360, 360, 7, 40


@dataclasses.dataclass
class Group:
    kind: PoolKind
    num_slots: int
    window: int | None
    sources: dict[KvHalf, list[RealKvSource]]  # fingerprinted at TAIL


@dataclasses.dataclass
class CanaryState:
    """One kernel set's canary: HEAD/TAIL x K/V record buffers per group, ring, counters."""

    records: dict[tuple[PoolKind, LaunchStage, KvHalf], torch.Tensor]
    ring: ViolationRing
    verify_counters: RunCounters
    write_counters: RunCounters

    def snapshot(self) -> list[list[int]]:
        out = [as_int64_records(r).tolist() for _, r in sorted(self.records.items())]
        return [*out, self.ring.rows.tolist(), self.ring.write_index.tolist(),
                self.verify_counters.kernel_runs.tolist(),
                self.verify_counters.slots_processed.tolist(),
                self.write_counters.kernel_runs.tolist(),
                self.write_counters.slots_processed.tolist()]  # fmt: skip


def _plans(builder: str, inputs: PlanInputs, group: Group, lut: torch.Tensor | None,
           offset: int) -> CanaryPlans:  # fmt: skip
    if builder == "triton":
        return plan_triton.build_plans_triton(inputs, 2_000, group.window, lut, offset)
    return build_plans(inputs, verify_capacity=2_000, window=group.window, lut=lut,
                       kv_token_id_vs_position_offset=offset, backend=builder)  # fmt: skip


def _assert_same_plans(a: CanaryPlans, b: CanaryPlans) -> None:
    assert_same(a, b)
    assert (a.holes is None) == (b.holes is None)
    if a.holes is not None and b.holes is not None:
        assert torch.equal(torch.as_tensor(a.holes), b.holes)


def _launch(state: CanaryState, impl: ModuleType, group: Group, stage: LaunchStage,
            plans: CanaryPlans, halves: list[KvHalf], check_token: bool) -> None:  # fmt: skip
    assert isinstance(plans.verify, VerifyPlan) and isinstance(plans.write, WritePlan)
    for half in halves:
        tag = int(launch_tag(group.kind, stage, half))
        records = state.records[group.kind, stage, half]
        sources = group.sources[half] if stage == LaunchStage.TAIL else []
        impl.verify(records, plans.verify, state.ring, tag, real_kv_sources=sources,
                    check_token=check_token, counters=state.verify_counters,
                    reader_chain=True)  # fmt: skip
        impl.write(records, plans.write, state.ring, tag, real_kv_sources=sources,
                   chain_position_assert=True, counters=state.write_counters)  # fmt: skip


def _next_batch(kv: ToyKvSystem, rng: random.Random) -> list[tuple[int, int]]:
    """Prefill chunks for new rows, decode or chunked prefill for running ones."""
    for row in list(kv.tokens):
        if len(kv.tokens[row]) > MAX_CONTEXT_LEN - 12 or rng.random() < 0.08:
            kv.finish(row)  # its records stay behind, stale, as in a real pool
    free = kv.free_rows()
    if free and kv.tokens and rng.random() < 0.3:  # a radix hit on another row's prefix
        donor = rng.choice(list(kv.tokens))
        kv.share_prefix(free[0], donor, rng.randint(1, len(kv.tokens[donor])))
    rows = list(range(1, NUM_ROWS))
    rng.shuffle(rows)
    budget = min(len(kv.free_full), len(kv.free_swa) if kv.window else len(kv.free_full))
    batch = []
    for row in rows[: rng.randint(1, 4)]:
        new = rng.randint(3, 10) if row not in kv.tokens else rng.choice([1, 1, rng.randint(2, 6)])
        new = min(new, budget)
        if new:
            batch.append((row, new))
            budget -= new
    return batch


def _corrupt(rng: random.Random, kv: ToyKvSystem, groups: list[Group],
             states: list[CanaryState], inputs: PlanInputs) -> PlanInputs:  # fmt: skip
    """One injected fault, the same in every kernel set's canary (or in the shared KV,
    req->token table, LUT or this forward's inputs)."""
    fault = rng.choice(["none", "none", "record", "kv_byte", "remap", "lut_hole", "write_input",
                        "position"])  # fmt: skip
    if fault == "record":
        key = rng.choice(sorted(states[0].records))
        slot = rng.randrange(1, states[0].records[key].shape[0])
        field, value = rng.randrange(4), rng.choice([0, -1, rng.randrange(-(2**63), 2**63)])
        for state in states:
            as_int64_records(state.records[key])[slot, field] = value
    elif fault == "kv_byte":
        sources = [s for g in groups for half in g.sources.values() for s in half]
        if sources:
            s = rng.choice(sources)
            s.tensor[rng.randrange(s.tensor.shape[0]), rng.randrange(s.tensor.shape[1])] ^= 0x5A
    elif fault == "remap" and kv.tokens:
        row = rng.choice(list(kv.tokens))
        pos = rng.randrange(len(kv.tokens[row]))
        kv.req_to_token[row, pos] = rng.randrange(1, NUM_FULL_SLOTS)
    elif fault == "lut_hole" and kv.window and kv.tokens:
        row = rng.choice(list(kv.tokens))
        pos = rng.randrange(max(0, len(kv.tokens[row]) - kv.window), len(kv.tokens[row]))
        kv.lut[int(kv.req_to_token[row, pos])] = 0
    elif fault in ("write_input", "position") and inputs.input_ids.shape[0]:
        i = rng.randrange(inputs.input_ids.shape[0])
        if fault == "write_input":
            ids = inputs.input_ids.clone()
            ids[i] += 1  # expected_input_ids keep the right token
            return dataclasses.replace(inputs, input_ids=ids)
        positions = inputs.positions.clone()
        positions[i] += rng.choice([-1, 1])
        return dataclasses.replace(inputs, positions=positions)
    return inputs


def _make_groups(sc: Scenario, rng: random.Random) -> list[Group]:
    specs = [(PoolKind.FULL, NUM_FULL_SLOTS, None)]
    if sc.window is not None:
        specs.append((PoolKind.SWA, NUM_SWA_SLOTS, sc.window))
    groups = []
    for kind, num_slots, window in specs:
        sources: dict[KvHalf, list[RealKvSource]] = {}
        for half in (KvHalf.K, KvHalf.V):
            bytes_per_token = rng.choice([16, 32, 48])
            read_bytes = {"none": 0, "partial": 16, "all": bytes_per_token}[sc.real_data]
            if not read_bytes:
                sources[half] = []
            elif sc.page_size > 1 and half == KvHalf.K:  # laid out like vLLM's CPU K
                sources[half] = make_strided_sources(
                    num_slots, rng, num_sources=rng.randint(1, 2), page_size=sc.page_size,
                    element_size=rng.choice([1, 2, 4, 8]), token_bytes=bytes_per_token,
                    read_bytes=read_bytes,
                )  # fmt: skip
            else:
                sources[half] = make_sources(
                    num_slots, rng, num_sources=rng.randint(1, 2), page_size=sc.page_size,
                    bytes_per_token=bytes_per_token, read_bytes=read_bytes,
                    extra_row_bytes=rng.choice([0, 16]),
                )  # fmt: skip
        groups.append(Group(kind, num_slots, window, sources))
    return groups


@pytest.mark.parametrize("name", SCENARIOS)
def test_engine_like_runs_agree(name: str) -> None:
    sc = SCENARIOS[name]
    halves = [KvHalf.K, KvHalf.V] if sc.v_half else [KvHalf.K]
    num_cases = 0
    for seed in range(SEEDS_PER_SCENARIO):
        rng = random.Random(f"{name}/{seed}")
        kv = ToyKvSystem(num_full_slots=NUM_FULL_SLOTS, num_rows=NUM_ROWS,
                         max_context_len=MAX_CONTEXT_LEN, rng=rng, window=sc.window,
                         num_swa_slots=NUM_SWA_SLOTS if sc.window else 0)  # fmt: skip
        groups = _make_groups(sc, rng)
        ring_capacity = rng.choice([8, 1024])
        states = {
            impl: CanaryState(
                {(g.kind, stage, half): alloc_canary_buffer(g.num_slots)
                 for g in groups for stage in (LaunchStage.HEAD, LaunchStage.TAIL)
                 for half in halves},
                ViolationRing(ring_capacity), RunCounters(), RunCounters(),
            )  # fmt: skip
            for impl in KERNEL_SETS
        }
        offset = rng.choice([0, 0, 1])
        for _ in range(STEPS):
            batch = _next_batch(kv, rng)
            inputs = kv.step(batch, num_padding_rows=rng.randint(0, 2))
            if not sc.verify_tokens:
                inputs = dataclasses.replace(inputs, expected_token_table=None,
                                             expected_token_lens=None)  # fmt: skip
            inputs = _corrupt(rng, kv, groups, list(states.values()), inputs)
            plans: dict[str, list[CanaryPlans]] = {}
            for impl in KERNEL_SETS:  # each kernel set runs on its own builder's plans
                plans[impl] = [_plans(impl, inputs, g, kv.lut if g.window else None, offset)
                               for g in groups]  # fmt: skip
                for mine, numba_plans in zip(plans[impl], plans["numba"], strict=True):
                    _assert_same_plans(numba_plans, mine)
            for impl, state in states.items():
                for g, p in zip(groups, plans[impl], strict=True):
                    if p.holes is not None:
                        tag = int(launch_tag(g.kind, LaunchStage.HEAD, KvHalf.K))
                        state.ring.append_holes(tag, p.holes)
                    _launch(state, KERNEL_SETS[impl], g, LaunchStage.HEAD, p, halves,
                            sc.verify_tokens)  # fmt: skip
            # attention stores this forward's KV (the LUT maps the SWA group's slots)
            full_slots = inputs.out_cache_loc.tolist()
            for g in groups:
                slots = [int(kv.lut[s]) for s in full_slots] if g.window else full_slots
                for half in halves:
                    store_kv(g.sources[half], [s for s in slots if s > 0], rng)
            for impl, state in states.items():
                for g, p in zip(groups, plans[impl], strict=True):
                    _launch(state, KERNEL_SETS[impl], g, LaunchStage.TAIL, p, halves,
                            sc.verify_tokens)  # fmt: skip
            want = states["numba"].snapshot()
            assert states["torch"].snapshot() == want
            assert states["triton"].snapshot() == want
            num_cases += 1
            if sc.window:
                kv.evict_out_of_window()
        assert states["numba"].ring.num_recorded() > 0  # the faults were seen
    _counted(f"engine-like {name}", num_cases)


# ------------------------------------------------------------------ errors and dispatch


def _tiny_world() -> tuple[torch.Tensor, ViolationRing, RunCounters]:
    records = torch.zeros(6, 32, dtype=torch.uint8)
    as_int64_records(records)[1:, :] = torch.arange(20).reshape(5, 4)
    ring = ViolationRing(4)
    ring.write_index += 1
    return records, ring, RunCounters()


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_out_of_range_raises_before_any_change() -> None:
    """An out-of-range index leaves records, ring and counters as they were, and the next
    launch works (status cleared, last-writer marks all released)."""
    source = make_sources(6, random.Random(0), num_sources=1)[0]
    small_source = RealKvSource(source.tensor[:3], 1, 16, 16)  # slots 0..2
    one = t([1])
    bad_launches = [
        ("verify", VerifyPlan.from_entries(t([2, 6]), t([1, -1]), t([0, 0])), []),
        ("verify", VerifyPlan.from_entries(t([2, 3]), t([1, 9]), t([0, 0])), []),
        ("verify", VerifyPlan.from_entries(t([2, 4]), t([1, 3]), t([0, 0])), [small_source]),
        ("write", WritePlan(t([1, -1]), t([0, 1]), t([1, 1]), t([5, 5]), t([9, 9]),
                            t([3, 6]), 1, 2), []),  # fmt: skip
        ("write", WritePlan(t([7]), t([0]), one, one, one, one, 1, 1), []),  # bad seed
        ("write", WritePlan(t([-1]), t([1]), one, one, one, one, 1, 1), []),  # bad token range
        ("write", WritePlan(t([-1, -1]), t([0, 0]), t([1, 1]), one, one, t([4]), 1, 2),
         [small_source]),  # fmt: skip
    ]
    for kind, plan, sources in bad_launches:
        records, ring, counters = _tiny_world()
        before = (records.clone(), ring.rows.clone(), ring.write_index.clone(),
                  counters.kernel_runs.clone())  # fmt: skip
        with pytest.raises(IndexError):
            getattr(kernels_triton, kind)(records, plan, ring, 3, real_kv_sources=sources,
                                          counters=counters)  # fmt: skip
        after = (records, ring.rows, ring.write_index, counters.kernel_runs)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), (kind, plan)
    state = kernels_triton._states[torch.device("cpu")]
    assert int(state.status.item()) == 0 and bool((state.last == -1).all())
    records, ring, counters = _tiny_world()
    kernels_triton.write(records, WritePlan(t([-1]), t([0]), one, t([5]), t([0]), t([2]), 1, 1),
                         ring, 3, counters=counters)  # fmt: skip
    assert as_int64_records(records)[2, :2].tolist() == [5, 0]


def test_write_total_smaller_than_counts_is_refused() -> None:
    records, ring, _ = _tiny_world()
    plan = WritePlan(t([-1]), t([0]), t([2]), t([5, 5]), t([0, 1]), t([2, 3]), 2, 1)
    with pytest.raises(ValueError, match="total_num_tokens"):
        kernels_triton.write(records, plan, ring, 0)


def test_plan_builder_errors_match() -> None:
    kv = ToyKvSystem(num_full_slots=40, num_rows=4, max_context_len=16, rng=random.Random(3))
    kv.step([(1, 5), (2, 3)])
    inputs = kv.step([(1, 1), (2, 2)])
    bad_row = dataclasses.replace(inputs, req_pool_indices=t([1, 9]))
    bad_prefix = dataclasses.replace(inputs, prefix_lens=t([5, 17]))
    overrun = dataclasses.replace(inputs, extend_lens=t([1, 9]))
    cases = [
        (inputs, torch.zeros(4, dtype=torch.int64), IndexError),  # slots outside the LUT
        (bad_row, None, IndexError),
        (bad_prefix, None, IndexError),
        (overrun, None, ValueError),
    ]
    for case_inputs, lut, error in cases:
        for builder in ("numba", "torch", "triton"):
            with pytest.raises(error):
                _plans(builder, case_inputs, Group(PoolKind.FULL, 40, None, {}), lut, 0)


def test_dispatch() -> None:
    records, ring, _ = _tiny_world()
    plan = VerifyPlan.from_entries(t([2, 3]), t([1, 2]), t([1, 7]))
    kernels.verify(records, plan, ring, 5, backend="triton")  # the interpreted kernels
    want_records, want_ring, _ = _tiny_world()
    kernels_numba.verify(want_records, plan, want_ring, 5)
    assert ring.num_recorded() == 3 and ring.read() == want_ring.read()
    cpu, cuda = (SimpleNamespace(device=torch.device(d)) for d in ("cpu", "cuda"))
    assert kernels._module(cpu, "auto", plan) is kernels_numba
    assert kernels._module(cuda, "auto", plan) is kernels_triton
    assert kernels._module(cuda, "torch", plan) is kernels_torch
    kv = ToyKvSystem(num_full_slots=20, num_rows=3, max_context_len=8, rng=random.Random(0))
    kv.step([(1, 3)])
    row_plans = RowPlanner(verify_capacity=8, window=None, lut=None).plan(
        HostInputs.of(kv.step([(1, 1)]))
    )
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="row plan"):
            kernels.verify(records, row_plans.verify, ring, 0, backend=backend)


def test_triton_missing_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_installed", lambda: False)
    with pytest.raises(ValueError, match=r"triton.*pip install 'kvcanary\[gpu\]'"):
        CanaryConfig(backend="triton")
    with pytest.raises(ValueError, match=r"pip install 'kvcanary\[gpu\]'"):
        kernels.triton_kernels()
    plan = VerifyPlan.from_entries(t([1]), t([-1]), t([0]))
    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert kernels._module(cuda, "auto", plan) is kernels_torch


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    records, ring, _ = _tiny_world()
    monkeypatch.setattr(kernels_triton, "is_interpreted", lambda: False)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        kernels_triton.verify(records, VerifyPlan.from_entries(t([1]), t([-1]), t([0])), ring, 0)
