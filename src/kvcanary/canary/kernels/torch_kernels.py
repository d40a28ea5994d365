"""Torch canary kernels: verify and write on any device, vectorised, without host syncs.

Violations are appended to the ring by device ops only (:meth:`ViolationRing.append_t`).
Verify is one gather-compare pass. Write is vectorised except for the hash chain itself,
which is inherently sequential: one step per token column, all requests at once, so a
launch costs ``max_num_tokens`` small steps (fine for decode; prefill on CPU uses numba).
Semantics are those of :mod:`kvcanary.canary.kernels.dispatch`, bit for bit.

The reader chain (verify with ``reader_chain`` and ``check_token``) is the one sequential part
of a verify, and it matters only in a few places: by induction the reader's chain is the
stored one until an entry whose token is checked fails a chain, token or position check (the
*origin*), and an entry whose token is not checked ends any divergence (the next one is not
linked, or is checked against the stored chain again). So the plan is cut into *segments*,
each a run of linked entries in which only the last may have an unchecked token::

    entries   a  b  c  d  e  f  g  h      (| : not linked, or the entry before is unchecked)
    segments  |a  b  c  d  e |f  g |h
    origin          c (first failing checked entry of its segment)
    sequential         d  e              one step each, every segment's tail at once

Everything outside the tails is the vectorised check; the tails take one step per entry of
the longest. That costs the verify one host read (whether any segment has a tail, and their
lengths), so a torch verify with ``reader_chain`` cannot be captured in a CUDA graph (the
captured path is Triton's, :mod:`.triton_kernels`, which has no host read).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvcanary.canary.plan.types import VerifyPlan, WritePlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    CANARY_FIELDS_PER_SLOT,
    NO_TOKEN,
    FailReason,
)
from kvcanary.canary.wire.hashing import ANCHOR_HASH_I64, chain_hash_t
from kvcanary.canary.wire.real_kv import RealKvSource, real_kv_hashes_t
from kvcanary.canary.wire.records import as_int64_records


def _slot_hash(records: torch.Tensor) -> torch.Tensor:
    """Chain hash a successor of each gathered record ``[n, >=4]`` must store."""
    return chain_hash_t(
        records[:, CANARY_FIELD_PREV_HASH],
        records[:, CANARY_FIELD_TOKEN],
        records[:, CANARY_FIELD_POSITION],
    )


def _bit(cond: torch.Tensor, reason: FailReason) -> torch.Tensor:
    return cond.to(torch.int64) * int(reason)


_CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
# Bits that say a slot holds another history than the reader's.
_HISTORY = _CHAIN | int(FailReason.VERIFY_TOKEN_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH)


def _reader_chain(
    slots: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor, expected_token: torch.Tensor,
    token: torch.Tensor, stored_chain: torch.Tensor, expected_chain: torch.Tensor,
    bits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(bits, reported expected chain)`` with the reader chain's check (:mod:`.dispatch`;
    the segments: module doc), from the entries' stored-chain check (``bits``,
    ``expected_chain``). Inside a tail every entry is linked and the one before it has a
    checked token, so the reader's chain there is a plain hash chain of the reader's own
    tokens and positions from its origin on."""
    n = slots.shape[0]
    idx = torch.arange(n, device=slots.device)
    checked = expected_token != NO_TOKEN
    seg_start = torch.ones_like(checked)
    seg_start[1:] = ~((slots[1:] != 0) & (prev[1:] > 0) & (prev[1:] == slots[:-1]) & checked[:-1])
    failing = checked & ((bits & _HISTORY) != 0)  # (bits are 0 under slot 0)
    seg_first = torch.where(seg_start, idx, 0).cummax(0).values
    last_failing = torch.where(failing, idx, -1).cummax(0).values
    origin = failing & (torch.cat([idx.new_full((1,), -1), last_failing[:-1]]) < seg_first)
    next_start = torch.where(seg_start, idx, n).flip(0).cummin(0).values.flip(0)
    seg_end = torch.cat([next_start[1:], idx.new_full((1,), n)])  # the entry after i's segment
    tail_len = torch.where(origin, seg_end - idx - 1, 0)
    origins = torch.nonzero(tail_len > 0).squeeze(1)  # the host read
    if not origins.numel():
        return bits, expected_chain
    lens, order = torch.sort(tail_len[origins], descending=True, stable=True)
    origins, lens_host = origins[order], lens.tolist()
    bits, reported = bits.clone(), expected_chain.clone()
    reader_token = torch.where(checked, expected_token, token)
    reader = chain_hash_t(expected_chain[origins], reader_token[origins], positions[origins])
    num_tails = len(lens_host)  # tails sorted longest first: step k moves the first num_tails
    for k in range(1, lens_host[0] + 1):
        while lens_host[num_tails - 1] < k:
            num_tails -= 1
        j, reader = origins[:num_tails] + k, reader[:num_tails]
        entry_bits = bits[j]
        fire = ((entry_bits & _CHAIN) == 0) & (stored_chain[j] != reader)
        bits[j] = entry_bits | _bit(fire, FailReason.VERIFY_CHAIN_HASH_MISMATCH)
        reported[j] = torch.where(fire, reader, expected_chain[j])
        reader = chain_hash_t(reader, reader_token[j], positions[j])
    return bits, reported


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
    num_entries = plan.num_entries if plan.enabled else 0
    if counters is not None:
        counters.add(launch_tag, num_entries)
    if not num_entries:
        return
    rec = as_int64_records(records)
    slots, prev = plan.slots, plan.prev_slots
    cur = rec.index_select(0, slots)  # raises on out-of-range slots
    token, position = cur[:, CANARY_FIELD_TOKEN], cur[:, CANARY_FIELD_POSITION]
    stored_chain = cur[:, CANARY_FIELD_PREV_HASH]
    reachable = prev != 0
    expected_chain = torch.where(
        prev < 0, ANCHOR_HASH_I64, _slot_hash(rec.index_select(0, prev.clamp(min=0)))
    )
    expected_chain = torch.where(reachable, expected_chain, stored_chain)
    expected_token = plan.expected_tokens if check_token else torch.full_like(slots, NO_TOKEN)
    expected_real = real_kv_hashes_t(real_kv_sources, slots)
    bits = (
        _bit(reachable & (stored_chain != expected_chain), FailReason.VERIFY_CHAIN_HASH_MISMATCH)
        | _bit(position != plan.positions, FailReason.VERIFY_POSITION_MISMATCH)
        | _bit(
            cur[:, CANARY_FIELD_REAL_KV_HASH] != expected_real,
            FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
        )
        | _bit(
            (expected_token != NO_TOKEN) & (token != expected_token),
            FailReason.VERIFY_TOKEN_MISMATCH,
        )
    )
    bits = torch.where(slots == 0, 0, bits)
    if reader_chain and check_token:  # (every token unchecked: the stored chain is the reader's)
        bits, expected_chain = _reader_chain(slots, prev, plan.positions, expected_token, token,
                                             stored_chain, expected_chain, bits)  # fmt: skip
    tag = torch.full_like(slots, int(launch_tag))
    rows = torch.stack(
        [tag, slots, position, token, expected_token, stored_chain, expected_chain, bits], dim=1
    )
    ring.append_t(rows, bits != 0)


