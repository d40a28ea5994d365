"""Kernel semantics on every implementation: clean runs are silent, and each single corruption
yields exactly the expected fail-reason bits in exactly the expected ring rows."""

from __future__ import annotations

import random

import pytest
import torch
from canary_testlib import IMPLS, ToyKvSystem, make_sources, store_kv
from reference_kernels import slot_hash

from kvcanary.canary.plan.reference import PlanInputs, build_plans
from kvcanary.canary.plan.types import VerifyPlan, WritePlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import CanaryLaunchTag as Tag
from kvcanary.canary.wire.constants import FailReason as FR
from kvcanary.canary.wire.hashing import ANCHOR_HASH, to_i64
from kvcanary.canary.wire.real_kv import RealKvSource
from kvcanary.canary.wire.records import alloc_canary_buffer, as_int64_records, read_record
from kvcanary.canary.wire.violation import ViolationRecord

pytestmark = pytest.mark.parametrize("impl_name", IMPLS)


def run_forward(impl_name: str, inputs: PlanInputs, head: torch.Tensor, tail: torch.Tensor,
                sources: list[RealKvSource], ring: ViolationRing, counters: RunCounters,
                on_forward, *, window: int | None = None, lut: torch.Tensor | None = None,
                kind: str = "FULL") -> int:  # fmt: skip
    """HEAD verify+write, the model's KV stores, TAIL verify+write: one group, one forward.

    Returns the entries each stage processed (verify entries + tokens written).
    """
    impl = IMPLS[impl_name]
    plans = build_plans(inputs, verify_capacity=10_000, window=window, lut=lut)
    for stage, buf, srcs in (("HEAD", head, []), ("TAIL", tail, sources)):
        tag = Tag[f"{stage}_K_{kind}"]
        impl.verify(buf, plans.verify, ring, tag, real_kv_sources=srcs, check_token=True,
                    counters=counters)  # fmt: skip
        impl.write(buf, plans.write, ring, tag, real_kv_sources=srcs, chain_position_assert=True,
                   counters=counters)  # fmt: skip
        if stage == "HEAD":
            on_forward(plans.write.slots[plans.write.slots > 0].tolist())
    return plans.verify.num_entries + plans.write.total_num_tokens


def test_full_pool_round_trip_is_silent(impl_name: str) -> None:
    rng = random.Random(0)
    kv = ToyKvSystem(num_full_slots=64, num_rows=6, max_context_len=24, rng=rng)
    head, tail = alloc_canary_buffer(64), alloc_canary_buffer(64)
    sources = make_sources(64, rng, num_sources=2, page_size=2, bytes_per_token=32, read_bytes=32)
    ring, counters = ViolationRing(16), RunCounters()

    num_entries = 0

    def forward(batch: list[tuple[int, int]], padding: int = 0) -> None:
        nonlocal num_entries
        num_entries += run_forward(impl_name, kv.step(batch, padding), head, tail, sources, ring,
                                   counters, lambda slots: store_kv(sources, slots, rng))  # fmt: skip

    forward([(1, 5), (2, 3)])  # prefill
    forward([(1, 1), (2, 4)], padding=2)  # decode + chunked prefill, graph padding rows
    kv.share_prefix(3, donor=1, num_tokens=4)  # radix hit on row 1's first 4 tokens
    forward([(3, 2), (1, 1), (2, 1)])
    kv.finish(2)  # freed slots keep stale records; reuse must not look like corruption
    forward([(4, 6), (3, 1), (1, 1)], padding=1)
    forward([(4, 1), (3, 1), (1, 1)])
    assert ring.num_recorded() == 0, ring.read()
    assert (
        counters.kernel_runs[Tag.HEAD_K_FULL] == 10 and counters.kernel_runs[Tag.TAIL_K_FULL] == 10
    )
    assert counters.slots_processed[Tag.HEAD_K_FULL] == num_entries
    assert counters.slots_processed[Tag.TAIL_K_FULL] == num_entries


