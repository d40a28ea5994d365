"""numba_parallel.run_parallel: the kernels run on torch's thread count as it changes."""

from __future__ import annotations

import numba
import pytest
import torch

from kvcanary.jit import parallel as numba_parallel


@numba.njit(parallel=True)
def _threads_inside(out):  # type: ignore[no-untyped-def]
    for i in numba.prange(out.shape[0]):
        out[i] = numba.get_num_threads()
    return out[0]


def test_run_parallel_follows_torch_thread_count() -> None:
    """The count numba is given is re-set only when torch's changes: each call's kernel sees
    the count of that moment (1 -> 2 -> 1 -> 1 ...), never a stale one."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.fail("this test needs numba's pool to hold at least 2 threads")
    before = torch.get_num_threads()
    try:
        for count in (2, 1, 1, 2, 2, 1):
            torch.set_num_threads(count)
            seen = numba_parallel.run_parallel(_threads_inside, torch.zeros(4, dtype=torch.int64).numpy())
            assert seen == min(count, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(before)
