"""CPU plan builder (numba): :func:`kvcanary.canary.plan.reference.build_plans` in one compiled pass
(it dispatches here for CPU tensors).

The torch builder is a dozen small tensor ops per group per forward; on the CPU their
dispatch costs about a millisecond, which is most of the canary's per-forward overhead on
small models. This builder walks the batch rows directly (count, then fill) and produces
the same plans, bit for bit and with the same errors (an out-of-range slot or position is
an ``IndexError``); ``tests/canary/test_canary_plan_backends.py`` pins the two together.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvcanary.canary.plan.jit import plan_counts, rows_in_range, translate_slot
from kvcanary.canary.plan.types import (
    CanaryPlans,
    PlanInputs,
    VerifyPlan,
    WritePlan,
    long_or_none,
)
from kvcanary.canary.wire.constants import NO_SLOT, NO_TOKEN, REQ_POOL_IDX_PADDING

_EMPTY_LUT = np.zeros(1, dtype=np.int64)
_EMPTY_TABLE = np.zeros((1, 1), dtype=np.int64)
_EMPTY_LENS = np.zeros(1, dtype=np.int64)


@numba.njit(cache=True)
def _fill(
    r2t, rows, prefix, extend, starts, lut, has_lut, table, table_lens, has_table, offset,
    fill_verify, total_verify, out_cache_loc, window, check_holes,
):  # fmt: skip
    """Plan arrays, the holes (full slot, position, prefix of entries attention needs that
    have no slot) and whether a slot fell outside the LUT. Needs :func:`rows_in_range`."""
    bad = False
    holes = np.empty((3, total_verify), dtype=np.int64)
    num_holes = 0
    bs = rows.shape[0]
    v_slots = np.empty(total_verify, dtype=np.int64)
    v_prev = np.empty(total_verify, dtype=np.int64)
    v_pos = np.empty(total_verify, dtype=np.int64)
    v_tok = np.empty(total_verify, dtype=np.int64)
    seeds = np.empty(bs, dtype=np.int64)
    token_starts = np.empty(bs, dtype=np.int64)
    num_tokens = np.zeros(bs, dtype=np.int64)
    i = 0
    token_start = 0
    for r in range(bs):
        ext = max(extend[r], 0)
        token_starts[r] = token_start
        token_start += ext
        seeds[r] = NO_SLOT
        row = rows[r]
        if row == REQ_POOL_IDX_PADDING:
            continue
        num_tokens[r] = ext
        if prefix[r] > 0 and ext > 0:
            seeds[r], oob = translate_slot(r2t[row, prefix[r] - 1], lut, has_lut)
            bad |= oob
        if not fill_verify:
            continue
        needed_from = max(prefix[r] - window + (check_holes == 1), 0) if window > 0 else 0
        for pos in range(starts[r], prefix[r]):
            v_slots[i], oob = translate_slot(r2t[row, pos], lut, has_lut)
            bad |= oob
            if check_holes and v_slots[i] == 0 and pos >= needed_from:
                holes[0, num_holes] = r2t[row, pos]
                holes[1, num_holes] = pos
                holes[2, num_holes] = prefix[r]
                num_holes += 1
            v_prev[i] = NO_SLOT
            if pos > 0:
                v_prev[i], oob = translate_slot(r2t[row, pos - 1], lut, has_lut)
                bad |= oob
            v_pos[i] = pos
            tok = NO_TOKEN
            if has_table:
                idx = pos + offset
                if idx >= 0 and idx < table_lens[r] and idx < table.shape[1]:
                    tok = np.int64(table[row, idx])
            v_tok[i] = tok
            i += 1
    write_slots = np.empty(out_cache_loc.shape[0], dtype=np.int64)
    for t in range(out_cache_loc.shape[0]):
        write_slots[t], oob = translate_slot(out_cache_loc[t], lut, has_lut)
        bad |= oob
    arrays = (v_slots, v_prev, v_pos, v_tok, seeds, token_starts, num_tokens, write_slots)
    return arrays, holes[:, :num_holes], bad


Arrays4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def plan_arrays(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    verify_capacity: int,
    window: int | None,
    lut: torch.Tensor | None,
    table: torch.Tensor | None,
    table_lens: torch.Tensor | None,
    offset: int,
    check_residency: int = 1,
) -> tuple[tuple[int, int, int, int], Arrays4 | None, Arrays4, torch.Tensor | None]:
    """``(totals, verify (slots, prev, positions, tokens) or None when over capacity,
    write (seeds, token_starts, num_tokens, slots), holes or None)``; all CPU int64
    tensors."""
    rows, prefix = _np(req_pool_indices.long()), _np(prefix_lens.long())
    extend = _np(extend_lens.long())
    total_verify, total_extend, total_write, max_write, starts = plan_counts(
        rows, prefix, extend, window or 0
    )
    if total_extend > out_cache_loc.shape[0]:
        raise ValueError(
            f"extend_lens sum to {total_extend} > {out_cache_loc.shape[0]} flat tokens"
        )
    fill_verify = total_verify <= verify_capacity
    has_table = table is not None and table_lens is not None
    r2t = _np(req_to_token)
    table_np = _np(table) if has_table else _EMPTY_TABLE  # type: ignore[arg-type]
    if not rows_in_range(r2t, rows, prefix, table_np, has_table):
        raise IndexError("kv-canary plan: req_to_token index out of range")
    out, holes, bad = _fill(
        r2t, rows, prefix, extend, starts,
        _np(lut.long()) if lut is not None else _EMPTY_LUT, lut is not None,
        table_np, _np(table_lens.long()) if has_table else _EMPTY_LENS,  # type: ignore[union-attr]
        has_table, offset, fill_verify, total_verify if fill_verify else 0,
        _np(out_cache_loc.long()), window or 0, int(check_residency),
    )  # fmt: skip
    if bad:
        raise IndexError("kv-canary plan: slot out of range of the LUT")
    t = [torch.from_numpy(a) for a in out]
    totals = (int(total_verify), int(total_extend), int(total_write), int(max_write))
    verify = (t[0], t[1], t[2], t[3]) if fill_verify else None
    return totals, verify, (t[4], t[5], t[6], t[7]), torch.from_numpy(holes) if holes.shape[1] else None


def build_plans_numba(
    inputs: PlanInputs,
    verify_capacity: int,
    window: int | None,
    lut: torch.Tensor | None,
    offset: int,
    check_residency: int = 1,
) -> CanaryPlans:
    """:func:`kvcanary.canary.plan.reference.build_plans` for CPU tensors (arguments checked there)."""
    totals, verify_arrays, (seeds, starts, counts, slots), holes = plan_arrays(
        inputs.req_to_token, inputs.req_pool_indices, inputs.prefix_lens, inputs.extend_lens,
        inputs.out_cache_loc, verify_capacity=verify_capacity, window=window, lut=lut,
        table=inputs.expected_token_table, table_lens=inputs.expected_token_lens, offset=offset,
        check_residency=check_residency,
    )  # fmt: skip
    total_verify, _, total_write, max_write = totals
    if verify_arrays is None:
        empty = torch.zeros(0, dtype=torch.int64)
        verify = VerifyPlan(empty, empty, empty, empty, False, total_verify)
    else:
        slots_v, prev_v, positions_v, tokens_v = verify_arrays
        verify = VerifyPlan(slots_v, prev_v, positions_v, tokens_v, True, total_verify)
    write = WritePlan(
        seed_slots=seeds,
        token_starts=starts,
        num_tokens=counts,
        token_ids=inputs.input_ids.long(),
        positions=inputs.positions.long(),
        slots=slots,
        max_num_tokens=max_write,
        total_num_tokens=total_write,
        expected_token_ids=long_or_none(inputs.expected_input_ids),
        expected_positions=long_or_none(inputs.expected_positions),
    )
    return CanaryPlans(verify, write, holes)
