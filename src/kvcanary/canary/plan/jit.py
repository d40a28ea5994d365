"""Compiled building blocks of the two CPU plan builders (:mod:`.plan_numba`, which
materialises plans, and :mod:`.row_plan`, which keeps them per batch row): slot translation,
the per-row entry counts and the one bounds check of the req->token reads. Both walks call
these, so they count, translate and refuse the same inputs the same way.
"""

from __future__ import annotations

import numba
import numpy as np

from kvcanary.canary.wire.constants import REQ_POOL_IDX_PADDING


@numba.njit(cache=True, inline="always")
def translate_slot(slot, lut, has_lut):
    """``(translated slot, out of range?)``; raising here would slow the loops ~15x, so
    callers collect the flag and the wrapper raises."""
    if not has_lut or slot < 0:
        return np.int64(slot), False
    if slot >= lut.shape[0]:
        return np.int64(0), True
    return np.int64(lut[slot]), False


@numba.njit(cache=True)
def plan_counts(rows, prefix, extend, window):
    """(total_verify, total_extend, total_write, max_write) and each row's verify start."""
    bs = rows.shape[0]
    starts = np.zeros(bs, dtype=np.int64)
    total_verify = total_extend = total_write = max_write = 0
    for r in range(bs):
        ext = max(extend[r], 0)
        total_extend += ext
        if rows[r] == REQ_POOL_IDX_PADDING:
            continue
        start = max(prefix[r] - window, 0) if window > 0 else 0
        starts[r] = start
        total_verify += max(prefix[r] - start, 0)
        total_write += ext
        max_write = max(max_write, ext)
    return total_verify, total_extend, total_write, max_write, starts


@numba.njit(cache=True)
def rows_in_range(r2t, rows, prefix, table, has_table):
    """Every req->token (and expected-token) read of :func:`.plan_numba._fill` and :func:`.row_plan._plan_rows` is inside its table;
    checked once per row, so the loops need no bounds checks."""
    for r in range(rows.shape[0]):
        row = rows[r]
        if row == REQ_POOL_IDX_PADDING:
            continue
        if row < 0 or row >= r2t.shape[0] or prefix[r] > r2t.shape[1]:
            return False
        if has_table and row >= table.shape[0]:
            return False
    return True
