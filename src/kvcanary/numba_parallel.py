"""Parallel numba kernels (``prange``) of the engine's CPU passes: how many threads they
run on and the one lock every call into them takes.

The threads are torch's (``torch.get_num_threads()``, capped by numba's pool): the CPU
passes run between torch's ops, on the same cores. A call holds :data:`_lock`: numba's
``workqueue`` threading layer (its fallback when no OpenMP / TBB is found) must not be
entered by two Python threads at once, and ``numba.set_num_threads`` is per thread.
"""

from __future__ import annotations

import threading
from typing import Any

import numba
import torch

_lock = threading.Lock()
parallel_lock = _lock  # for compiled code that may enter a parallel region itself


def parallel_threads() -> int:
    """The threads a parallel kernel would run on (1: call the serial one instead)."""
    return min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


def run_parallel(kernel: Any, *args: Any) -> Any:
    """``kernel(*args)`` (a ``parallel=True`` dispatcher) on :func:`parallel_threads`
    threads, under the lock."""
    with _lock:
        numba.set_num_threads(parallel_threads())
        return kernel(*args)


def run(serial: Any, parallel: Any, split: bool, *args: Any) -> Any:
    """``parallel(*args)`` (:func:`run_parallel`) when the caller's work is big enough to
    ``split`` and there are threads to split it among, else ``serial(*args)``."""
    if split and parallel_threads() > 1:
        return run_parallel(parallel, *args)
    return serial(*args)
