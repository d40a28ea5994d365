"""Row plans (the CPU per-forward path) against materialised plans.

A row plan holds exactly :func:`build_plans`' entries (expanded and compared field by field),
and the numba kernels over a row plan leave the same records, ring rows (same order), ring
counter and run counters as over the materialised plan, forward after forward (HEAD verify +
write, the model's KV stores, TAIL verify + write with real-KV sources), on random engine-like
batches: prefill, chunks, decode, padding rows (slot 0), radix-shared prefixes, SWA LUT with
window eviction, token tables with the draft offset, capacity overflow, compressed views,
corrupted records, KV bytes and req->token entries, false prefix hits (a row's own token
differs from its records'), and small rings that overflow, with the reader chain on and off. The
materialised numba path is itself pinned to torch and the Python reference by
test_canary_kernels_equivalence; the torch path joins here too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from canary_testlib import ToyKvSystem, force_split, make_sources

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.kernels import numba_kernels as kernels_numba
from kvcanary.canary.kernels import torch_kernels as kernels_torch
from kvcanary.canary.plan.inputs import compress_plan_inputs
from kvcanary.canary.plan.reference import CanaryPlans, PlanInputs, build_plans
from kvcanary.canary.plan.rows import HostInputs, RowPlanner
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import NO_SLOT
from kvcanary.canary.wire.constants import CanaryLaunchTag as Tag
from kvcanary.canary.wire.real_kv import RealKvSource
from kvcanary.canary.wire.records import alloc_canary_buffer, as_int64_records

# ------------------------------------------------------------------ the entries


def expand(plans: CanaryPlans) -> dict[str, list[int]]:
    """A row plan's verify entries spelled out like a VerifyPlan, plus its write plan."""
    v, w = plans.verify, plans.write
    out: dict[str, list[int]] = {"slots": [], "prev_slots": [], "positions": [], "tokens": []}
    if v.enabled:
        for r in range(v.bs):
            first, first_pos, count, first_prev = (int(x) for x in v.requests[:4, r])
            for j in range(count):
                e = first + j
                out["slots"].append(int(v.entries[0, e]))
                out["prev_slots"].append(int(v.entries[0, e - 1]) if j else first_prev)
                out["positions"].append(first_pos + j)
                out["tokens"].append(int(v.entries[1, e]) if v.has_tokens else -1)
    out["seed_slots"] = w.requests[-3, : w.bs].tolist()
    out["token_starts"] = w.requests[-2, : w.bs].tolist()
    out["num_tokens"] = w.requests[-1, : w.bs].tolist()
    out["write_slots"] = w.slots[: w.token_ids.shape[0]].tolist()
    return out


def materialised(plans: CanaryPlans) -> dict[str, list[int]]:
    v, w = plans.verify, plans.write
    return {
        "slots": v.slots.tolist(), "prev_slots": v.prev_slots.tolist(),
        "positions": v.positions.tolist(), "tokens": v.expected_tokens.tolist(),
        "seed_slots": w.seed_slots.tolist(), "token_starts": w.token_starts.tolist(),
        "num_tokens": w.num_tokens.tolist(), "write_slots": w.slots.tolist(),
    }  # fmt: skip


def random_steps(seed: int, window: int | None, num_steps: int = 12):
    """(inputs, LUT snapshot, the toy system) of consecutive forwards of a toy engine (the
    system's live LUT equals the snapshot until the next step)."""
    rng = random.Random(seed)
    kv = ToyKvSystem(num_full_slots=200, num_rows=6, max_context_len=48, rng=rng, window=window,
                     num_swa_slots=200 if window else 0)  # fmt: skip
    for _ in range(num_steps):
        rows = [r for r in range(1, 6) if len(kv.tokens.get(r, [])) < 40]
        rng.shuffle(rows)
        batch = [(r, rng.choice([1, 1, rng.randint(1, 7)])) for r in rows[: rng.randint(1, 4)]]
        free = kv.free_rows()
        if free and kv.tokens and rng.random() < 0.3:  # a radix hit on another row's prefix
            donor = rng.choice(list(kv.tokens))
            kv.share_prefix(free[0], donor, rng.randint(0, len(kv.tokens[donor])))
        yield kv.step(batch, num_padding_rows=rng.randint(0, 2)), kv.lut.clone(), kv
        if window:
            kv.evict_out_of_window()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [None, 5])
