"""The compiled CPU plan builder equals the torch builder field for field on random engine-like
batches (prefill, chunks, decode, padding rows, radix-shared prefixes, SWA LUT + window,
expected-token tables, draft offset, capacity overflow, compressed views, bad slots)."""

from __future__ import annotations

import random

import pytest
import torch
from canary_testlib import ToyKvSystem

from kvcanary.canary.kernels import numba_kernels, torch_kernels
from kvcanary.canary.plan.inputs import compress_plan_inputs
from kvcanary.canary.plan.reference import CanaryPlans, PlanInputs, build_plans
from kvcanary.canary.report.ring import ViolationRing
from kvcanary.canary.wire.constants import FailReason
from kvcanary.canary.wire.records import alloc_canary_buffer

FIELDS = {
    "verify": ("slots", "prev_slots", "positions", "expected_tokens", "enabled",
               "num_requested_entries"),
    "write": ("seed_slots", "token_starts", "num_tokens", "token_ids", "positions", "slots",
              "max_num_tokens", "total_num_tokens", "expected_token_ids", "expected_positions"),
}  # fmt: skip


def assert_same(a: CanaryPlans, b: CanaryPlans) -> None:
    for part, names in FIELDS.items():
        for name in names:
            x, y = getattr(getattr(a, part), name), getattr(getattr(b, part), name)
            if isinstance(x, torch.Tensor):
                assert isinstance(y, torch.Tensor) and x.dtype == y.dtype == torch.int64, name
                assert torch.equal(x, y), f"{part}.{name}: {x.tolist()} != {y.tolist()}"
            else:
                assert x == y, f"{part}.{name}"


def both(inputs: PlanInputs, **kw) -> None:
    assert_same(build_plans(inputs, backend="numba", **kw), build_plans(inputs, backend="torch", **kw))


def random_steps(seed: int, window: int | None) -> list[tuple[PlanInputs, torch.Tensor]]:
    rng = random.Random(seed)
    kv = ToyKvSystem(num_full_slots=200, num_rows=6, max_context_len=48, rng=rng, window=window,
                     num_swa_slots=200 if window else 0)  # fmt: skip
    out = []
    for _ in range(12):
        rows = [r for r in range(1, 6) if len(kv.tokens.get(r, [])) < 40]
        rng.shuffle(rows)
        batch = [(r, rng.choice([1, 1, rng.randint(1, 7)])) for r in rows[: rng.randint(1, 4)]]
        free = kv.free_rows()
        if free and kv.tokens and rng.random() < 0.3:  # a radix hit on another row's prefix
            donor = rng.choice(list(kv.tokens))
            kv.share_prefix(free[0], donor, rng.randint(0, len(kv.tokens[donor])))
        out.append((kv.step(batch, num_padding_rows=rng.randint(0, 2)), kv.lut.clone()))
        if window:
            kv.evict_out_of_window()
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [None, 5])
def test_random_batches_agree(seed: int, window: int | None) -> None:
    for inputs, lut in random_steps(seed, window):
        kw = dict(window=window, lut=lut) if window else {}
        both(inputs, verify_capacity=10_000, **kw)
        both(inputs, verify_capacity=3, **kw)  # overflow: verify disabled, write intact
        both(inputs, verify_capacity=10_000, kv_token_id_vs_position_offset=1, **kw)


def test_strided_compressed_views_agree() -> None:
    for inputs, _ in random_steps(7, None):
        full_slots = torch.arange(201)
        both(compress_plan_inputs(inputs, 4), verify_capacity=10_000, lut=full_slots // 4)


def test_both_reject_slots_outside_the_lut() -> None:
    inputs, _ = random_steps(1, None)[3]
    for backend in ("numba", "torch"):
        with pytest.raises(IndexError):
            build_plans(inputs, verify_capacity=100, lut=torch.zeros(4, dtype=torch.int64),
                        backend=backend)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("seed", range(3))
def test_each_builders_plans_verify_alike_with_the_reader_chain(seed: int) -> None:
    """Each builder's plans, run by its own kernels (numba, torch) with the reader chain,
    forward after forward, with a false hit injected into a row's token table: the same
    records and ring rows, and the false hits are named beyond their differing slot."""
    rng = random.Random(seed)
    sides = {b: (alloc_canary_buffer(201), ViolationRing(4096)) for b in ("numba", "torch")}
    kernels = {"numba": numba_kernels, "torch": torch_kernels}
    for inputs, _ in random_steps(seed, None):
        row, prefix = int(inputs.req_pool_indices[0]), int(inputs.prefix_lens[0])
        if prefix > 2 and inputs.expected_token_table is not None and rng.random() < 0.5:
            inputs.expected_token_table[row, rng.randrange(prefix - 1)] += 1
        for backend, (records, ring) in sides.items():
            plans = build_plans(inputs, verify_capacity=10_000, backend=backend)  # type: ignore[arg-type]
            kernels[backend].verify(records, plans.verify, ring, 0, check_token=True,
                                    reader_chain=True)  # fmt: skip
            kernels[backend].write(records, plans.write, ring, 0)
        (a, ring_a), (b, ring_b) = sides["numba"], sides["torch"]
        assert torch.equal(a, b) and ring_a.read() == ring_b.read()
    # The records agree with each other: only the reader chain names a chain mismatch.
    bits = ring_a.rows[: ring_a.num_recorded(), 7].tolist()
    chain, token = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH), int(FailReason.VERIFY_TOKEN_MISMATCH)
    assert bits and set(bits) <= {chain, token, chain | token}
    assert chain in bits, bits
