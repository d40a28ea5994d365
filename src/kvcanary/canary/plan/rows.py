"""Row plans: the CPU form of one forward's canary plans, without per-entry arrays.

:func:`.plan.build_plans` spells every verify entry out as four int64 tensors. A decode step
re-verifies each request's whole prefix (HEAD and TAIL), so on the CPU writing those arrays
and reading them back cost more than the checks. A row plan keeps the entries implicit, per
batch row ``r`` (columns of ``requests``, int64 ``[7, >= bs]``)::

    requests[FIRST_ENTRY..FIRST_PREV, r]    first_entry, first_pos, num_entries, first_prev
    entry e = first_entry + j, j < num_entries:
        slot      = entries[0, e]                   (req_to_token, LUT-translated)
        prev_slot = entries[0, e - 1] if j > 0 else first_prev
        position  = first_pos + j
        expected token = entries[1, e]              (when the plan has a token table)
    requests[SEED..NUM_TOKENS, r]          the write plan: seed slot, first flat token, count

Entries attention needs that have no slot (``verify_not_resident``) are collected as the
plan's ``holes`` while the entries are filled (see :class:`.plan.CanaryPlans`).

These are exactly the entries of :class:`.plan.VerifyPlan`, in the same order (rows, then
positions), and the write plan is :class:`.plan.WritePlan`'s, so the CPU kernels
(:mod:`.kernels_numba`) give the same records, ring rows and counters for either form
(``tests/canary/test_canary_row_plan.py`` pins it). HEAD builds a group's row plan once;
TAIL verifies the same entries from it. The arrays are per-group scratch
(:class:`RowPlanner`), grown on demand and reused every forward: a plan is valid until
the next one of its planner.

Why so lean: right after a model forward the CPU caches hold the model's code and data,
and every distinct Python or torch operation the canary then runs costs 5-8x its warm time
(``.numpy()`` of a tensor ~3 us, a numba call ~10-20 us), so the per-forward path is one
numpy view per batch tensor and one compiled call per plan and per launch; shapes are
checked inside the compiled planner.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import torch

from kvcanary.canary.plan.jit import plan_counts, rows_in_range, translate_slot
from kvcanary.canary.plan.types import (
    CanaryPlans,
    HostWritePlan,
    PlanInputs,
    RowVerifyPlan,
    check_plan_args,
    check_plan_inputs,
)
from kvcanary.canary.wire.constants import NO_SLOT, NO_TOKEN, REQ_POOL_IDX_PADDING

# Rows of a row plan's ``requests`` array.
FIRST_ENTRY, FIRST_POS, NUM_ENTRIES, FIRST_PREV, SEED, TOKEN_START, NUM_TOKENS = range(7)

_EMPTY_TABLE = np.zeros((1, 1), dtype=np.int64)
_EMPTY_LENS = np.zeros(1, dtype=np.int64)
_EMPTY_LUT = np.zeros(1, dtype=np.int64)


class HostInputs(NamedTuple):
    """:class:`.plan.PlanInputs` as numpy views (any integer dtypes); one per forward,
    shared by its groups. Unlike PlanInputs, its shapes are checked by the planner (same
    errors)."""

    req_to_token: np.ndarray
    req_pool_indices: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    expected_token_table: np.ndarray | None = None
    expected_token_lens: np.ndarray | None = None
    expected_input_ids: np.ndarray | None = None
    expected_positions: np.ndarray | None = None

    @staticmethod
    def of(inputs: PlanInputs) -> HostInputs:
        def view(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.numpy()

        return HostInputs(
            inputs.req_to_token.numpy(), inputs.req_pool_indices.numpy(),
            inputs.prefix_lens.numpy(), inputs.extend_lens.numpy(), inputs.input_ids.numpy(),
            inputs.positions.numpy(), inputs.out_cache_loc.numpy(),
            view(inputs.expected_token_table), view(inputs.expected_token_lens),
            view(inputs.expected_input_ids), view(inputs.expected_positions),
        )  # fmt: skip


# Planner status codes.
_OK, _ERR_SHAPE, _ERR_EXTEND, _ERR_ROW, _ERR_LUT, _NEED_SCRATCH = range(6)


@numba.njit(cache=True, inline="always")
def _plan_rows(
    r2t, rows, prefix, extend, out_cache_loc, num_token_ids, num_positions,
    num_expected_ids, num_expected_positions, window, lut, has_lut, table, table_lens,
    has_table, offset, capacity, check_holes, requests, entries, write_slots, holes,
):  # fmt: skip
    """Fill the scratch; ``(status, total_verify, total_extend, total_write, max_write,
    num_holes)``. Nothing is filled unless the status is OK; same walk as
    :func:`.plan_numba._fill`."""
    bs, num_tokens = rows.shape[0], out_cache_loc.shape[0]
    if (
        prefix.shape[0] != bs or extend.shape[0] != bs
        or (has_table and table_lens.shape[0] != bs)
        or num_token_ids != num_tokens or num_positions != num_tokens
        or num_expected_ids != num_tokens or num_expected_positions != num_tokens
    ):  # fmt: skip
        return _ERR_SHAPE, 0, 0, 0, 0, 0
    total_verify, total_extend, total_write, max_write, starts = plan_counts(
        rows, prefix, extend, window
    )
    totals = (total_verify, total_extend, total_write, max_write, 0)
    if total_extend > num_tokens:
        return (_ERR_EXTEND,) + totals
    if not rows_in_range(r2t, rows, prefix, table, has_table):
        return (_ERR_ROW,) + totals
    fill_verify = total_verify <= capacity
    if requests.shape[1] < bs or write_slots.shape[0] < num_tokens or (
        fill_verify and (entries.shape[1] < total_verify or holes.shape[1] < total_verify)
    ):
        return (_NEED_SCRATCH,) + totals
    bad = False
    i = 0
    num_holes = 0
    token_start = 0
    for r in range(bs):
        ext = max(extend[r], 0)
        requests[FIRST_ENTRY, r] = i
        requests[FIRST_POS, r] = 0
        requests[NUM_ENTRIES, r] = 0
        requests[FIRST_PREV, r] = NO_SLOT
        requests[SEED, r] = NO_SLOT
        requests[TOKEN_START, r] = token_start
        requests[NUM_TOKENS, r] = 0
        token_start += ext
        row = rows[r]
        if row == REQ_POOL_IDX_PADDING:
            continue
        requests[NUM_TOKENS, r] = ext
        p = prefix[r]
        if p > 0 and ext > 0:
            requests[SEED, r], oob = translate_slot(r2t[row, p - 1], lut, has_lut)
            bad |= oob
        start = starts[r]
        if not fill_verify or start >= p:
            continue
        requests[FIRST_POS, r] = start
        requests[NUM_ENTRIES, r] = p - start
        if start > 0:
            requests[FIRST_PREV, r], oob = translate_slot(r2t[row, start - 1], lut, has_lut)
            bad |= oob
        first = i
        needed_from = max(p - window + (check_holes == 1), 0) if window > 0 else 0
        for pos in range(start, p):
            raw = r2t[row, pos]
            entries[0, i], oob = translate_slot(raw, lut, has_lut)
            bad |= oob
            if check_holes and entries[0, i] == 0 and pos >= needed_from:
                holes[0, num_holes] = raw
                holes[1, num_holes] = pos
                holes[2, num_holes] = p
                num_holes += 1
            i += 1
        if has_table:
            limit = min(table_lens[r], table.shape[1])
            for pos in range(start, p):
                idx = pos + offset
                entries[1, first + pos - start] = (
                    np.int64(table[row, idx]) if idx >= 0 and idx < limit else NO_TOKEN
                )
    for t in range(num_tokens):
        write_slots[t], oob = translate_slot(out_cache_loc[t], lut, has_lut)
        bad |= oob
    return (_ERR_LUT if bad else _OK), total_verify, total_extend, total_write, max_write, num_holes


class RowPlanner:
    """Row plans of one buffer group (its window, LUT and verify capacity) in scratch
    reused every forward."""

    def __init__(self, *, verify_capacity: int, window: int | None, lut: torch.Tensor | None,
                 kv_token_id_vs_position_offset: int = 0,
                 check_residency: int = 1):  # fmt: skip
        check_plan_args(verify_capacity, window)
        self.verify_capacity = verify_capacity
        # 0: no holes; 1: holes from prefix - window + 1; 2: from prefix - window
        # (CanaryBufferGroup.residency_check)
        self._check_residency = int(check_residency)
        self._window = window or 0
        self._lut = lut
        self._lut_np = _EMPTY_LUT if lut is None else lut.numpy()  # a view: the LUT mutates
        self._offset = kv_token_id_vs_position_offset
        self._requests = np.zeros((7, 64), dtype=np.int64)
        self._entries = np.zeros((2, 1024), dtype=np.int64)
        self._write_slots = np.zeros(256, dtype=np.int64)
        self._holes = np.zeros((3, 1024), dtype=np.int64)

    def plan(self, host: HostInputs) -> CanaryPlans:
        """:func:`.plan.build_plans` (numba backend) as a row plan: same entries, same
        errors (a shape error names the PlanInputs field)."""
        table, lens = host.expected_token_table, host.expected_token_lens
        has_table = table is not None and lens is not None
        num_tokens = host.input_ids.shape[0]
        ids, positions = host.expected_input_ids, host.expected_positions
        while True:
            status, total_verify, total_extend, total_write, max_write, num_holes = _plan_rows(
                host.req_to_token, host.req_pool_indices, host.prefix_lens, host.extend_lens,
                host.out_cache_loc, num_tokens, host.positions.shape[0],
                num_tokens if ids is None else ids.shape[0],
                num_tokens if positions is None else positions.shape[0], self._window,
                self._lut_np, self._lut is not None, table if has_table else _EMPTY_TABLE,
                lens if has_table else _EMPTY_LENS, has_table, self._offset,
                self.verify_capacity, self._check_residency, self._requests, self._entries,
                self._write_slots, self._holes,
            )  # fmt: skip
            if status != _NEED_SCRATCH:
                break
            self._grow(host.req_pool_indices.shape[0], host.out_cache_loc.shape[0],
                       total_verify)  # fmt: skip
        if status != _OK:
            self._raise(status, host, total_extend)
        bs = host.req_pool_indices.shape[0]
        return CanaryPlans(
            RowVerifyPlan(self._requests, bs, self._entries, has_table,
                          total_verify <= self.verify_capacity, total_verify),
            HostWritePlan(self._requests, bs, host.input_ids, host.positions,
                          self._write_slots, max_write, total_write, ids, positions),
            self._holes[:, :num_holes] if num_holes else None,
        )  # fmt: skip

    def _grow(self, bs: int, num_tokens: int, num_entries: int) -> None:
        if self._requests.shape[1] < bs:
            self._requests = np.zeros((7, max(bs, 2 * self._requests.shape[1])), np.int64)
        if self._write_slots.shape[0] < num_tokens:
            self._write_slots = np.zeros(max(num_tokens, 2 * self._write_slots.shape[0]),
                                         dtype=np.int64)  # fmt: skip
        if self._entries.shape[1] < num_entries:  # num_entries <= the verify capacity
            n = min(max(num_entries, 2 * self._entries.shape[1]), self.verify_capacity)
            self._entries = np.zeros((2, n), dtype=np.int64)
            self._holes = np.zeros((3, n), dtype=np.int64)

    @staticmethod
    def _raise(status: int, host: HostInputs, total_extend: int) -> None:
        if status == _ERR_SHAPE:
            check_plan_inputs(host)  # raises, naming the field
            raise ValueError("kv-canary plan: inconsistent input shapes")
        if status == _ERR_EXTEND:
            raise ValueError(
                f"extend_lens sum to {total_extend} > {host.input_ids.shape[0]} flat tokens"
            )
        if status == _ERR_ROW:
            raise IndexError("kv-canary plan: req_to_token index out of range")
        raise IndexError("kv-canary plan: slot out of range of the LUT")
