"""CPU RoPE (numba): ``apply_rope``'s rotation, optionally after Qwen3's q/k RMSNorm and a
per-head weight, in one pass.

The torch path is four whole-tensor ops (``x * cos``, a ``cat`` of the halves, ``* sin``, an
add; plus ``* weight`` after Qwen3's q/k norm), each reading and writing every element of
q and k together, which arrive as a strided view of the QKV projection. On the
qwen3-0.6b-shape preset's 1024-token prefill those ops took ~25 ms a layer (13 % of the
forward); one pass here reads each element once and writes it once. Per element it does
exactly the torch path's float32 operations in the same order (``w * x`` rounded, then
``a * cos + b * sin`` as two rounded products and a rounded sum; no fused multiply-add), so
the results are bit for bit the same. The norm, when asked for, is :mod:`kvcanary.ops.cpu.rmsnorm`'s (the
composite ``F.rms_norm``'s bits) on each head's row before the weight.

Halves layout (transformers' ``rotate_half``), ``sin`` sign-folded as
:meth:`~kvcanary.model.rope.RotaryEmbedding.cos_sin` gives it::

    out[d]        = x[d] * cos[d]           + x[d + half] * sin[d]           d < half
    out[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half]
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
import torch
from numba import prange
from numba.core import types

from kvcanary.jit import calls
from kvcanary.jit import parallel as numba_parallel
from kvcanary.jit.calls import Callee, call
from kvcanary.jit.parallel import part_range, split_ranges
from kvcanary.ops.cpu import rmsnorm as norm_cpu
from kvcanary.ops.cpu.rmsnorm import SQ_SUM_SCRATCH, inv_rms_nb


@numba.njit(cache=True, inline="always")
def _rope_head(x, t, h, weight, has_weight, norm_eps, norm, lanes, cos, sin, dst, dt, dh, a, acc):
    """Head ``h`` of token ``t`` of ``x``, normed, weighted and rotated, into the row
    ``dst[dt, dh]`` (``a`` ``[>= dim]``, ``acc``: scratch). The normed, weighted row goes to ``a[:dim]``
    (``x * 1`` is exact: an absent norm or weight changes no bit), then each half of the
    rotation is a loop of its own that the compiler vectorises (writing both halves in one
    loop it did not: a ``[4096, 6, 32]`` rotation alone, one thread, 1.0 -> 0.6 ms), with
    the same products and sums, so the same bits. Offsets past ``half`` are unsigned (numba
    keeps the wrap-around of a signed index it cannot prove non-negative, which compiles
    scalar) and no slice is taken but the norm's row: each view costs two atomic reference
    counts (a tiny-swa decode layer's 64 x 6 heads on two threads: ~25 -> ~7 us without the
    norm)."""
    dim = x.shape[2]
    half = dim // 2
    u = np.uint64  # (unsigned offsets: no wrap-around code, which compiles scalar)
    r = inv_rms_nb(x[t, h], norm_eps, lanes, acc) if norm else np.float32(1.0)
    if has_weight:
        for d in range(dim):
            a[d] = (x[t, h, d] * r) * weight[h, d]
    else:
        for d in range(dim):
            a[d] = x[t, h, d] * r
    for d in range(half):
        dst[dt, dh, d] = a[d] * cos[t, d] + a[u(half) + u(d)] * sin[t, d]
    for d in range(half):
        e = u(half) + u(d)
        dst[dt, dh, e] = a[e] * cos[t, e] + a[d] * sin[t, e]


@numba.njit(cache=True, inline="always")
def _rope_token(x, t, weight, has_weight, norm_eps, norm, lanes, cos, sin, out, a, acc):
    for h in range(x.shape[1]):
        _rope_head(x, t, h, weight, has_weight, norm_eps, norm, lanes, cos, sin, out, t, h, a,
                   acc)  # fmt: skip


def _rope_for(width: int) -> Any:
    # fastmath=False set, not left to the default: a compiled caller built with fastmath (the
    # decode layer, kvcanary.ops.cpu.attention) would otherwise compile these with its flags,
    # and their float rounding must stay rope()'s (the same bits).
    @numba.njit(cache=True, boundscheck=False, nogil=True, fastmath=False)
    def rope_rows(x, weight, has_weight, norm_eps, norm, cos, sin, out, lo, hi):
        a = np.empty(x.shape[2], dtype=np.float32)
        acc = np.empty(SQ_SUM_SCRATCH, dtype=np.float32)
        for t in range(lo, hi):
            _rope_token(x, t, weight, has_weight, norm_eps, norm, width, cos, sin, out, a, acc)

    return rope_rows


# The token kernels, one a norm width (kvcanary.ops.cpu.rmsnorm.WIDTHS): tokens [lo, hi) of x
# (normed first if norm), weighted if has_weight, rotated, into out. Called through their
# addresses (kvcanary.jit.calls) by the parallel pass and the decode layer, so that the body
# compiles once a width. ``x``: any layout (q / k heads are a view of the QKV projection).
_F2, _F3 = types.Array(types.float32, 2, "C"), types.Array(types.float32, 3, "C")
_ROPE_ARGS = (types.Array(types.float32, 3, "A"), _F2, types.boolean, types.float32,
              types.boolean, _F2, _F2, _F3, types.int64, types.int64)  # fmt: skip
ROPE = {w: Callee(k, types.none, *_ROPE_ARGS)
        for w, k in norm_cpu.per_width(_rope_for, "_rope").items()}  # fmt: skip
_ROPE_T = ROPE[8].type


@numba.njit(cache=True, boundscheck=False, nogil=True, parallel=True, fastmath=False)
def _rope_parallel(rope_fn, x, weight, has_weight, norm_eps, norm, cos, sin, out, lo, hi):
    """A token kernel of :data:`ROPE` (at address ``rope_fn``) on one contiguous part of the
    tokens a thread: the same bits."""
    parts = split_ranges(lo, hi)
    for p in prange(parts):
        a, b = part_range(lo, hi, p, parts)
        call(_ROPE_T, rope_fn, (x, weight, has_weight, norm_eps, norm, cos, sin, out, a, b))


ROPE_PARALLEL = Callee(_rope_parallel, types.none, types.int64, *_ROPE_ARGS)
_ROPE_PARALLEL_T = ROPE_PARALLEL.type


# Tokens from which the pass splits them among torch's threads. The parallel build is also
# faster per thread ([2048, 6, 32] with the norm: 1.3 ms serial, 0.59 on one thread, 0.30 on
# two); [16, 6, 32] 8.6 -> 4.4 us, [64, 6, 32] 35.9 -> 12.0, [16, 24, 128] 52.8 -> 29.9; but
# [4, 6, 32] 2.6 -> 2.8 and [1, 24, 128] 3.5 -> 5.0 (waking the threads costs more).
_PARALLEL_MIN_TOKENS = 16


@numba.njit(cache=True, inline="always")
def rope_nb(fns, x, weight, has_weight, norm_eps, lanes, cos, sin, out):
    """:func:`rope`'s pass for a compiled caller (the decode layer,
    :mod:`kvcanary.ops.cpu.attention`), on threads from the same token count; ``out``
    ``[tokens, heads, dim]``; ``fns``: :func:`addresses`. The passes keep their own float
    rounding (``fastmath=False`` set on them, and called through their addresses), whatever
    the caller's flags."""
    n, norm = x.shape[0], lanes != 0
    if n >= _PARALLEL_MIN_TOKENS:
        call(_ROPE_PARALLEL_T, fns[1], (fns[0], x, weight, has_weight, norm_eps, norm, cos, sin,
                                        out, 0, n))  # fmt: skip
    else:
        call(_ROPE_T, fns[0], (x, weight, has_weight, norm_eps, norm, cos, sin, out, 0, n))


