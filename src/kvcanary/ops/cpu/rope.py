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

import numba
import numpy as np
import torch
from numba import prange

from kvcanary.jit import parallel as numba_parallel
from kvcanary.ops.cpu import rmsnorm as norm_cpu
from kvcanary.ops.cpu.rmsnorm import SQ_SUM_SCRATCH, inv_rms_nb


@numba.njit(cache=True, inline="always")
def _rope_head(x, t, h, weight, has_weight, norm_eps, lanes, cos, sin, dst, dt, dh, a, acc):
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
    r = inv_rms_nb(x[t, h], norm_eps, lanes, acc) if lanes else np.float32(1.0)
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
def _rope_token(x, t, weight, has_weight, norm_eps, lanes, cos, sin, out, a, acc):
    for h in range(x.shape[1]):
        _rope_head(x, t, h, weight, has_weight, norm_eps, lanes, cos, sin, out, t, h, a, acc)


# fastmath=False set, not left to the default: a compiled caller built with fastmath (the
# decode layer, kvcanary.ops.cpu.attention) would otherwise compile these with its flags,
# and their float rounding must stay rope()'s (the same bits).
@numba.njit(cache=True, boundscheck=False, nogil=True, fastmath=False)
def _rope(x, weight, has_weight, norm_eps, lanes, cos, sin, out):
    a = np.empty(x.shape[2], dtype=np.float32)
    acc = np.empty(SQ_SUM_SCRATCH, dtype=np.float32)
    for t in range(x.shape[0]):
        _rope_token(x, t, weight, has_weight, norm_eps, lanes, cos, sin, out, a, acc)


@numba.njit(cache=True, boundscheck=False, nogil=True, parallel=True, fastmath=False)
def _rope_parallel(x, weight, has_weight, norm_eps, lanes, cos, sin, out):
    for t in prange(x.shape[0]):
        a = np.empty(x.shape[2], dtype=np.float32)
        acc = np.empty(SQ_SUM_SCRATCH, dtype=np.float32)
        _rope_token(x, t, weight, has_weight, norm_eps, lanes, cos, sin, out, a, acc)


# Tokens from which the pass splits them among torch's threads. The parallel build is also
# faster per thread ([2048, 6, 32] with the norm: 1.3 ms serial, 0.59 on one thread, 0.30 on
# two); [16, 6, 32] 8.6 -> 4.4 us, [64, 6, 32] 35.9 -> 12.0, [16, 24, 128] 52.8 -> 29.9; but
# [4, 6, 32] 2.6 -> 2.8 and [1, 24, 128] 3.5 -> 5.0 (waking the threads costs more).
_PARALLEL_MIN_TOKENS = 16


@numba.njit(cache=True, inline="always")
def rope_nb(x, weight, has_weight, norm_eps, lanes, cos, sin, out):
    """:func:`rope`'s pass for a compiled caller (the decode layer,
    :mod:`kvcanary.ops.cpu.attention`), on threads from the same token count; ``out``
    ``[tokens, heads, dim]``. The passes keep their own float rounding (``fastmath=False``
    set on them), whatever the caller's flags."""
    if x.shape[0] >= _PARALLEL_MIN_TOKENS:
        _rope_parallel(x, weight, has_weight, norm_eps, lanes, cos, sin, out)
    else:
        _rope(x, weight, has_weight, norm_eps, lanes, cos, sin, out)


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
    w = _NO_WEIGHT if weight is None else weight.numpy()
    lanes = 0 if norm_eps is None else norm_cpu.lanes()
    cos_np, sin_np = tables(cos, sin, tokens, dim)
    args = (x.numpy(), w, weight is not None, np.float32(norm_eps or 0.0), lanes, cos_np, sin_np,
            out.numpy())  # fmt: skip
    numba_parallel.run(_rope, _rope_parallel, tokens >= _PARALLEL_MIN_TOKENS, *args)
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
