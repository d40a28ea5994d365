"""kvcanary.jit.prefetch: a hint that never faults, reads nothing into the program and
types only arrays with at most ndim integer indices."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from kvcanary.jit.prefetch import prefetch


@numba.njit(cache=False)
def _sum_with_hints(a, far):  # type: ignore[no-untyped-def]
    total = 0.0
    for i in range(a.shape[0]):
        prefetch(a, (i + far, 1, 2))  # past the end when far is large: a hint, not a read
        prefetch(a, i - far)
        for j in range(a.shape[1]):
            for k in range(a.shape[2]):
                total += a[i, j, k]
    prefetch(a, (-(1 << 40), 3))
    return total


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_prefetch_past_the_array_neither_faults_nor_changes_results(layout: str) -> None:
    base = np.arange(6 * 4 * 8, dtype=np.float32).reshape(6, 4, 8)
    a = base if layout == "contiguous" else base[::2, :, ::3]
    before = a.copy()
    for far in (0, 3, 1 << 40):
        assert _sum_with_hints(a, far) == pytest.approx(float(before.sum(dtype=np.float64)))
    assert np.array_equal(a, before)


def test_prefetch_types_only_arrays_with_at_most_ndim_integer_indices() -> None:
    @numba.njit(cache=False)
    def too_many(a):  # type: ignore[no-untyped-def]
        prefetch(a, (0, 0, 0))

    @numba.njit(cache=False)
    def float_index(a):  # type: ignore[no-untyped-def]
        prefetch(a, (0, 0.5))

    @numba.njit(cache=False)
    def not_an_array(a):  # type: ignore[no-untyped-def]
        prefetch(a, 0)

    with pytest.raises(numba.core.errors.TypingError, match="prefetch"):
        too_many(np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(numba.core.errors.TypingError, match="prefetch"):
        float_index(np.zeros((2, 2, 2), dtype=np.float32))
    with pytest.raises(numba.core.errors.TypingError, match="prefetch"):
        not_an_array(3)
