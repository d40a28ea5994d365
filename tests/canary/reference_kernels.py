"""Slow plain-Python canary kernels: the executable spec the numba and torch kernels must match.

Same signatures as :mod:`kvcanary.canary.kernels.numba_kernels` / ``kernels_torch``; written for
obviousness (Python ints, one entry at a time), never for speed. Test-only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcanary.canary.plan.types import VerifyPlan, WritePlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import FailReason
from kvcanary.canary.wire.hashing import (
    ANCHOR_HASH,
    chain_hash,
    combine_real_kv_folds,
    fold_real_kv_bytes,
    to_i64,
)
from kvcanary.canary.wire.real_kv import RealKvSource
from kvcanary.canary.wire.records import as_int64_records


def real_kv_hash(sources: Sequence[RealKvSource], slot: int) -> int:
    """Field 3 of ``slot`` from the live KV bytes (signed int64)."""
    folds = []
    for s in sources:
        row, cols = s.byte_offsets(slot)
        if row >= s.tensor.shape[0]:
            raise IndexError(f"slot {slot} out of range of a real-KV source")
        data = s.tensor[row].tolist()
        folds.append(fold_real_kv_bytes(bytes(data[c] for c in cols)))
    return to_i64(combine_real_kv_folds(folds))


def slot_hash(record: list[int]) -> int:
    """The prev_hash a successor of this record must store (signed int64)."""
    return to_i64(chain_hash(record[2], record[0], record[1]))


def _record(ring: ViolationRing, row: list[int]) -> None:
    seq = int(ring.write_index.item())
    ring.write_index += 1
    if seq < ring.capacity:
        ring.rows[seq] = torch.tensor(row, dtype=torch.int64)


def _check_slot(slot: int, num_slots: int) -> None:
    if not 0 <= slot < num_slots:
        raise IndexError(f"slot {slot} out of range of {num_slots} canary slots")


def verify(
    records: torch.Tensor,
    plan: VerifyPlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    check_token: bool = False,
    counters: RunCounters | None = None,
    reader_chain: bool = False,
) -> None:
    table = as_int64_records(records).tolist()
    num_entries = plan.num_entries if plan.enabled else 0
    slots, prevs = plan.slots.tolist(), plan.prev_slots.tolist()
    positions, tokens = plan.positions.tolist(), plan.expected_tokens.tolist()
    # The reader chain after the entry before, that entry's slot, whether the next may link.
    reader, last, known = 0, 0, False
    for i in range(num_entries):
        slot, prev = slots[i], prevs[i]
        if slot == 0:
            last = 0
            continue
        _check_slot(slot, len(table))
        token, position, stored_chain, stored_real = table[slot][:4]
        if prev == 0:
            expected_chain = stored_chain
        elif prev < 0:
            expected_chain = to_i64(ANCHOR_HASH)
        else:
            _check_slot(prev, len(table))
            expected_chain = slot_hash(table[prev])
        expected_token = tokens[i] if check_token else -1
        bits = 0
        if prev != 0 and stored_chain != expected_chain:
            bits |= FailReason.VERIFY_CHAIN_HASH_MISMATCH
        if expected_token != -1 and token != expected_token:
            bits |= FailReason.VERIFY_TOKEN_MISMATCH
        if position != positions[i]:
            bits |= FailReason.VERIFY_POSITION_MISMATCH
        if stored_real != real_kv_hash(real_kv_sources, slot):
            bits |= FailReason.VERIFY_REAL_KV_HASH_MISMATCH
        reported = expected_chain
        if reader_chain:  # the reading request's own chain (kernels.dispatch)
            linked = known and prev > 0 and prev == last
            if linked and not bits & FailReason.VERIFY_CHAIN_HASH_MISMATCH and (
                    stored_chain != reader):  # fmt: skip
                bits |= FailReason.VERIFY_CHAIN_HASH_MISMATCH
                reported = reader
            reader_token = expected_token if expected_token != -1 else token
            reader = slot_hash([reader_token, positions[i], reader if linked else expected_chain])
            history = (FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_TOKEN_MISMATCH
                       | FailReason.VERIFY_POSITION_MISMATCH)  # fmt: skip
            known = expected_token != -1 or not bits & history
        last = slot
        if bits:
            row = [launch_tag, slot, position, token, expected_token, stored_chain, reported]
            _record(ring, [*row, int(bits)])
    if counters is not None:
        counters.add(launch_tag, num_entries)


def write(
    records: torch.Tensor,
    plan: WritePlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    chain_position_assert: bool = False,
    counters: RunCounters | None = None,
) -> None:
    rec = as_int64_records(records)
    table = rec.tolist()
    seeds = plan.seed_slots.tolist()
    starts, counts = plan.token_starts.tolist(), plan.num_tokens.tolist()
    token_ids, positions, slots = (
        plan.token_ids.tolist(),
        plan.positions.tolist(),
        plan.slots.tolist(),
    )
    expected_token_t, expected_position_t = plan.expected_token_ids, plan.expected_positions
    check_inputs = expected_token_t is not None and expected_position_t is not None
    expected_tokens = expected_token_t.tolist() if expected_token_t is not None else []
    expected_positions = expected_position_t.tolist() if expected_position_t is not None else []
    for seed in seeds:  # every seed is range-checked before any store
        if seed >= 0:
            _check_slot(seed, len(table))
    num_written = 0
    for r, seed in enumerate(seeds):
        # read when request r starts: earlier requests' stores to it are seen
        seed_record = list(table[seed]) if seed >= 0 else None
        if counts[r] > 0 and (starts[r] < 0 or starts[r] + counts[r] > len(token_ids)):
            raise IndexError(f"request {r}: token range out of the flat token arrays")
        running = to_i64(ANCHOR_HASH) if seed_record is None else slot_hash(seed_record)
        armed = chain_position_assert and seed_record is not None
        prev_position = seed_record[1] if seed_record is not None else 0
        for i in range(starts[r], starts[r] + counts[r]):
            slot, token, position = slots[i], token_ids[i], positions[i]
            if slot < 0:
                continue
            _check_slot(slot, len(table))
            if check_inputs:
                bits = 0
                if token != expected_tokens[i]:
                    bits |= FailReason.WRITE_TOKEN_MISMATCH
                if position != expected_positions[i]:
                    bits |= FailReason.WRITE_POSITION_MISMATCH
                if bits:
                    row = [launch_tag, slot, position, token, expected_tokens[i], running]
                    _record(ring, [*row, expected_positions[i], int(bits)])
            if armed:
                if position != prev_position + 1:
                    row = [launch_tag, slot, position, token, token, running, prev_position + 1]
                    _record(ring, [*row, int(FailReason.WRITE_POSITION_MISMATCH)])
                prev_position = position
            table[slot][:4] = [token, position, running, real_kv_hash(real_kv_sources, slot)]
            running = to_i64(chain_hash(running, token, position))
            num_written += 1
    rec.copy_(torch.tensor(table, dtype=torch.int64))
    if counters is not None:
        counters.add(launch_tag, num_written)