def test_swa_round_trip_with_eviction_and_reuse_is_silent(impl_name: str) -> None:
    rng = random.Random(1)
    window = 3
    kv = ToyKvSystem(num_full_slots=64, num_rows=4, max_context_len=24, rng=rng,
                     window=window, num_swa_slots=12)  # fmt: skip
    head, tail = alloc_canary_buffer(12), alloc_canary_buffer(12)
    sources = make_sources(12, rng, num_sources=1, page_size=1, bytes_per_token=16, read_bytes=16)
    ring, counters = ViolationRing(16), RunCounters()
    steps = [[(1, 4)], [(1, 1), (2, 3)], [(1, 1), (2, 1)], [(1, 2), (2, 1)], [(1, 1), (2, 1)]]
    num_entries = 0
    for batch in steps:
        inputs = kv.step(batch, num_padding_rows=1)
        num_entries += run_forward(impl_name, inputs, head, tail, sources, ring, counters,
                                   lambda slots: store_kv(sources, slots, rng),  # SWA slots
                                   window=window, lut=kv.lut.clone(), kind="SWA")  # fmt: skip
        kv.evict_out_of_window()  # SWA slots of old tokens go back to the free list
    assert ring.num_recorded() == 0, ring.read()
    # verify covers only the window: 4 + 3 + 6 + 6 entries after the first prefill
    assert num_entries == 17 + (0 + 4 + 3 + 6 + 6)
    assert counters.slots_processed[Tag.TAIL_K_SWA] == num_entries


# ---------------------------------------------------------------- single corruptions

CHAIN_SLOTS, CHAIN_TOKENS = [3, 7, 5, 9], [11, 22, 33, 44]
OTHER_SLOTS = [2, 4, 6, 8]  # same tokens/positions, different first token → different history


def written_chain(impl_name: str) -> tuple[torch.Tensor, list[RealKvSource]]:
    rng = random.Random(2)
    records = alloc_canary_buffer(12)
    sources = make_sources(12, rng, num_sources=1, page_size=4, bytes_per_token=16, read_bytes=16)
    for slots, tokens in ((CHAIN_SLOTS, CHAIN_TOKENS), (OTHER_SLOTS, [99, *CHAIN_TOKENS[1:]])):
        n = len(slots)
        plan = WritePlan(torch.tensor([-1]), torch.tensor([0]), torch.tensor([n]),
                         torch.tensor(tokens), torch.arange(n), torch.tensor(slots), n, n)  # fmt: skip
        IMPLS[impl_name].write(records, plan, ViolationRing(1), 0, real_kv_sources=sources)
    return records, sources


def verify_chain(impl_name: str, records: torch.Tensor, sources: list[RealKvSource],
                 slots: list[int] = CHAIN_SLOTS, prevs: list[int] | None = None,
                 check_token: bool = True) -> list[tuple[int, int]]:  # fmt: skip
    """(entry index, fail bits) of every violation of a verify over the chain."""
    prevs = prevs if prevs is not None else [-1, *slots[:-1]]
    plan = VerifyPlan.from_entries(torch.tensor(slots), torch.tensor(prevs),
                                   torch.arange(len(slots)), torch.tensor(CHAIN_TOKENS))  # fmt: skip
    ring = ViolationRing(8)
    IMPLS[impl_name].verify(records, plan, ring, Tag.TAIL_K_FULL, real_kv_sources=sources,
                            check_token=check_token)  # fmt: skip
    return [(slots.index(r.slot_idx), r.fail_reason) for r in ring.read()]


def test_clean_chain_is_silent_and_matches_vectors(impl_name: str) -> None:
    """Tokens [11, 22, 33] at positions [0, 1, 2]: the §2.2 chain vectors."""
    records, sources = written_chain(impl_name)
    assert verify_chain(impl_name, records, sources) == []
    got = [read_record(records, s).prev_hash for s in CHAIN_SLOTS[:3]]
    assert got == [to_i64(h) for h in (0xDE7FAE23A9A1B716, 0x89CD2ABFBEBC0649, 0x5782FFC5B5D6409B)]


@pytest.mark.parametrize(
    ("field", "check_token", "want"),
    [
        (0, True, [(1, FR.VERIFY_TOKEN_MISMATCH), (2, FR.VERIFY_CHAIN_HASH_MISMATCH)]),
        (0, False, [(2, FR.VERIFY_CHAIN_HASH_MISMATCH)]),
        (1, True, [(1, FR.VERIFY_POSITION_MISMATCH), (2, FR.VERIFY_CHAIN_HASH_MISMATCH)]),
        (2, True, [(1, FR.VERIFY_CHAIN_HASH_MISMATCH), (2, FR.VERIFY_CHAIN_HASH_MISMATCH)]),
        (3, True, [(1, FR.VERIFY_REAL_KV_HASH_MISMATCH)]),
    ],
)
def test_record_field_corruption(impl_name: str, field: int, check_token: bool,
                                 want: list[tuple[int, int]]) -> None:  # fmt: skip
    records, sources = written_chain(impl_name)
    as_int64_records(records)[CHAIN_SLOTS[1], field] += 1
    assert verify_chain(impl_name, records, sources, check_token=check_token) == want


