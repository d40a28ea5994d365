"""numba == torch == Python reference on random records, plans, KV bytes and rings.

Worlds are legit request chains with random corruption sprinkled over records and KV bytes;
plans mix faithful entries with mutated ones (slot 0, unreachable/wrong predecessors, wrong
positions/tokens), writes mix chained seeds with bogus ones, skipped (-1), padding (0) and
duplicate slots. Small ring capacities exercise overflow. Every implementation must leave
identical records, ring rows, ring counters and run counters, with the reader chain on and
off. False-prefix-hit worlds (:func:`make_false_hit_world`): readers whose rows hold another
prompt's self-consistent records after a token of their own that differs; each must have
every slot after that token named.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import reference_kernels
import torch
from canary_testlib import IMPLS, make_sources, make_strided_sources
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_kernels import real_kv_hash, slot_hash

from kvcanary.canary.plan.types import VerifyPlan, WritePlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import CanaryLaunchTag, FailReason
from kvcanary.canary.wire.hashing import ANCHOR_HASH_I64
from kvcanary.canary.wire.real_kv import RealKvSource
from kvcanary.canary.wire.records import as_int64_records


@dataclass
class World:
    records: torch.Tensor
    sources: list[RealKvSource]
    chains: list[list[int]]  # slots of each request, position order


def make_world(rng: random.Random, num_slots: int, num_sources: int) -> World:
    slot_bytes = rng.choice([32, 32, 48])
    records = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8)
    rec = as_int64_records(records)
    page_size = rng.choice([1, 2, 4])
    bytes_per_token = rng.choice([16, 32])
    read_bytes = rng.choice([16, bytes_per_token])
    if page_size > 1 and rng.random() < 0.4:  # laid out like vLLM's CPU K
        sources = make_strided_sources(
            num_slots, rng, num_sources=num_sources, page_size=page_size,
            element_size=rng.choice([1, 2, 4, 8]), token_bytes=bytes_per_token,
            read_bytes=read_bytes,
        )  # fmt: skip
    else:
        sources = make_sources(
            num_slots, rng, num_sources=num_sources, page_size=page_size,
            bytes_per_token=bytes_per_token, read_bytes=read_bytes,
            extra_row_bytes=rng.choice([0, 16]),
        )  # fmt: skip
    free = list(range(1, num_slots))
    rng.shuffle(free)
    chains = []
    while free:
        chain, free = free[: rng.randint(1, 6)], free[rng.randint(1, 6) :]
        chains.append(chain)
        prev = ANCHOR_HASH_I64
        for pos, slot in enumerate(chain):
            record = [rng.randrange(5), pos, prev, real_kv_hash(sources, slot)]
            rec[slot, :4] = torch.tensor(record)
            prev = slot_hash(record)
    for _ in range(rng.randint(0, 3)):  # corrupt a few fields and KV bytes
        slot = rng.randrange(num_slots)
        rec[slot, rng.randrange(4)] = rng.choice([0, -1, rng.randrange(-(2**63), 2**63)])
    for s in sources:
        if rng.random() < 0.3:
            s.tensor[rng.randrange(s.tensor.shape[0]), rng.randrange(s.tensor.shape[1])] ^= 0xFF
    return World(records, sources, chains)


def make_verify_plan(rng: random.Random, w: World) -> VerifyPlan:
    rec = as_int64_records(w.records)
    n = rec.shape[0]
    entries = []
    for chain in w.chains:
        for pos in range(rng.randrange(len(chain)), len(chain)):
            entry = [chain[pos], chain[pos - 1] if pos else -1, pos, int(rec[chain[pos], 0])]
            mutation = rng.randrange(12)
            if mutation == 0:
                entry[0] = 0
            elif mutation == 1:
                entry[1] = 0
            elif mutation == 2:
                entry[1] = rng.randrange(-1, n)
            elif mutation == 3:
                entry[2] += rng.choice([-1, 1])
            elif mutation == 4:
                entry[3] = rng.choice([-1, entry[3] + 1])
            entries.append(entry)
    for _ in range(rng.randint(0, 3)):
        entries.insert(
            rng.randint(0, len(entries)), [rng.randrange(n), rng.randrange(-1, n), 0, -1]
        )
    cols = torch.tensor(entries, dtype=torch.int64).reshape(-1, 4).T
    return VerifyPlan.from_entries(cols[0], cols[1], cols[2], cols[3])


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_write_plan(rng: random.Random, w: World) -> WritePlan:
    n = w.records.shape[0]
    seeds, starts, counts, ids, positions, slots = [], [], [], [], [], []
    for _ in range(rng.randint(0, 4)):
        chain = rng.choice(w.chains)
        seed = rng.choice([chain[-1], chain[-1], -1, 0, rng.randrange(n)])
        first_pos = len(chain) if seed != -1 else 0
        num_padding = rng.randint(0, 2)  # tokens of padding rows between requests
        ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [0] * num_padding
        seeds.append(seed)
        starts.append(len(ids))
        counts.append(rng.randint(0, 5))
        for j in range(counts[-1]):
            ids.append(rng.randrange(5))
            positions.append(first_pos + j + (rng.random() < 0.15))
            slots.append(rng.choice([rng.randrange(n)] * 6 + [-1, 0]))
    expected_ids = expected_pos = None
    if rng.random() < 0.5:
        expected_ids = t([i + (rng.random() < 0.2) for i in ids])
        expected_pos = t([p + (rng.random() < 0.2) for p in positions])
    return WritePlan(
        t(seeds), t(starts), t(counts), t(ids), t(positions), t(slots),
        max(counts, default=0), sum(counts), expected_ids, expected_pos,
    )  # fmt: skip


def run(impl_name: str, w: World, vplan: VerifyPlan, wplan: WritePlan, ring_capacity: int,
        ring_start: int, check_token: bool, position_assert: bool,
        reader_chain: bool = False) -> list[list[int]]:  # fmt: skip
    """verify → write → verify again (all TAIL-like, with the world's sources); all state."""
    impl = IMPLS[impl_name]
    records = w.records.clone()
    ring = ViolationRing(ring_capacity)
    ring.write_index += ring_start  # earlier violations already filled part of the ring
    counters = RunCounters()
    extra = {"reader_chain": True} if reader_chain else {}
    impl.verify(records, vplan, ring, CanaryLaunchTag.TAIL_K_SWA, real_kv_sources=w.sources,
                check_token=check_token, counters=counters, **extra)  # fmt: skip
    impl.write(records, wplan, ring, CanaryLaunchTag.TAIL_V_FULL, real_kv_sources=w.sources,
               chain_position_assert=position_assert, counters=counters)  # fmt: skip
    impl.verify(records, vplan, ring, CanaryLaunchTag.SWEEP_K_FULL, real_kv_sources=w.sources,
                check_token=check_token, counters=counters, **extra)  # fmt: skip
    return [
        *as_int64_records(records).tolist(),
        *ring.rows.tolist(),
        ring.write_index.tolist(),
        counters.kernel_runs.tolist(),
        counters.slots_processed.tolist(),
    ]


@given(
    seed=st.integers(0, 2**32 - 1),
    num_slots=st.integers(2, 40),
    num_sources=st.integers(0, 2),
    ring_capacity=st.sampled_from([1, 3, 64, 256]),
    ring_start=st.integers(0, 3),
    check_token=st.booleans(),
    position_assert=st.booleans(),
    reader_chain=st.booleans(),
)
@settings(max_examples=120, deadline=None)
def test_implementations_agree(
    seed: int, num_slots: int, num_sources: int, ring_capacity: int, ring_start: int,
    check_token: bool, position_assert: bool, reader_chain: bool,
) -> None:  # fmt: skip
    rng = random.Random(seed)
    w = make_world(rng, num_slots, num_sources)
    vplan, wplan = make_verify_plan(rng, w), make_write_plan(rng, w)
    args = (w, vplan, wplan, ring_capacity, ring_start, check_token, position_assert,
            reader_chain)  # fmt: skip
    want = run("reference", *args)
    assert run("numba", *args) == want
    assert run("torch", *args) == want


def test_the_random_worlds_exercise_the_reader_chain() -> None:
    """The worlds above are ones where the reader chain names slots the stored chain does
    not, often, and with several chains' tails at once (so an implementation that ignored
    it, or walked only one tail, would differ from the reference)."""
    num_changed = num_multi = 0
    for seed in range(60):
        rng = random.Random(seed)
        w = make_world(rng, rng.randint(2, 40), 0)
        vplan, wplan = make_verify_plan(rng, w), make_write_plan(rng, w)
        args = (w, vplan, wplan, 256, 0, True, False)
        on, off = run("reference", *args, True), run("reference", *args, False)
        n = w.records.shape[0]
        added = {tuple(r) for r in on[n : n + 256]} - {tuple(r) for r in off[n : n + 256]}
        num_changed += on != off
        num_multi += len({r[1] for r in added}) > 1
    assert num_changed >= 20 and num_multi >= 10, (num_changed, num_multi)


@pytest.mark.parametrize("impl_name", IMPLS)
def test_out_of_range_slots_raise(impl_name: str) -> None:
    impl = IMPLS[impl_name]
    records, ring = torch.zeros(4, 32, dtype=torch.uint8), ViolationRing(4)
    bad_slot = VerifyPlan.from_entries(torch.tensor([4]), torch.tensor([-1]), torch.tensor([0]))
    bad_prev = VerifyPlan.from_entries(torch.tensor([1]), torch.tensor([9]), torch.tensor([0]))
    for plan in (bad_slot, bad_prev):
        with pytest.raises(IndexError):
            impl.verify(records, plan, ring, 0)
    one = torch.tensor([1])
    bad_write_slot = WritePlan(t([-1]), t([0]), one, one, one, t([4]), 1, 1)
    bad_token_range = WritePlan(t([-1]), t([-1]), one, one, one, one, 1, 1)
    for plan in (bad_write_slot, bad_token_range):
        with pytest.raises(IndexError):
            impl.write(records, plan, ring, 0)


@pytest.mark.parametrize("impl_name", IMPLS)
def test_disabled_verify_only_counts_the_launch(impl_name: str) -> None:
    records = torch.zeros(4, 32, dtype=torch.uint8)
    records[1] = 7  # garbage that would violate if verified
    empty = torch.zeros(0, dtype=torch.int64)
    plan = VerifyPlan(empty, empty, empty, empty, enabled=False, num_requested_entries=99)
    ring, counters = ViolationRing(4), RunCounters()
    IMPLS[impl_name].verify(records, plan, ring, 3, counters=counters)
    assert ring.num_recorded() == 0
    assert counters.kernel_runs[3] == 1 and counters.slots_processed[3] == 0


@dataclass
class FalseHitWorld:
    records: torch.Tensor
    sources: list[RealKvSource]
    verify: VerifyPlan  # every reader's row, in order, with its own tokens
    named: list[int]  # the slots the reader chain must name (in entry order)
    named_without: list[int]  # those the stored chain alone names


def make_false_hit_world(rng: random.Random, num_sources: int) -> FalseHitWorld:
    """Donor prompts whose records a write laid down (chained, fingerprinted), and readers
    that each read one donor's first slots as their prefix with their own tokens: equal to
    the donor's up to a differing token at a random position (or none: a true hit), then
    the donor's again or not. The stored chains agree with each other, so without the
    reader chain only the differing tokens' slots fail; with it every slot from the first
    differing one on (its KV was computed after the donor's token, not the reader's).
    Some readers' rows start at a position > 0 (an SWA window: predecessor given), some
    entries have no expected token (-1: it ends the reader's chain when it fails)."""
    num_slots = 160
    records = torch.zeros(num_slots, 32, dtype=torch.uint8)
    sources = make_sources(num_slots, rng, num_sources=num_sources, page_size=rng.choice([1, 4]),
                           bytes_per_token=16, read_bytes=16)  # fmt: skip
    free = list(range(1, num_slots))
    rng.shuffle(free)
    donors: list[tuple[list[int], list[int]]] = []  # (slots, tokens)
    seeds, starts, counts, ids, positions, slots = [], [], [], [], [], []
    for _ in range(rng.randint(2, 5)):
        length = rng.randint(2, 24)
        chain, free = free[:length], free[length:]
        tokens = [rng.randrange(4) for _ in range(length)]
        donors.append((chain, tokens))
        seeds.append(-1)
        starts.append(len(ids))
        counts.append(length)
        ids += tokens
        positions += list(range(length))
        slots += chain
    write = WritePlan(t(seeds), t(starts), t(counts), t(ids), t(positions), t(slots),
                      max(counts), sum(counts))  # fmt: skip
    reference_kernels.write(records, write, ViolationRing(1), 0, real_kv_sources=sources)
    entries: list[list[int]] = []
    named: list[int] = []
    named_without: list[int] = []
    for _ in range(rng.randint(1, 6)):
        chain, tokens = rng.choice(donors)
        hit_len = rng.randint(1, len(chain))
        first = rng.choice([0, 0, rng.randrange(hit_len)])  # the row's first verified position
        differs = rng.choice([None, rng.randrange(first, hit_len)])
        mine = list(tokens[:hit_len])
        unchecked = rng.random() < 0.3  # one entry without an expected token
        blind = rng.randrange(first, hit_len) if unchecked else -1
        for p in range(first, hit_len):
            if differs is not None and (p == differs or (p > differs and rng.random() < 0.2)):
                mine[p] = tokens[p] + 1 + rng.randrange(3)
        if first and entries:  # padding: its predecessor is not the row before's last slot
            entries.append([0, 0, 0, -1])
        row_named = False
        for p in range(first, hit_len):
            token = -1 if p == blind else mine[p]
            entries.append([chain[p], chain[p - 1] if p else -1, p, token])
            token_bad = token != -1 and token != tokens[p]
            if token_bad:
                named_without.append(chain[p])
            if p == blind and row_named:
                named.append(chain[p])  # its stored chain is not the reader's: named, then
                row_named = False  # the reader's history is unknown: the chain ends here
            elif token_bad or row_named:
                named.append(chain[p])
                row_named = token != -1
    cols = torch.tensor(entries, dtype=torch.int64).reshape(-1, 4).T
    verify = VerifyPlan.from_entries(cols[0], cols[1], cols[2], cols[3])
    return FalseHitWorld(records, sources, verify, named, named_without)


def verify_false_hit(impl_name: str, w: FalseHitWorld, reader_chain: bool,
                     ring_capacity: int = 512) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """One verify of ``w`` (tokens checked); the ring's rows, counters and records."""
    records, ring, counters = w.records.clone(), ViolationRing(ring_capacity), RunCounters()
    IMPLS[impl_name].verify(records, w.verify, ring, CanaryLaunchTag.HEAD_K_FULL,
                            real_kv_sources=w.sources, check_token=True, counters=counters,
                            reader_chain=reader_chain)  # fmt: skip
    rows = ring.rows[: min(ring.num_recorded(), ring_capacity)].tolist()
    state = [*as_int64_records(records).tolist(), *ring.rows.tolist(), ring.write_index.tolist(),
             counters.kernel_runs.tolist(), counters.slots_processed.tolist()]  # fmt: skip
    return state, [r[1] for r in rows]


@given(seed=st.integers(0, 2**32 - 1), num_sources=st.integers(0, 2))
@settings(max_examples=60, deadline=None)
def test_false_prefix_hits_name_every_slot_after_the_differing_token(
    seed: int, num_sources: int
) -> None:
    """Every implementation names exactly the slots after each reader's first differing
    token (and the same rows, counters and records); without the reader chain only the
    differing tokens' own slots."""
    w = make_false_hit_world(random.Random(seed), num_sources)
    for reader_chain, want_named in ((True, w.named), (False, w.named_without)):
        want, named = verify_false_hit("reference", w, reader_chain)
        assert named == want_named
        for impl in ("numba", "torch"):
            assert verify_false_hit(impl, w, reader_chain)[0] == want, (impl, reader_chain)


def test_false_hit_worlds_name_more_with_the_reader_chain() -> None:
    """Most false-hit worlds name slots with the reader chain that the stored chain alone
    does not (the test above would catch an implementation without it)."""
    worlds = [make_false_hit_world(random.Random(seed), 0) for seed in range(40)]
    assert sum(len(w.named) > len(w.named_without) for w in worlds) >= 20


def test_reader_chain_names_every_slot_after_a_false_hit() -> None:
    """Request B reads request A's three slots as its prefix, but A's middle token is not
    B's: the stored chains agree with each other, so only the middle slot fails without the
    reader chain; with it, the slot after it too (its KV was computed after A's token)."""
    records = torch.zeros(8, 32, dtype=torch.uint8)
    rec = as_int64_records(records)
    prev = ANCHOR_HASH_I64
    for pos, (slot, token) in enumerate([(1, 10), (2, 11), (3, 12)]):  # A's chain
        rec[slot, :4] = torch.tensor([token, pos, prev, 0])
        prev = slot_hash([token, pos, prev])
    plan = VerifyPlan.from_entries(t([1, 2, 3]), t([-1, 1, 2]), t([0, 1, 2]), t([10, 99, 12]))
    for reader_chain, want in ((False, [2]), (True, [2, 3])):
        for impl in IMPLS:
            ring = ViolationRing(8)
            IMPLS[impl].verify(records, plan, ring, 0, check_token=True,
                               reader_chain=reader_chain)  # fmt: skip
            rows = ring.rows[: int(ring.write_index[0])]
            assert rows[:, 1].tolist() == want, (impl, reader_chain, rows.tolist())
            if reader_chain:  # slot 3: chain only; expected = B's chain, not the stored one
                assert int(rows[1, 7]) == int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
                assert int(rows[1, 6]) == slot_hash([99, 1, slot_hash([10, 0, ANCHOR_HASH_I64])])
