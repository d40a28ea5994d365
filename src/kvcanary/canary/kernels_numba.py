"""CPU canary kernels (numba): verify and write, one compiled pass over the plan each.

A prefill's hash chain is sequential per request, so the CPU path walks it in compiled code
rather than a Python loop. Semantics are those of :mod:`kvcanary.canary.kernels` (the
contract), bit for bit equal to the torch path and the test-only Python reference.
All tensors must be on the CPU; numba sees them through shared-memory numpy views.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np
import torch

from kvcanary.canary.constants import FailReason
from kvcanary.canary.hashing import ANCHOR_HASH_I64, chain_hash_nb, fold_real_kv_nb, splitmix64_nb
from kvcanary.canary.plan import VerifyPlan, WritePlan
from kvcanary.canary.real_kv import NumbaSourceArgs, RealKvSource, numba_source_args
from kvcanary.canary.records import as_int64_records
from kvcanary.canary.ring import RunCounters, ViolationRing

_CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
_POSITION = int(FailReason.VERIFY_POSITION_MISMATCH)
_REAL_KV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_TOKEN = int(FailReason.VERIFY_TOKEN_MISMATCH)
_WRITE_TOKEN = int(FailReason.WRITE_TOKEN_MISMATCH)
_WRITE_POSITION = int(FailReason.WRITE_POSITION_MISMATCH)
_ANCHOR = np.int64(ANCHOR_HASH_I64)


@numba.njit(cache=True)
def _fold_source(acc, slots, words, page_size, words_per_token, read_words):
    for i in range(slots.shape[0]):
        slot = slots[i]
        if slot < 0:
            continue
        row = slot // page_size
        if row >= words.shape[0]:
            raise IndexError("kv-canary: slot out of range of a real-KV source")
        first = (slot % page_size) * words_per_token
        folded = fold_real_kv_nb(words, row, first, read_words)
        acc[i] = np.int64(splitmix64_nb(np.uint64(acc[i]) ^ folded))


@numba.njit(cache=True)
def _real_kv_hashes(slots, words0, words1, words2, words3, meta, num_sources):
    """Field 3 for every slot (0 for negative slots), one pass per source.

    Per-source passes keep array arguments out of the per-entry loop (a call per entry that
    passes arrays costs reference-count traffic that dominated the kernel).
    """
    acc = np.zeros(slots.shape[0], dtype=np.int64)
    if num_sources > 0:
        _fold_source(acc, slots, words0, meta[0, 0], meta[0, 1], meta[0, 2])
    if num_sources > 1:
        _fold_source(acc, slots, words1, meta[1, 0], meta[1, 1], meta[1, 2])
    if num_sources > 2:
        _fold_source(acc, slots, words2, meta[2, 0], meta[2, 1], meta[2, 2])
    if num_sources > 3:
        _fold_source(acc, slots, words3, meta[3, 0], meta[3, 1], meta[3, 2])
    return acc


@numba.njit(cache=True)
def _record(ring, ring_index, tag, slot, position, token, expected_token, chain, aux, bits):
    seq = ring_index[0]
    ring_index[0] = seq + 1
    if seq < ring.shape[0]:
        ring[seq, 0] = tag
        ring[seq, 1] = slot
        ring[seq, 2] = position
        ring[seq, 3] = token
        ring[seq, 4] = expected_token
        ring[seq, 5] = chain
        ring[seq, 6] = aux
        ring[seq, 7] = bits


@numba.njit(cache=True)
def _check_slot(slot, num_slots):
    if slot < 0 or slot >= num_slots:
        raise IndexError("kv-canary: plan slot out of range of the canary buffer")


@numba.njit(cache=True)
def _verify_kernel(
    rec, slots, prev_slots, positions, expected_tokens, check_token, tag,
    words0, words1, words2, words3, meta, num_sources, ring, ring_index,
):  # fmt: skip
    num_slots = rec.shape[0]
    real = _real_kv_hashes(slots, words0, words1, words2, words3, meta, num_sources)
    for i in range(slots.shape[0]):
        slot = slots[i]
        if slot == 0:
            continue
        _check_slot(slot, num_slots)
        token, position = rec[slot, 0], rec[slot, 1]
        stored_chain, stored_real = rec[slot, 2], rec[slot, 3]
        prev = prev_slots[i]
        if prev == 0:
            expected_chain = stored_chain
        elif prev < 0:
            expected_chain = _ANCHOR
        else:
            _check_slot(prev, num_slots)
            expected_chain = np.int64(chain_hash_nb(rec[prev, 2], rec[prev, 0], rec[prev, 1]))
        expected_token = expected_tokens[i] if check_token else np.int64(-1)
        bits = 0
        if prev != 0 and stored_chain != expected_chain:
            bits |= _CHAIN
        if expected_token != -1 and token != expected_token:
            bits |= _TOKEN
        if position != positions[i]:
            bits |= _POSITION
        if stored_real != real[i]:
            bits |= _REAL_KV
        if bits:
            _record(ring, ring_index, tag, slot, position, token, expected_token,
                    stored_chain, expected_chain, bits)  # fmt: skip


@numba.njit(cache=True)
def _write_kernel(
    rec, seed_slots, token_starts, num_tokens, token_ids, positions, slots,
    check_inputs, expected_token_ids, expected_positions, position_assert, tag,
    words0, words1, words2, words3, meta, num_sources, ring, ring_index,
):  # fmt: skip
    num_slots = rec.shape[0]
    num_reqs = seed_slots.shape[0]
    written_slots = np.full(slots.shape[0], -1, dtype=np.int64)  # fingerprint only these
    for r in range(num_reqs):
        end = token_starts[r] + num_tokens[r]
        if num_tokens[r] > 0 and (token_starts[r] < 0 or end > token_ids.shape[0]):
            raise IndexError("kv-canary: write plan token range out of the flat token arrays")
        written_slots[token_starts[r] : end] = slots[token_starts[r] : end]
    real = _real_kv_hashes(written_slots, words0, words1, words2, words3, meta, num_sources)
    # Every seed is read before any store: the launch sees the records as they were.
    seed_chain = np.empty(num_reqs, dtype=np.int64)
    seed_position = np.zeros(num_reqs, dtype=np.int64)
    for r in range(num_reqs):
        seed = seed_slots[r]
        if seed < 0:
            seed_chain[r] = _ANCHOR
        else:
            _check_slot(seed, num_slots)
            seed_chain[r] = np.int64(chain_hash_nb(rec[seed, 2], rec[seed, 0], rec[seed, 1]))
            seed_position[r] = rec[seed, 1]
    num_written = 0
    for r in range(num_reqs):
        running = seed_chain[r]
        assert_position = position_assert and seed_slots[r] >= 0
        prev_position = seed_position[r]
        for i in range(token_starts[r], token_starts[r] + num_tokens[r]):
            slot = slots[i]
            if slot < 0:
                continue
            _check_slot(slot, num_slots)
            token, position = token_ids[i], positions[i]
            if check_inputs:
                bits = 0
                if token != expected_token_ids[i]:
                    bits |= _WRITE_TOKEN
                if position != expected_positions[i]:
                    bits |= _WRITE_POSITION
                if bits:
                    _record(ring, ring_index, tag, slot, position, token, expected_token_ids[i],
                            running, expected_positions[i], bits)  # fmt: skip
            if assert_position:
                if position != prev_position + 1:
                    _record(ring, ring_index, tag, slot, position, token, token,
                            running, prev_position + 1, _WRITE_POSITION)  # fmt: skip
                prev_position = position
            rec[slot, 0] = token
            rec[slot, 1] = position
            rec[slot, 2] = running
            rec[slot, 3] = real[i]
            running = np.int64(chain_hash_nb(running, token, position))
            num_written += 1
    return num_written


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing ``t``'s memory (kernel outputs must never be copies)."""
    if t.device.type != "cpu":
        raise ValueError(f"numba canary kernels need CPU tensors, got device {t.device}")
    return t.numpy()


