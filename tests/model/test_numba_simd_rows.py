"""kvcanary.jit.simd's row reductions (softmax's maximum and sum in the CPU attention
kernels): numpy's maximum, NaN passed over, and a sum in the documented fixed order."""

from __future__ import annotations

import numba
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvcanary.jit.simd import LANES, row_max, row_sum


@numba.njit(cache=False)
def _max(x, i, n):  # type: ignore[no-untyped-def]
    return row_max(x, i, n)


@numba.njit(cache=False)
def _sum(x, i, n):  # type: ignore[no-untyped-def]
    return row_sum(x, i, n)


def _documented_sum(row: np.ndarray) -> np.float32:
    """row_sum's order in float32: lane k over elements k, k + 8, ... of the whole vectors,
    the lanes folded 8 -> 4 -> 2 -> 1 (lane k + half into lane k), then the tail in order."""
    whole = row.shape[0] // LANES * LANES
    lanes = [np.float32(0.0)] * LANES
    for j in range(whole):
        lanes[j % LANES] = np.float32(lanes[j % LANES] + row[j])
    half = LANES // 2
    while half:
        lanes = [np.float32(lanes[k] + lanes[k + half]) for k in range(half)]
        half //= 2
    total = lanes[0]
    for j in range(whole, row.shape[0]):
        total = np.float32(total + row[j])
    return total


_finite = st.floats(-1e6, 1e6, width=32)


@settings(max_examples=200, deadline=None)
@given(rows=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(0, 40)), elements=_finite),
       data=st.data())  # fmt: skip
def test_row_max_and_sum_over_a_prefix(rows: np.ndarray, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, rows.shape[0] - 1))
    n = data.draw(st.integers(0, rows.shape[1]))
    prefix = rows[i, :n]
    want_max = prefix.max() if n else np.float32(-np.inf)
    assert _max(rows, i, n) == want_max
    got = _sum(rows, i, n)
    assert np.float32(got).tobytes() == _documented_sum(prefix).tobytes()
    assert got == np.float32(prefix.astype(np.float64).sum()) or abs(
        got - prefix.astype(np.float64).sum()
    ) <= 1e-5 * max(1.0, float(np.abs(prefix).astype(np.float64).sum()))


def test_row_reductions_read_only_the_prefix_of_a_strided_row() -> None:
    base = np.arange(4 * 40, dtype=np.float32).reshape(4, 40) - 80
    rows = base[::2, ::1]  # every other row: a row stride of two rows
    rows[1, 30:] = 1e9  # past n: never read
    assert _max(rows, 1, 30) == rows[1, :30].max()
    assert _sum(rows, 1, 30) == _documented_sum(rows[1, :30])


def test_row_max_passes_over_nan() -> None:
    rows = np.array([[1.0, np.nan, 3.0, -2.0] * 5], dtype=np.float32)
    assert _max(rows, 0, 20) == 3.0
    assert _max(rows, 0, 2) == 1.0  # the NaN in the scalar tail
    rows[0, 9] = np.nan  # and in a whole vector
    assert _max(rows, 0, 16) == 3.0