@functools.cache
def addresses() -> np.ndarray:
    """:func:`rope_nb`'s ``fns``: the addresses of this process's token kernel
    (:func:`width`) and of :data:`ROPE_PARALLEL`."""
    return calls.addresses(ROPE[width()], ROPE_PARALLEL)


def width() -> int:
    """The norm width of this process's token kernel: the norm's
    (:func:`kvcanary.ops.cpu.rmsnorm.lanes`), or 8 where it has none (then only ``x`` without
    a norm is taken)."""
    return norm_cpu.lanes() or 8


def applies(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`rope` takes these (else the torch path): CPU float32 ``x [tokens,
    heads, dim]`` with an even ``dim``, outside ``torch.compile`` tracing."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and cos.dtype == torch.float32
        and x.dim() == 3
        and x.shape[-1] % 2 == 0
        and not torch.compiler.is_compiling()
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         weight: torch.Tensor | None = None, norm_eps: float | None = None) -> torch.Tensor:  # fmt: skip
    """``apply_rope(rms_norm(x) * weight, cos, sin)`` (``weight [heads, dim]``, or None: no
    weight; ``norm_eps`` None: no norm) as a new contiguous ``[tokens, heads, dim]`` tensor;
    ``cos`` / ``sin`` ``[tokens, 1, dim]``. Call only where :func:`applies` (and, with a
    norm, :func:`kvcanary.ops.cpu.rmsnorm.applies`)."""
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=torch.float32, device=x.device)
    w = _NO_WEIGHT if weight is None else np.ascontiguousarray(weight.numpy())
    cos_np, sin_np = tables(cos, sin, tokens, dim)
    args = (x.numpy(), w, weight is not None, np.float32(norm_eps or 0.0), norm_eps is not None,
            cos_np, sin_np, out.numpy(), 0, tokens)  # fmt: skip
    numba_parallel.run(ROPE[width()], _rope_parallel, tokens >= _PARALLEL_MIN_TOKENS, *args)
    return out


_NO_WEIGHT = np.ones((1, 1), dtype=np.float32)
# The last (cos, sin) tensors seen and their [tokens, dim] numpy views: every layer of a
# forward rotates with the same two tensors (one rope, made per forward), so the views are
# made once a forward instead of per layer (four small ops each time). A view shares its
# tensor's memory ([tokens, 1, dim] -> [tokens, dim] never copies), so a write into the
# tensors shows through it; holding the tensors keeps their identities from being reused.
_last_tables: tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray] | None = None


def tables(cos: torch.Tensor, sin: torch.Tensor, tokens: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` / ``sin`` (``[tokens, 1, dim]``) as ``[tokens, dim]`` numpy views, made once for
    the two tensors the layers of a forward share (above)."""
    global _last_tables
    last = _last_tables
    if last is not None and last[0] is cos and last[1] is sin:
        return last[2], last[3]
    cos_np, sin_np = cos.reshape(tokens, dim).numpy(), sin.reshape(tokens, dim).numpy()
    _last_tables = (cos, sin, cos_np, sin_np)
    return cos_np, sin_np