def _last_writer(targets: torch.Tensor, priority: torch.Tensor) -> torch.Tensor:
    """For each entry, the entry of highest priority among those with the same target.

    Lets duplicate targets all store the winner's value, so an unordered scatter is
    deterministic ("last write wins" when priority is the sequential order).
    """
    n = targets.shape[0]
    key = targets * (n + 1) + priority + 1
    perm = torch.sort(key).indices
    sorted_targets = targets[perm]
    idx = torch.arange(n, device=targets.device)
    is_run_end = torch.ones_like(sorted_targets, dtype=torch.bool)
    is_run_end[:-1] = sorted_targets[1:] != sorted_targets[:-1]
    run_end = torch.where(is_run_end, idx, n).flip(0).cummin(0).values.flip(0)
    winner = torch.empty_like(perm)
    winner[perm] = perm[run_end]
    return winner


def _write_one_request_at_a_time(
    records: torch.Tensor,
    plan: WritePlan,
    ring: ViolationRing,
    launch_tag: int,
    real_kv_sources: Sequence[RealKvSource],
    chain_position_assert: bool,
) -> None:
    for r in range(plan.num_tokens.shape[0]):
        count = int(plan.num_tokens[r])
        if count == 0:
            continue
        one = dataclasses.replace(
            plan,
            seed_slots=plan.seed_slots[r : r + 1],
            token_starts=plan.token_starts[r : r + 1],
            num_tokens=plan.num_tokens[r : r + 1],
            max_num_tokens=count,
            total_num_tokens=count,
        )
        write(records, one, ring, launch_tag, real_kv_sources=real_kv_sources,
              chain_position_assert=chain_position_assert)  # fmt: skip


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
    device = rec.device
    num_reqs, max_len = plan.num_tokens.shape[0], plan.max_num_tokens
    if not max_len or not plan.total_num_tokens:
        if counters is not None:
            counters.add(launch_tag, 0)
        return
    # Flat entries in sequential order (request, then token): e = 0 .. n-1.
    n = plan.total_num_tokens
    counts = plan.num_tokens
    entry_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), counts, output_size=n
    )
    first_entry = torch.cumsum(counts, 0) - counts
    idx = torch.arange(n, device=device)
    col = idx - first_entry[entry_req]
    tok_idx = plan.token_starts[entry_req] + col
    # index_select: out-of-range (incl. negative) token indices raise instead of wrapping
    slots = plan.slots.index_select(0, tok_idx)
    token = plan.token_ids.index_select(0, tok_idx)
    position = plan.positions.index_select(0, tok_idx)
    active = slots >= 0

    seeds = plan.seed_slots
    if num_reqs > 1 and bool(torch.isin(seeds[seeds >= 0], slots[active]).any()):
        # A seed this launch also stores to (a remapped entry): each seed must be read after
        # the earlier requests' stores, so run the requests one at a time.
        _write_one_request_at_a_time(
            records, plan, ring, launch_tag, real_kv_sources, chain_position_assert
        )
        if counters is not None:
            counters.add(launch_tag, active.sum())
        return
    # No seed is stored to by this launch: reading them all first is the same.
    seed_rec = rec.index_select(0, seeds.clamp(min=0))
    seed_chain = torch.where(seeds < 0, ANCHOR_HASH_I64, _slot_hash(seed_rec))

    # The chain: sequential over token columns, vectorised over requests.
    grid_shape = (num_reqs, max_len)
    grid_token = torch.zeros(grid_shape, dtype=torch.int64, device=device)
    grid_position = torch.zeros_like(grid_token)
    grid_active = torch.zeros(grid_shape, dtype=torch.bool, device=device)
    grid_token[entry_req, col] = token
    grid_position[entry_req, col] = position
    grid_active[entry_req, col] = active
    grid_chain = torch.empty_like(grid_token)
    running = seed_chain
    for c in range(max_len):
        grid_chain[:, c] = running
        if c + 1 < max_len:
            step = chain_hash_t(running, grid_token[:, c], grid_position[:, c])
            running = torch.where(grid_active[:, c], step, running)
    chain = grid_chain[entry_req, col]

    # Chain-position assert: each stored position follows the previous stored one (or the seed's).
    last_active = torch.where(active, idx, -1).cummax(0).values
    prev_entry = torch.cat([last_active.new_full((1,), -1), last_active[:-1]])
    has_prev = prev_entry >= first_entry[entry_req]
    seed_position = seed_rec[:, CANARY_FIELD_POSITION][entry_req]
    prev_position = torch.where(has_prev, position[prev_entry.clamp(min=0)], seed_position)
    assert_position = bool(chain_position_assert) & (seeds >= 0)[entry_req] & active
    position_bad = assert_position & (position != prev_position + 1)

    tag = torch.full_like(slots, int(launch_tag))
    if plan.expected_token_ids is not None and plan.expected_positions is not None:
        expected_token = plan.expected_token_ids.index_select(0, tok_idx)
        expected_position = plan.expected_positions.index_select(0, tok_idx)
        input_bits = _bit(token != expected_token, FailReason.WRITE_TOKEN_MISMATCH) | _bit(
            position != expected_position, FailReason.WRITE_POSITION_MISMATCH
        )
        input_bits = torch.where(active, input_bits, 0)
    else:
        expected_token = expected_position = input_bits = torch.zeros_like(slots)
    input_rows = torch.stack(
        [tag, slots, position, token, expected_token, chain, expected_position, input_bits], 1
    )
    position_rows = torch.stack(
        [tag, slots, position, token, token, chain, prev_position + 1,
         _bit(position_bad, FailReason.WRITE_POSITION_MISMATCH)], 1,
    )  # fmt: skip
    # Per token: the input-assert row, then the position-assert row.
    candidates = torch.stack([input_rows, position_rows], 1).reshape(2 * n, -1)
    flags = torch.stack([input_bits != 0, position_bad], 1).reshape(2 * n)
    ring.append_t(candidates, flags)

    # Store. Skipped tokens aim at slot 0 carrying its current record (a no-op unless a real
    # token also targets slot 0, which then wins); duplicate slots keep the last write.
    fields = rec[:, :CANARY_FIELDS_PER_SLOT]
    targets = torch.where(active, slots, 0)
    real = real_kv_hashes_t(real_kv_sources, targets)
    values = torch.stack([token, position, chain, real], 1)
    values = torch.where(active[:, None], values, fields[0])
    values = values[_last_writer(targets, torch.where(active, idx, -1))]
    fields.index_copy_(0, targets, values)
    if counters is not None:
        counters.add(launch_tag, active.sum())
