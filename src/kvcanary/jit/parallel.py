"""Parallel numba kernels (``prange``) of the engine's CPU passes: how many threads they
run on and the one lock every call into them takes.

The threads are torch's (``torch.get_num_threads()``, capped by numba's pool): the CPU
passes run between torch's ops, on the same cores. A call holds :data:`parallel_lock` (so
do the canary's compiled HEAD / TAIL, which enter parallel regions themselves): numba's
``workqueue`` threading layer (its fallback when no OpenMP / TBB is found) must not be
entered by two Python threads at once, and ``numba.set_num_threads`` is per thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numba
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvcanary.jit.calls import Callee

parallel_lock = threading.Lock()


def launch_threads() -> None:
    """Start numba's threading layer (once; later calls return at once), keeping torch's
    thread count. Compiled code that calls a ``parallel=True`` function (the canary's fused
    HEAD / TAIL) needs the layer's symbols linked before it loads from the on-disk cache,
    which a parallel dispatcher of its own does only at its first call: without it a fresh
    process fails with ``LLVM ERROR: Symbol not found: allocate_sched``. And the OpenMP
    layer's start sets the process's OpenMP thread count to numba's pool size, which is
    torch's count too when both use one libgomp: ``torch.set_num_threads(1)`` would be
    undone by the first parallel kernel."""
    threads = torch.get_num_threads()
    numba.get_num_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


launch_threads()  # at import: before any kernel runs or loads


def parallel_threads() -> int:
    """The threads a parallel kernel would run on (1: call the serial one instead)."""
    return min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


# The count this thread last gave numba.set_num_threads (numba keeps it per thread): set
# again only when it changes (the call costs ~1 us warm, ~5 us right after a forward, and a
# decode step makes a dozen of these calls). Another caller of numba.set_num_threads on the
# same thread can only change how many threads a kernel gets, never its results (the kernels
# here split independent rows; the canary's verify split takes its thread count as an argument).
_threads_set = threading.local()


def set_threads() -> None:
    """Give numba :func:`parallel_threads` on this thread (call under the lock, before a
    compiled call that enters parallel kernels)."""
    threads = parallel_threads()
    if getattr(_threads_set, "count", 0) != threads:
        numba.set_num_threads(threads)
        _threads_set.count = threads


def run_parallel(kernel: Any, *args: Any) -> Any:
    """``kernel(*args)`` (a ``parallel=True`` dispatcher) on :func:`parallel_threads`
    threads, under the lock."""
    with parallel_lock:
        set_threads()
        return kernel(*args)


_compile_both = False


@contextlib.contextmanager
def compiling_both() -> Iterator[None]:
    """Inside the block, :func:`run` also compiles the variant it does not call, for these
    arguments' types (the warm-up's small work takes the serial one; a larger batch later
    takes the threaded one, which must not compile then). The threaded variant only where
    there are threads to run it."""
    global _compile_both
    old, _compile_both = _compile_both, True
    try:
        yield
    finally:
        _compile_both = old


def _compile_for(kernel: Any, args: tuple[Any, ...]) -> None:
    kernel.compile(tuple(numba.typeof(a) for a in args))


def run(serial: Callee, parallel: Any, split: bool, *args: Any) -> Any:
    """``parallel(serial's address, *args)`` (:func:`run_parallel`; a driver that splits the
    serial kernel's ranges, :func:`split_ranges`) when the caller's work is big enough to
    ``split`` and there are threads to split it among, else ``serial``'s kernel on ``args``."""
    threaded = parallel_threads() > 1
    if _compile_both:
        _compile_for(serial.kernel, args)
        if threaded:
            _compile_for(parallel, (serial.address(), *args))
    if split and threaded:
        return run_parallel(parallel, serial.address(), *args)
    return serial.kernel(*args)


@intrinsic
def _num_threads(typingctx):
    """``numba.get_num_threads()`` by the threading layer's symbol (:func:`launch_threads`
    registers it): numba's own calls a ctypes pointer, an address no cached kernel may hold."""

    def codegen(context, builder, signature, args):
        # (declared as numba's parfors declare it, so that both may share one module; the
        # count read as the C int it is)
        fnty = ir.FunctionType(cgutils.intp_t, [])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "get_num_threads")
        count = builder.trunc(builder.call(fn, []), ir.IntType(32))
        return builder.sext(count, cgutils.intp_t)

    return types.int64(), codegen


@numba.njit(cache=True, inline="always")
def split_ranges(lo, hi):
    """How many contiguous parts ``[lo, hi)`` splits into: one a thread, at most one an item
    (the parallel variants of a kernel over ranges, :func:`part_range`)."""
    return max(1, min(_num_threads(), hi - lo))


@numba.njit(cache=True, inline="always")
def part_range(lo, hi, p, parts):
    """Part ``p`` of ``parts`` of ``[lo, hi)``: ``(start, stop)``, sizes differing by at most one."""
    n = hi - lo
    return lo + p * n // parts, lo + (p + 1) * n // parts