def test_kv_byte_flip_is_real_kv_only(impl_name: str) -> None:
    records, sources = written_chain(impl_name)
    slot = CHAIN_SLOTS[2]
    sources[0].tensor[slot // 4, (slot % 4) * 16 + 5] ^= 0xFF
    assert verify_chain(impl_name, records, sources) == [(2, FR.VERIFY_REAL_KV_HASH_MISMATCH)]
    assert verify_chain(impl_name, records, []) == [  # HEAD-style verify has no real KV check
        (i, FR.VERIFY_REAL_KV_HASH_MISMATCH) for i in range(4)
    ]


def test_req_to_token_remap_is_chain_only(impl_name: str) -> None:
    records, sources = written_chain(impl_name)
    remapped = [CHAIN_SLOTS[0], OTHER_SLOTS[1], *CHAIN_SLOTS[2:]]
    want = [(1, FR.VERIFY_CHAIN_HASH_MISMATCH), (2, FR.VERIFY_CHAIN_HASH_MISMATCH)]
    assert verify_chain(impl_name, records, sources, slots=remapped) == want


def test_unreachable_predecessor_and_slot_zero_are_skipped(impl_name: str) -> None:
    records, sources = written_chain(impl_name)
    as_int64_records(records)[CHAIN_SLOTS[1], 0] += 1  # token of entry 1
    prevs = [-1, CHAIN_SLOTS[0], 0, CHAIN_SLOTS[2]]  # entry 2's predecessor evicted
    assert verify_chain(impl_name, records, sources, prevs=prevs, check_token=False) == []
    assert verify_chain(impl_name, records, sources, slots=[3, 0, 5, 9], prevs=[-1, 3, 0, 5],
                        check_token=False) == []  # fmt: skip


def write_after_chain(impl_name: str, positions: list[int], *, seed_position: int | None = None,
                      expected: tuple[list[int], list[int]] | None = None,
                      position_assert: bool = True) -> list[ViolationRecord]:  # fmt: skip
    records, _ = written_chain(impl_name)
    seed = CHAIN_SLOTS[-1]
    if seed_position is not None:
        as_int64_records(records)[seed, 1] = seed_position
    n = len(positions)
    t = torch.tensor
    expected_ids, expected_positions = (t(e) for e in expected) if expected else (None, None)
    plan = WritePlan(t([seed]), t([0]), t([n]), t([60 + i for i in range(n)]), t(positions),
                     t([10, 11, 1][:n]), n, n, expected_ids, expected_positions)  # fmt: skip
    ring = ViolationRing(8)
    IMPLS[impl_name].write(
        records, plan, ring, Tag.HEAD_K_SWA, chain_position_assert=position_assert
    )
    return ring.read()


def test_write_chain_position_assert(impl_name: str) -> None:
    assert write_after_chain(impl_name, [4, 5, 6]) == []
    # the seed slot holds position p - 2 (a stale SWA mapping): flagged on the first token
    [r] = write_after_chain(impl_name, [4, 5], seed_position=1)
    assert (r.slot_idx, r.position, r.expected_aux, r.fail_reason) == (
        10,
        4,
        2,
        FR.WRITE_POSITION_MISMATCH,
    )
    assert (r.stored_token, r.expected_token, r.launch_tag) == (60, 60, Tag.HEAD_K_SWA)
    assert write_after_chain(impl_name, [4, 5], seed_position=1, position_assert=False) == []
    # a gap inside the write: flagged once, and the assert follows the actual positions
    [r] = write_after_chain(impl_name, [4, 6, 7])
    assert (r.slot_idx, r.position, r.expected_aux) == (11, 6, 5)


def test_write_input_assert(impl_name: str) -> None:
    assert write_after_chain(impl_name, [4, 5], expected=([60, 61], [4, 5])) == []
    rows = write_after_chain(impl_name, [4, 6], expected=([60, 99], [4, 5]))
    assert [(r.slot_idx, r.fail_reason, r.expected_token, r.expected_aux) for r in rows] == [
        (11, FR.WRITE_TOKEN_MISMATCH | FR.WRITE_POSITION_MISMATCH, 99, 5),  # input assert first
        (11, FR.WRITE_POSITION_MISMATCH, 61, 5),  # then the chain-position assert
    ]
    seed_hash = slot_hash(list(read_record(written_chain(impl_name)[0], CHAIN_SLOTS[-1])))
    assert rows[0].stored_chain_hash == slot_hash([60, 4, seed_hash])  # running hash before it


def test_requests_over_the_same_entries_each_report_their_own_chain(impl_name: str) -> None:
    """Requests 0 and 1 write the same 8 entries, from different seeds, with a write-input
    mismatch on the second entry (request 2 writes 8 entries of its own): each request's
    ring row carries its own running hash before that entry (the numba kernel interleaves
    requests' chains only when their ranges follow one another), and the entries keep the
    last request's records."""
    records = alloc_canary_buffer(24)
    rec = as_int64_records(records)
    rec[23, :3] = torch.tensor([33, 1, 999])  # request 1's seed: token 33 at position 1
    t, ids = torch.tensor, list(range(40, 56))
    expected = [ids[0], 99, *ids[2:]]
    positions = torch.arange(16) % 8
    plan = WritePlan(t([-1, 23, -1]), t([0, 0, 8]), t([8, 8, 8]), t(ids), positions,
                     torch.arange(5, 21), 8, 24, t(expected), positions)  # fmt: skip
    ring = ViolationRing(8)
    IMPLS[impl_name].write(records, plan, ring, Tag.HEAD_K_FULL, chain_position_assert=False)
    first = to_i64(slot_hash([40, 0, to_i64(ANCHOR_HASH)]))  # request 0: anchor, then 40 @ 0
    seed = to_i64(slot_hash([33, 1, 999]))
    second = to_i64(slot_hash([40, 0, seed]))  # request 1: its seed, then 40 @ 0
    rows = ring.read()
    assert [(r.slot_idx, r.fail_reason, r.stored_chain_hash) for r in rows] == [
        (6, FR.WRITE_TOKEN_MISMATCH, first),
        (6, FR.WRITE_TOKEN_MISMATCH, second),
    ]
    assert int(rec[5, 2]) == seed and int(rec[6, 2]) == second  # the last request's records


def test_a_seed_stored_to_earlier_in_the_same_write_is_read_after_that_store(
    impl_name: str,
) -> None:
    """Request 1 chains from slot 5, which request 0 (a remapped entry) writes in the same
    launch: request 1's chain and position assert see request 0's record, as SGLang's
    ``write_ref`` does, not the record slot 5 held before the launch."""
    records = alloc_canary_buffer(16)
    rec = as_int64_records(records)
    rec[5, :3] = torch.tensor([77, 3, 1234])  # before the launch: token 77 at position 3
    plan = WritePlan(
        seed_slots=torch.tensor([-1, 5]),
        token_starts=torch.tensor([0, 1]),
        num_tokens=torch.tensor([1, 1]),
        token_ids=torch.tensor([40, 41]),
        positions=torch.tensor([0, 1]),
        slots=torch.tensor([5, 6]),
        max_num_tokens=1,
        total_num_tokens=2,
    )
    ring, counters = ViolationRing(8), RunCounters()
    IMPLS[impl_name].write(records, plan, ring, Tag.HEAD_K_FULL, chain_position_assert=True,
                           counters=counters)  # fmt: skip
    after = read_record(records, 5)
    assert (after.token, after.position) == (40, 0)
    assert int(rec[6, 2]) == to_i64(slot_hash(rec[5].tolist()))  # chained from the new record
    assert ring.num_recorded() == 0  # position 1 follows the new record's position 0
    assert counters.kernel_runs[Tag.HEAD_K_FULL] == 1
    assert counters.slots_processed[Tag.HEAD_K_FULL] == 2


def test_a_seed_a_prefill_stored_to_in_the_same_write_is_read_after_that_store(
    impl_name: str,
) -> None:
    """As above with 8 tokens a request (the numba kernel then computes the chains before
    any store, several requests at a time): request 1 chains from slot 12, which request
    0's last token writes in the same launch; its chain is that of request 0's new record
    (request 2 writes entries of its own)."""
    records = alloc_canary_buffer(32)
    rec = as_int64_records(records)
    rec[12, :3] = torch.tensor([77, 3, 1234])  # before the launch
    plan = WritePlan(
        seed_slots=torch.tensor([-1, 12, -1]),
        token_starts=torch.tensor([0, 8, 16]),
        num_tokens=torch.tensor([8, 8, 8]),
        token_ids=torch.arange(40, 64),
        positions=torch.cat([torch.arange(16), torch.arange(8)]),
        slots=torch.arange(5, 29),
        max_num_tokens=8,
        total_num_tokens=24,
    )
    ring = ViolationRing(8)
    IMPLS[impl_name].write(records, plan, ring, Tag.HEAD_K_FULL, chain_position_assert=True)
    assert (read_record(records, 12).token, read_record(records, 12).position) == (47, 7)
    assert int(rec[13, 2]) == to_i64(slot_hash(rec[12].tolist()))  # from the new record
    assert ring.num_recorded() == 0  # position 8 follows the new record's position 7