_MAX_CACHED = 64
_records_cache: OrderedDict[int, tuple[torch.Tensor, np.ndarray]] = OrderedDict()
_sources_cache: OrderedDict[int, tuple[Sequence[RealKvSource], NumbaSourceArgs]] = OrderedDict()
_ring_cache: OrderedDict[int, tuple[ViolationRing, tuple[np.ndarray, np.ndarray]]] = OrderedDict()


def _cached(cache: OrderedDict, key_obj: Any, make: Callable[[], Any]) -> Any:
    """``make()`` memoised on the identity of ``key_obj`` (kept alive by the entry, so its
    id cannot be reused while cached). Canary buffers and source tuples live as long as the
    canary, and converting them per launch cost more than the decode-step verify itself."""
    hit = cache.get(id(key_obj))
    if hit is not None and hit[0] is key_obj:
        cache.move_to_end(id(key_obj))
        return hit[1]
    value = make()
    cache[id(key_obj)] = (key_obj, value)
    if len(cache) > _MAX_CACHED:
        cache.popitem(last=False)
    return value


def _records_np(records: torch.Tensor) -> np.ndarray:
    return _cached(_records_cache, records, lambda: _np(as_int64_records(records)))


def _sources_np(sources: Sequence[RealKvSource]) -> NumbaSourceArgs:
    return _cached(_sources_cache, sources, lambda: numba_source_args(sources))


def _ring_np(ring: ViolationRing) -> tuple[np.ndarray, np.ndarray]:
    return _cached(_ring_cache, ring, lambda: (_np(ring.rows), _np(ring.write_index)))


def verify(
    records: torch.Tensor,
    plan: VerifyPlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    check_token: bool = False,
    counters: RunCounters | None = None,
) -> None:
    num_entries = plan.num_entries if plan.enabled else 0
    if num_entries:
        _verify_kernel(
            _records_np(records), plan.slots.numpy(), plan.prev_slots.numpy(),
            plan.positions.numpy(), plan.expected_tokens.numpy(), bool(check_token),
            int(launch_tag), *_sources_np(real_kv_sources), *_ring_np(ring),
        )  # fmt: skip
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
    if plan.expected_token_ids is not None and plan.expected_positions is not None:
        check_inputs, expected_ids, expected_positions = (
            True, plan.expected_token_ids, plan.expected_positions,
        )  # fmt: skip
    else:  # typed dummies: numba compiles one signature either way
        check_inputs, expected_ids, expected_positions = False, plan.token_ids, plan.positions
    num_written = 0
    if plan.max_num_tokens:
        num_written = _write_kernel(
            _records_np(records), plan.seed_slots.numpy(), plan.token_starts.numpy(),
            plan.num_tokens.numpy(), plan.token_ids.numpy(), plan.positions.numpy(),
            plan.slots.numpy(), check_inputs, expected_ids.numpy(), expected_positions.numpy(),
            bool(chain_position_assert), int(launch_tag),
            *_sources_np(real_kv_sources), *_ring_np(ring),
        )  # fmt: skip
    if counters is not None:
        counters.add(launch_tag, num_written)
