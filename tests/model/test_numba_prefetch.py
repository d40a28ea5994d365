"""kvcanary.numba_prefetch: a hint that never faults, reads nothing into the program and
types only 3-D arrays with integer indices."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from kvcanary.numba_prefetch import prefetch


@numba.njit(cache=False)
def _sum_with_hints(a, far):  # type: ignore[no-untyped-def]
    total = 0.0
    for i in range(a.shape[0]):
        prefetch(a, i + far, 0, 0)  # past the end when far is large: a hint, not a read
        for j in range(a.shape[1]):
            for k in range(a.shape[2]):
                total += a[i, j, k]
    prefetch(a, -(1 << 40), 3, 7)
    return total


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_prefetch_past_the_array_neither_faults_nor_changes_results(layout: str) -> None:
    base = np.arange(6 * 4 * 8, dtype=np.float32).reshape(6, 4, 8)
    a = base if layout == "contiguous" else base[::2, :, ::3]
    before = a.copy()
    for far in (0, 3, 1 << 40):
        assert _sum_with_hints(a, far) == pytest.approx(float(before.sum(dtype=np.float64)))
    assert np.array_equal(a, before)


def test_prefetch_types_only_3d_arrays_with_integer_indices() -> None:
    @numba.njit(cache=False)
    def hint_2d(a):  # type: ignore[no-untyped-def]
        prefetch(a, 0, 0, 0)

    @numba.njit(cache=False)
    def hint_float_index(a):  # type: ignore[no-untyped-def]
        prefetch(a, 0.5, 0, 0)

    with pytest.raises(numba.core.errors.TypingError, match="prefetch"):
        hint_2d(np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(numba.core.errors.TypingError, match="prefetch"):
        hint_float_index(np.zeros((2, 2, 2), dtype=np.float32))