def test_row_plans_hold_the_entries_of_build_plans(seed: int, window: int | None) -> None:
    planners: dict[tuple[int, int], RowPlanner] = {}  # reused: scratch from earlier steps
    for inputs, lut, kv in random_steps(seed, window):
        host = HostInputs.of(inputs)
        for capacity, offset in ((10_000, 0), (3, 0), (10_000, 1)):  # (3: verify overflow)
            kw = dict(verify_capacity=capacity, window=window,
                      kv_token_id_vs_position_offset=offset)  # fmt: skip
            planner = planners.setdefault(
                (capacity, offset), RowPlanner(lut=kv.lut if window else None, **kw)  # type: ignore[arg-type]
            )
            rows = planner.plan(host)
            want = build_plans(inputs, lut=lut if window else None, **kw)  # type: ignore[arg-type]
            assert rows.verify.enabled == want.verify.enabled
            assert rows.verify.num_requested_entries == want.verify.num_requested_entries
            assert rows.verify.num_entries == want.verify.num_entries
            assert rows.write.max_num_tokens == want.write.max_num_tokens
            assert rows.write.total_num_tokens == want.write.total_num_tokens
            assert expand(rows) == materialised(want)


def test_compressed_views_plan_the_same_entries() -> None:
    full_slots = torch.arange(201)
    for inputs, _, _ in random_steps(7, None):
        compressed = compress_plan_inputs(inputs, 4)
        planner = RowPlanner(verify_capacity=10_000, window=None, lut=full_slots // 4)
        want = build_plans(compressed, verify_capacity=10_000, lut=full_slots // 4)
        assert expand(planner.plan(HostInputs.of(compressed))) == materialised(want)


def test_scratch_grows_on_demand_and_is_reused() -> None:
    steps = list(random_steps(3, None, num_steps=6))
    planner = RowPlanner(verify_capacity=10_000, window=None, lut=None)
    planner._requests = np.zeros((7, 1), dtype=np.int64)  # everything too small
    planner._entries = np.zeros((2, 1), dtype=np.int64)
    planner._write_slots = np.zeros(1, dtype=np.int64)
    for inputs, _, _ in steps + steps[:2]:
        want = build_plans(inputs, verify_capacity=10_000)
        assert expand(planner.plan(HostInputs.of(inputs))) == materialised(want)
    entries = planner._entries
    planner.plan(HostInputs.of(steps[0][0]))
    assert planner._entries is entries  # big enough now: no new scratch


# ------------------------------------------------------------------ the launches


@dataclass
class Side:
    """One implementation's copy of the canary state of one group."""

    head: torch.Tensor
    tail: torch.Tensor
    sources: list[RealKvSource]
    ring: ViolationRing
    counters: RunCounters

    def state(self) -> list:
        return [
            as_int64_records(self.head).tolist(), as_int64_records(self.tail).tolist(),
            [s.tensor.tolist() for s in self.sources], self.ring.rows.tolist(),
            self.ring.write_index.tolist(), self.counters.kernel_runs.tolist(),
            self.counters.slots_processed.tolist(),
        ]  # fmt: skip


def _side(rng: random.Random, num_slots: int, ring_capacity: int, sources_seed: int,
          page_size: int, read_bytes: int) -> Side:  # fmt: skip
    sources = make_sources(num_slots, random.Random(sources_seed), num_sources=rng.randint(1, 2),
                           page_size=page_size, bytes_per_token=32, read_bytes=read_bytes)  # fmt: skip
    ring = ViolationRing(ring_capacity)
    ring.write_index += 1  # an earlier violation already took row 0
    return Side(alloc_canary_buffer(num_slots), alloc_canary_buffer(num_slots), sources, ring,
                RunCounters())  # fmt: skip


def _corrupt_records(rng: random.Random, sides: list[Side], slots: list[int]) -> None:
    """The same random fault on every side, at one of ``slots`` (live ones)."""
    slot, field, value = rng.choice(slots), rng.randrange(4), rng.randrange(-9, 9)
    what = rng.randrange(3)
    for side in sides:
        if what == 0:
            as_int64_records(side.head)[slot, field] = value
        elif what == 1:
            as_int64_records(side.tail)[slot, field] = value
        else:  # a byte of the slot's KV
            s = side.sources[0]
            row, col = divmod(slot, s.page_size)
            s.tensor[row, col * s.num_bytes_per_token] ^= 0x5A


def _remap(rng: random.Random, inputs: PlanInputs, num_slots: int) -> None:
    """A req->token entry of a batch row points at another slot (a chain violation)."""
    row = int(inputs.req_pool_indices[0])
    inputs.req_to_token[row, rng.randrange(inputs.req_to_token.shape[1])] = rng.randrange(num_slots)


def _false_hit(rng: random.Random, inputs: PlanInputs) -> None:
    """A batch row's own token at a position of its prefix is not the one its records hold
    (a false prefix hit as the canary sees it: the records agree with each other, the
    reader's history differs from that position on)."""
    row, prefix = int(inputs.req_pool_indices[0]), int(inputs.prefix_lens[0])
    if inputs.expected_token_table is not None and prefix > 1:
        inputs.expected_token_table[row, rng.randrange(prefix)] += 1


def _forward(impl, side: Side, plans: CanaryPlans, kind: str, fresh_kv: dict[int, int],
             check_token: bool, reader_chain: bool = False) -> None:  # fmt: skip
    extra = {"reader_chain": True} if reader_chain else {}
    for stage in ("HEAD", "TAIL"):
        tag = Tag[f"{stage}_K_{kind}"]
        buf, sources = (side.head, []) if stage == "HEAD" else (side.tail, side.sources)
        if impl is kernels.launch:  # one call: verify then write (a row plan: one compiled call)
            kernels.launch(buf, plans.verify, plans.write, side.ring, tag, real_kv_sources=sources,
                           check_token=check_token, chain_position_assert=True,
                           verify_counters=side.counters, write_counters=side.counters,
                           **extra)  # fmt: skip
        else:
            impl.verify(buf, plans.verify, side.ring, tag, real_kv_sources=sources,
                        check_token=check_token, counters=side.counters, **extra)  # fmt: skip
            impl.write(buf, plans.write, side.ring, tag, real_kv_sources=sources,
                       chain_position_assert=True, counters=side.counters)  # fmt: skip
        if stage == "HEAD":  # attention stores this forward's KV
            for s in side.sources:
                words = s.words.view(-1)
                for slot, value in fresh_kv.items():
                    row, col = divmod(slot, s.page_size)
                    words[row * s.words.shape[1] + col * (s.num_bytes_per_token // 8)] = value


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("split", [False, True], ids=["one-thread", "split"])
@pytest.mark.parametrize("reader_chain", [False, True], ids=["", "reader-chain"])
def test_row_plan_launches_leave_the_same_state(
    seed: int, window: int | None, split: bool, reader_chain: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Materialised plans, the torch kernels, row plans and one-call launches leave the same
    records, ring rows and counters, batch after batch of faults (``split``: the row plans'
    verifies on two threads, :func:`.kernels_numba._split_rows`; ``reader_chain``: every
    verify checks against the reader's own chain too)."""
    if split:
        force_split(monkeypatch)
    rng = random.Random(1000 + seed)
    num_slots = 201
    kind = "SWA" if window else "FULL"
    ring_capacity = rng.choice([4, 64])
    check_token = rng.random() < 0.5 or reader_chain  # (the reader chain needs tokens)
    page_size, read_bytes = rng.choice([(1, 16), (2, 32), (1, 32)])
    sources_seed = rng.randrange(2**31)
    sides = {
        name: _side(random.Random(seed), num_slots, ring_capacity, sources_seed, page_size,
                    read_bytes)
        for name in ("materialised", "rows", "fused", "torch")
    }  # fmt: skip
    capacity = rng.choice([40, 10_000])
    planner = None
    for inputs, lut, kv in random_steps(seed, window, num_steps=14):
        if planner is None:
            planner = RowPlanner(verify_capacity=capacity, window=window,
                                 lut=kv.lut if window else None)  # fmt: skip
        if rng.random() < 0.2:
            _remap(rng, inputs, num_slots)
        if rng.random() < 0.3:
            _false_hit(rng, inputs)
        kw = dict(verify_capacity=capacity, window=window, lut=lut if window else None)
        try:
            want = build_plans(inputs, **kw)  # type: ignore[arg-type]
        except IndexError:  # a remap out of the LUT: both planners refuse it
            with pytest.raises(IndexError):
                planner.plan(HostInputs.of(inputs))
            continue
        live = [s for s in want.verify.slots.tolist() if s > 0]
        if live and rng.random() < 0.6:
            _corrupt_records(rng, list(sides.values()), live)
        fresh = {int(s): rng.randrange(2**62) for s in want.write.slots.tolist() if s >= 0}
        plans = {"materialised": want, "torch": build_plans(inputs, backend="torch", **kw),  # type: ignore[arg-type]
                 "rows": planner.plan(HostInputs.of(inputs))}  # fmt: skip
        plans["fused"] = plans["rows"]
        impls = {"materialised": kernels_numba, "torch": kernels_torch, "rows": kernels_numba,
                 "fused": kernels.launch}  # fmt: skip
        errors = {}
        for name, side in sides.items():
            try:
                _forward(impls[name], side, plans[name], kind, fresh, check_token, reader_chain)
            except IndexError as e:  # a remapped slot beyond the buffer: every side raises
                errors[name] = type(e)
        assert len(set(errors.values())) <= 1 and len(errors) in (0, len(sides))
        if errors:
            return
        want_state = sides["materialised"].state()
        assert sides["rows"].state() == want_state
        assert sides["torch"].state() == want_state
        assert sides["fused"].state() == want_state
    assert sides["rows"].ring.num_recorded() > 1  # the faults were seen


def _i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("threads", [2, 3])
def test_split_verify_sees_a_fault_at_every_entry_of_one_long_row(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify split among threads cuts one long row (a prefill's) into runs: a fault at
    any entry, those at the cuts included (an entry checked against its predecessor in the
    run before), gives the ring rows of the one-thread materialised verify."""
    force_split(monkeypatch)
    monkeypatch.setattr(kernels_numba, "parallel_threads", lambda: threads)
    n, num_slots = 40, 64
    slots = torch.arange(3, 3 + n)  # the row's slots, position p at slot 3 + p
    r2t = torch.zeros(2, 64, dtype=torch.int32)
    r2t[1, :n] = slots.to(torch.int32)

    fill = PlanInputs(r2t, _i64([1]), _i64([0]), _i64([n]), torch.arange(100, 100 + n),
                      torch.arange(n), slots.clone())  # fmt: skip
    decode = PlanInputs(r2t, _i64([1]), _i64([n]), _i64([1]), _i64([7]), _i64([n]), _i64([3 + n]))
    sources = make_sources(num_slots, random.Random(3), num_sources=1, page_size=1,
                           bytes_per_token=32, read_bytes=32)  # fmt: skip
    clean = alloc_canary_buffer(num_slots)
    ring = ViolationRing(4)
    kernels_numba.write(clean, build_plans(fill, verify_capacity=100).write, ring, 0,
                        real_kv_sources=sources)  # fmt: skip
    materialised = build_plans(decode, verify_capacity=100).verify
    rows = RowPlanner(verify_capacity=100, window=None, lut=None).plan(HostInputs.of(decode))
    assert rows.verify.num_entries == n
    for entry in range(n):
        for field in range(4):  # token, position, chain, real-KV fingerprint
            got, want = [], []
            for plan, out in ((rows.verify, got), (materialised, want)):
                records = clean.clone()
                as_int64_records(records)[3 + entry, field] += 1
                ring = ViolationRing(8)
                kernels_numba.verify(records, plan, ring, 5, real_kv_sources=sources,
                                     check_token=True)  # fmt: skip
                out.append(ring.rows[: ring.num_recorded()].tolist())
            assert got == want, (entry, field)
            # (a token is seen by the next entry's chain: the last one's by the next forward)
            assert want[0] or (entry, field) == (n - 1, 0)


# ------------------------------------------------------------------ errors


def _inputs(**overrides: torch.Tensor) -> HostInputs:
    r2t = torch.zeros(3, 8, dtype=torch.int32)
    r2t[1, :4] = torch.tensor([5, 6, 7, 8])
    fields = dict(req_to_token=r2t, req_pool_indices=_i64([1, 0]), prefix_lens=_i64([3, 0]),
                  extend_lens=_i64([1, 1]), input_ids=_i64([9, 0]), positions=_i64([3, 0]),
                  out_cache_loc=_i64([8, 0]))  # fmt: skip
    fields.update(overrides)
    return HostInputs(**{k: v.numpy() for k, v in fields.items()})


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (dict(prefix_lens=torch.tensor([1, 2, 3])), ValueError, "PlanInputs.prefix_lens"),
        (dict(positions=torch.tensor([1])), ValueError, "PlanInputs.positions"),
        (dict(extend_lens=torch.tensor([1, 5])), ValueError, "flat tokens"),
        (dict(req_pool_indices=torch.tensor([7, 0])), IndexError, "req_to_token"),
        (dict(prefix_lens=torch.tensor([9, 0])), IndexError, "req_to_token"),
    ],
)
def test_bad_inputs_raise_like_build_plans(overrides: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RowPlanner(verify_capacity=10, window=None, lut=None).plan(_inputs(**overrides))


def test_slots_outside_the_lut_or_the_buffer_raise_before_any_row() -> None:
    with pytest.raises(IndexError, match="LUT"):
        RowPlanner(verify_capacity=10, window=None, lut=torch.zeros(4, dtype=torch.int64)).plan(
            _inputs()
        )
    plans = RowPlanner(verify_capacity=10, window=None, lut=None).plan(_inputs())
    records = alloc_canary_buffer(7)  # slots 7 and 8 are beyond it
    ring, counters = ViolationRing(8), RunCounters()
    with pytest.raises(IndexError, match="canary buffer"):
        kernels_numba.verify(records, plans.verify, ring, 0, counters=counters)
    assert ring.num_recorded() == 0 and counters.kernel_runs.sum() == 0


def test_disabled_and_empty_plans_only_count_the_launch() -> None:
    plans = RowPlanner(verify_capacity=2, window=None, lut=None).plan(_inputs())
    assert not plans.verify.enabled and plans.verify.num_requested_entries == 3
    assert plans.verify.num_entries == 0
    records = alloc_canary_buffer(16)
    as_int64_records(records)[5] = 7  # garbage that would violate if verified
    ring, counters = ViolationRing(8), RunCounters()
    kernels_numba.verify(records, plans.verify, ring, 3, counters=counters)
    assert ring.num_recorded() == 0
    assert counters.kernel_runs[3] == 1 and counters.slots_processed[3] == 0
    assert plans.write.requests[-3, :2].tolist() == [7, NO_SLOT]  # seeds: slot of position 2


# ------------------------------------------------------------------ on the engine


def _faulty_run(monkeypatch: pytest.MonkeyPatch, backend: str, model: str) -> tuple:
    from engine_utils import make_prompts, tiny_engine

    from kvcanary import SamplingParams
    from kvcanary.canary.perturb.config import PerturbConfig
    from kvcanary.canary.perturb.manager import install_perturbation

    monkeypatch.setenv("KVCANARY_KV_CANARY_KERNEL_BACKEND", backend)
    canary = CanaryConfig(mode="log", real_data="partial", v_half=True, verify_tokens=True)
    engine = tiny_engine(model=model, canary=canary,
                         chunked_prefill_size=16, graph_batch_sizes=(1, 2, 8))  # fmt: skip
    swa = model == "builtin:tiny-swa"
    install_perturbation(engine, PerturbConfig(
        req_to_token_prob=0.1, real_kv_used_prob=0.1, real_kv_post_forward_prob=0.1,
        swa_mapping_prob=0.1 if swa else 0.0, target_group="swa" if swa else None,
        warmup_steps=3, seed=5,
    ))  # fmt: skip
    outs = engine.generate(make_prompts(5, 20, 50, shared=12, seed=4),
                           SamplingParams(max_new_tokens=24, ignore_eos=True))  # fmt: skip
    engine.canary.flush()
    stats = engine.canary.stats()
    planned_as_rows = engine.canary.single_forward_managers[0]._planners is not None
    return [o.output_ids for o in outs], engine.canary.violations, stats, planned_as_rows


@pytest.mark.parametrize("model", ["builtin:tiny-mha", "builtin:tiny-swa"])
def test_engine_row_plans_report_what_the_torch_path_reports(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    outs, rows, stats, planned_as_rows = _faulty_run(monkeypatch, "numba", model)
    ref_outs, ref_rows, ref_stats, ref_planned_as_rows = _faulty_run(monkeypatch, "torch", model)
    assert planned_as_rows and not ref_planned_as_rows
    assert len(rows) > 0
    assert (outs, rows, stats) == (ref_outs, ref_rows, ref_stats)
