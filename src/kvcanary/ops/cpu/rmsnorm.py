"""CPU RMSNorm (numba): torch's float32 ``rms_norm``, bit for bit, in one pass per row.

On the CPU ``F.rms_norm`` runs as a composite of small ops (``pow``, ``mean`` = ``sum`` then
``div_``, ``add_``, ``rsqrt``, two ``mul``, and the ``to`` copies between them): ~12 us a
call on a tiny model's decode row, 19 calls a tiny-swa decode step (13 % of its time,
torch profiler). Here each row is read once and written once, with the composite's float32
operations in its order::

    s   = torch's CPU float32 sum of x * x (below)      mean = s / D    (a true division)
    r   = 1 / sqrt(mean + eps)                           (rsqrt: a rounded sqrt, a rounded
                                                           division)
    out = (x * r) * weight                               (each product rounded; no FMA)

torch's CPU sum of a contiguous row (``SumKernel.cpp``: ``vectorized_inner_sum`` ->
``row_sum`` -> ``multi_row_sum``) adds W-lane vectors in a fixed tree: the row's whole
vectors are seen as rows of 4 (ILP), summed into cascade levels of 16 (so that only sums of
similar size meet), the 4 partial vectors folded left to right, then the tail elements and
the W lanes added one by one to 0. W is the vector width torch's reduction kernels were
dispatched with, which need not be the widest the CPU has (this machine: AVX-512 CPU, 8-lane
AVX2 sums), so it is found by probing: :func:`lanes` runs this pass with W = 8, 16 and 4 on
rows that exercise every branch (tails, the ILP remainder, several cascade levels) and keeps
the first whose bits equal ``F.rms_norm``'s; none (another torch, another CPU) leaves the
torch path in place. The probe only picks a width: the tests compare the pass with torch on
rows of many lengths.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba import prange
from numba.core import types

from kvcanary.jit import parallel as numba_parallel
from kvcanary.jit.calls import Callee, call
from kvcanary.jit.parallel import parallel_threads, part_range, split_ranges

_ILP, _LEVELS = 4, 4  # torch's row_sum ILP factor, multi_row_sum's cascade levels
_MAX_LANES = 16
SQ_SUM_SCRATCH = (_LEVELS, _ILP * _MAX_LANES)  # sq_sum_nb's acc, for any width
# Up to torch's parallel grain (32768 elements) the pass wins on one thread (one read):
# [1, 128] 3.8 vs 8.3 us, [64, 128] 8.6 vs 11.9, [32, 1024] 16.9 vs 28.9; above it torch's
# ops run on every thread and beat one ([64, 1024] 30.5 vs 25.0 us, [512, 128] 40 vs 26),
# so larger inputs take the pass on torch's threads (rows split among them; no threads to
# split among: the torch ops).
_MAX_ELEMENTS = 32768
# From here the pass splits rows among torch's threads (the same row body): [64, 128] 7.4
# -> 4.6 us, [16, 1024] 9.0 -> 6.6, [64, 1024] 33.8 -> 18.8; [16, 128] 2.1 -> 3.0 (waking
# the threads costs more than they save).
_PARALLEL_MIN_ROWS, _PARALLEL_MIN_ELEMENTS = 16, 8192


@numba.njit(cache=True, inline="always")
def sq_sum_nb(row, lanes, acc):
    """torch's CPU float32 ``(row * row).sum()`` (module doc) of a contiguous 1-D float32
    ``row`` for ``lanes``-wide vectors; ``acc``: float32 scratch ``SQ_SUM_SCRATCH``.

    The 4 ILP vectors of one multi_row_sum "row" are 4 * lanes consecutive elements, each
    element's own accumulator a column: the adds run over contiguous columns (they
    vectorise) in exactly torch's order per column."""
    d = row.shape[0]
    if d < lanes:  # scalar_inner_sum: the same tree over single elements
        lanes = 1
    nvec = d // lanes
    width = _ILP * lanes  # columns: (ILP vector k, lane) -> k * lanes + lane
    size = nvec // _ILP  # multi_row_sum's rows
    ceil_log2 = 1
    while (1 << ceil_log2) < size:
        ceil_log2 += 1
    level_power = max(4, ceil_log2 // _LEVELS)
    level_step = 1 << level_power
    level_mask = level_step - 1
    # Without a whole level step the upper levels stay 0 and adding them changes no bit
    # (the sums are >= +0): they are skipped.
    cascade = size >= level_step
    for j in range(_LEVELS if cascade else 1):
        for c in range(width):
            acc[j, c] = 0
    # (Unsigned offsets: numba keeps the negative-index wrap-around of a signed index it
    # cannot prove non-negative, such as base + c, which compiled these loops scalar; and
    # no slices: a view costs two atomic reference counts, ~130 ns a 32-wide RoPE head in
    # all. [64, 128] rows, one thread, 16.4 -> 13.1 us, two 8.2 -> 6.5.)
    u = np.uint64
    i = 0
    while i + level_step <= size:
        for _ in range(level_step):
            base = u(i) * u(width)
            for c in range(width):
                v = row[base + u(c)]
                acc[0, c] += v * v
            i += 1
        for j in range(1, _LEVELS):
            for c in range(width):
                acc[j, c] += acc[j - 1, c]
                acc[j - 1, c] = 0
            if (i & (level_mask << (j * level_power))) != 0:
                break
    while i < size:
        base = u(i) * u(width)
        for c in range(width):
            v = row[base + u(c)]
            acc[0, c] += v * v
        i += 1
    for j in range(1, _LEVELS if cascade else 1):
        for c in range(width):
            acc[0, c] += acc[j, c]
    for vec in range(size * _ILP, nvec):  # row_sum's remainder vectors, into partial 0
        base = u(vec) * u(lanes)
        for lane in range(lanes):
            v = row[base + u(lane)]
            acc[0, lane] += v * v
    for k in range(1, _ILP):
        base = u(k) * u(lanes)
        for lane in range(lanes):
            acc[0, lane] += acc[0, base + u(lane)]
    total = np.float32(0)
    for e in range(nvec * lanes, d):  # the elements past the last whole vector
        v = row[e]
        total += v * v
    for lane in range(lanes):
        total += acc[0, lane]
    return total


@numba.njit(cache=True, inline="always")
def inv_rms_nb(row, eps, lanes, acc):
    """``1 / sqrt(mean(row * row) + eps)`` as torch's composite rounds it (float32); ``lanes``:
    a compile-time constant in every kernel that inlines this (:data:`WIDTHS`: ~1.25x faster
    than a run-time width, 512 rows of 128)."""
    total = sq_sum_nb(row, lanes, acc)
    mean = total / np.float32(row.shape[0])
    return np.float32(1) / np.sqrt(mean + eps)


@numba.njit(cache=True, inline="always")
def _rms_row(x, t, weight, has_weight, eps, lanes, acc, out):
    r = inv_rms_nb(x[t], eps, lanes, acc)
    if has_weight:
        for e in range(x.shape[1]):
            out[t, e] = (x[t, e] * r) * weight[e]
    else:
        for e in range(x.shape[1]):
            out[t, e] = x[t, e] * r


@numba.njit(cache=True, inline="always")
def _add_rms_row(x, y, t, weight, eps, lanes, acc, total, out):
    for e in range(x.shape[1]):
        total[t, e] = x[t, e] + y[t, e]
    r = inv_rms_nb(total[t], eps, lanes, acc)
    for e in range(x.shape[1]):
        out[t, e] = (total[t, e] * r) * weight[e]


# The vector widths :func:`lanes` tries, in order. Each row kernel is compiled once per width
# it runs with (the width a constant of the kernel, a closure variable: numba's cache keys it),
# so a process compiles one copy of the sum: three in one kernel (a branch per width) took
# ~5x the compile time.
WIDTHS = (8, 16, 4)


def per_width(make: Any, name: str) -> dict[int, Any]:
    """``{width: make(width)}`` for :data:`WIDTHS`; each kernel's name ``<name>_w<width>``
    (numba's cache files, the warm-up's progress line)."""
    kernels = {}
    for width in WIDTHS:
        kernel = make(width)
        kernel.py_func.__qualname__ = kernel.py_func.__name__ = f"{name}_w{width}"
        kernels[width] = kernel
    return kernels


def _rms_rows_for(width: int) -> Any:
    @numba.njit(cache=True, boundscheck=False, nogil=True)
    def rms_rows(x, weight, has_weight, eps, out, lo, hi):
        acc = np.empty(SQ_SUM_SCRATCH, dtype=np.float32)
        for t in range(lo, hi):
            _rms_row(x, t, weight, has_weight, eps, width, acc, out)

    return rms_rows


def _add_rms_rows_for(width: int) -> Any:
    @numba.njit(cache=True, boundscheck=False, nogil=True)
    def add_rms_rows(x, y, weight, eps, total, out, lo, hi):
        acc = np.empty(SQ_SUM_SCRATCH, dtype=np.float32)
        for t in range(lo, hi):
            _add_rms_row(x, y, t, weight, eps, width, acc, total, out)

    return add_rms_rows


# The row kernels: rows [lo, hi) of x normed into out (weighted if has_weight); with the add,
# total = x + y first. Called through their addresses (kvcanary.jit.calls) by the parallel
# passes and the compiled decode forward, so that the row body compiles once a width.
_A1, _A2 = types.Array(types.float32, 1, "C"), types.Array(types.float32, 2, "C")
_RMS_ARGS = (_A2, _A1, types.boolean, types.float32, _A2, types.int64, types.int64)
_ADD_RMS_ARGS = (_A2, _A2, _A1, types.float32, _A2, _A2, types.int64, types.int64)
RMS_ROWS = {w: Callee(k, types.none, *_RMS_ARGS)
            for w, k in per_width(_rms_rows_for, "_rms_rows").items()}  # fmt: skip
ADD_RMS_ROWS = {w: Callee(k, types.none, *_ADD_RMS_ARGS)
                for w, k in per_width(_add_rms_rows_for, "_add_rms_rows").items()}  # fmt: skip
_RMS_ROWS_T, _ADD_RMS_ROWS_T = RMS_ROWS[8].type, ADD_RMS_ROWS[8].type


@numba.njit(cache=True, boundscheck=False, nogil=True, parallel=True)
def _rms_rows_parallel(rows_fn, x, weight, has_weight, eps, out, lo, hi):
    """A row kernel of :data:`RMS_ROWS` (at address ``rows_fn``) on one contiguous part of
    the rows a thread: the same bits."""
    parts = split_ranges(lo, hi)
    for p in prange(parts):
        a, b = part_range(lo, hi, p, parts)
        call(_RMS_ROWS_T, rows_fn, (x, weight, has_weight, eps, out, a, b))


@numba.njit(cache=True, boundscheck=False, nogil=True, parallel=True)
def _add_rms_rows_parallel(rows_fn, x, y, weight, eps, total, out, lo, hi):
    """A row kernel of :data:`ADD_RMS_ROWS` (at address ``rows_fn``), as
    :func:`_rms_rows_parallel`."""
    parts = split_ranges(lo, hi)
    for p in prange(parts):
        a, b = part_range(lo, hi, p, parts)
        call(_ADD_RMS_ROWS_T, rows_fn, (x, y, weight, eps, total, out, a, b))


_NO_WEIGHT = np.ones(1, dtype=np.float32)
_lanes: int | None = None  # lanes(), once probed


def lanes() -> int:
    """The vector width of torch's float32 CPU sums (module doc), or 0 when no width this
    pass knows reproduces ``F.rms_norm`` bit for bit here (probed once)."""
    global _lanes
    if _lanes is None:
        _lanes = _probe()
    return _lanes


def _probe() -> int:
    gen = torch.Generator().manual_seed(0)
    # Rows shorter than a vector, tails, ILP remainders, one and several cascade levels.
    rows = [torch.randn(3, d, generator=gen) * 7 for d in (5, 24, 100, 128, 1000, 5003)]
    weights = [torch.randn(x.shape[1], generator=gen) for x in rows]
    for width in WIDTHS:
        if all(torch.equal(_rms(x, w, 1e-6, width), F.rms_norm(x, (x.shape[1],), w, 1e-6))
               for x, weight in zip(rows, weights, strict=True) for w in (weight, None)):  # fmt: skip
            return width
    return 0


def applies(x: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` / :func:`add_rms_norm` take ``x`` (else the torch ops, the
    same bits): CPU float32 (dtypes are singletons), at least one element (more than
    ``_MAX_ELEMENTS``, a prefill's rows: only with threads to split them among; without, the
    torch ops), not requiring grad (autograd needs the torch ops), outside ``torch.compile``
    tracing, and a width found. (Called per norm: cheapest tests first.)"""
    return (
        x.dtype is torch.float32
        and x.is_cpu
        and x.numel() > 0
        and (x.numel() <= _MAX_ELEMENTS or parallel_threads() > 1)
        and not x.requires_grad
        and (_lanes if _lanes is not None else lanes()) > 0
        and not torch.compiler.is_compiling()
    )


def _np(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray((t.detach() if t.requires_grad else t).numpy())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous rows ``[-1, x.shape[-1]]`` (itself when it is already)."""
    return (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()


def _split(rows: torch.Tensor) -> bool:
    """Whether the pass over ``rows`` is worth splitting among torch's threads: from
    ``_PARALLEL_MIN_*``, and always past ``_MAX_ELEMENTS`` (:func:`applies` takes those only
    with threads)."""
    n = rows.numel()
    return n > _MAX_ELEMENTS or (rows.shape[0] >= _PARALLEL_MIN_ROWS and n >= _PARALLEL_MIN_ELEMENTS)


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float, width: int) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty_like(rows)
    args = (rows.numpy(), _NO_WEIGHT if weight is None else _np(weight), weight is not None,
            np.float32(eps), out.numpy(), 0, rows.shape[0])  # fmt: skip
    numba_parallel.run(RMS_ROWS[width], _rms_rows_parallel, _split(rows), *args)
    return out if x.dim() == 2 else out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (x.shape[-1],), weight, eps)``, the same bits, as a new contiguous
    tensor. Call only where :func:`applies`."""
    return _rms(x, weight, eps, lanes())


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(x + y, F.rms_norm(x + y, ..., weight, eps))``, the same bits, in one pass (the
    residual add before a pre-norm block). Call only where :func:`applies` (``x``, ``y`` of
    one shape)."""
    rows_x, rows_y = _rows(x), _rows(y)
    total, out = torch.empty_like(rows_x), torch.empty_like(rows_x)
    args = (rows_x.numpy(), rows_y.numpy(), _np(weight), np.float32(eps), total.numpy(),
            out.numpy(), 0, rows_x.shape[0])  # fmt: skip
    numba_parallel.run(ADD_RMS_ROWS[lanes()], _add_rms_rows_parallel, _split(rows_x), *args)
    if x.dim() == 2:
        return total, out
    return total.view(x.shape), out.view(x.shape)
