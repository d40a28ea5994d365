"""kvcanary.jit.calls: a compiled driver calls a kernel through its address, with the
kernel's results, errors and argument conversions; the ranges a parallel variant splits."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba.core import types
from numba.core.errors import TypingError

from kvcanary.jit import parallel as numba_parallel
from kvcanary.jit.calls import Callee, call


@numba.njit
def _scale_rows(x, factor, out, lo, hi):  # type: ignore[no-untyped-def]
    for t in range(lo, hi):
        for e in range(x.shape[1]):
            out[t, e] = x[t, e] * factor
    return hi - lo


@numba.njit
def _checked(n):  # type: ignore[no-untyped-def]
    if n < 0:
        raise ValueError("negative")
    return n * 2


_F2 = types.Array(types.float64, 2, "C")
SCALE = Callee(_scale_rows, types.int64, types.Array(types.float64, 2, "A"), types.float64, _F2,
               types.int64, types.int64)  # fmt: skip
_SCALE_T = SCALE.type
CHECKED = Callee(_checked, types.int64, types.int64)
_CHECKED_T = CHECKED.type


@numba.njit
def _driver(fn, x, factor, out):  # type: ignore[no-untyped-def]
    half = x.shape[0] // 2
    done = call(_SCALE_T, fn, (x, factor, out, 0, half))
    return done + call(_SCALE_T, fn, (x, factor, out, half, x.shape[0]))


@numba.njit
def _checked_driver(fn, n):  # type: ignore[no-untyped-def]
    return call(_CHECKED_T, fn, (n,)) + 1


@numba.njit
def _wrong_dtype(fn, x, out):  # type: ignore[no-untyped-def]
    return call(_SCALE_T, fn, (x, 2.0, out, 0, 1))


@numba.njit(parallel=True)
def _parts(lo, hi, out):  # type: ignore[no-untyped-def]
    parts = numba_parallel.split_ranges(lo, hi)
    for p in numba.prange(parts):
        a, b = numba_parallel.part_range(lo, hi, p, parts)
        for i in range(a, b):
            out[i] += 1
    return parts


def test_a_driver_calls_the_kernel_through_its_address() -> None:
    """Both halves of the rows scaled through the address, as one direct call would; a
    C-contiguous argument converted to the declared any-layout array; the address is that
    of the declared signature (one compile) and stable."""
    x = np.arange(12, dtype=np.float64).reshape(6, 2)
    out = np.zeros_like(x)
    assert _driver(SCALE.address(), x, 3.0, out) == 6
    assert np.array_equal(out, x * 3.0)
    assert SCALE.address() == SCALE.address()
    assert _scale_rows.signatures == [SCALE.type.signature.args]
    strided = np.arange(24, dtype=np.float64).reshape(6, 4)[:, ::2]  # a non-contiguous view
    out[:] = 0
    assert _driver(SCALE.address(), strided, 0.5, out) == 6
    assert np.array_equal(out, strided * 0.5)


def test_the_callee_error_reaches_the_driver_caller() -> None:
    assert _checked_driver(CHECKED.address(), 4) == 9
    with pytest.raises(ValueError, match="negative"):
        _checked_driver(CHECKED.address(), -1)


def test_arguments_the_declared_signature_cannot_take_fail_to_compile() -> None:
    """float32 rows for a float64 signature: a typing error, never a call with the wrong
    layout in memory."""
    x32 = np.zeros((2, 2), dtype=np.float32)
    with pytest.raises(TypingError):
        _wrong_dtype(SCALE.address(), x32, np.zeros((2, 2)))


@pytest.mark.parametrize(("lo", "hi"), [(0, 1), (0, 2), (3, 10), (0, 101)])
def test_split_ranges_cover_every_item_once(lo: int, hi: int) -> None:
    """Parts of [lo, hi) on two threads: each item in exactly one part, nothing outside."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.fail("this test needs numba's pool to hold at least 2 threads")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = np.zeros(hi + 3, dtype=np.int64)
        parts = numba_parallel.run_parallel(_parts, lo, hi, out)
    finally:
        torch.set_num_threads(before)
    assert parts == min(2, hi - lo)
    want = np.zeros_like(out)
    want[lo:hi] = 1
    assert np.array_equal(out, want)
