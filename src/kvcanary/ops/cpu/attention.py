"""Decode and extend (prefill) attention on the CPU straight from the paged K/V buffers
(numba).

The torch path (:class:`~kvcanary.engine.attention.PagedAttentionBackend`) gathers every
request's keys and values into a padded ``[bs, kv heads, max_keys, dim]`` copy per layer
(``index_select``) and runs masked SDPA on it: per decode step it writes and reads the whole
visible KV twice more than attention needs. Here one compiled loop per request (per group of
its KV heads when the batch is smaller than four times the threads) reads each key and value row
where it lies in the pool, once, through the request's slot row: scores for the query
heads, softmax, weighted sum.
Measured (microbenchmark, this repo's 2-core machine, random slots, us per layer; torch =
gather + SDPA, whose time varies run to run): Qwen3-0.6B shapes (16 q / 8 kv heads, dim
128) batch 16 x 64 keys 690 vs 365, batch 64 x 80 keys 2957..15061 vs 1281; tiny-swa shapes
(4 / 2 heads, dim 32) batch 16 x 160 keys 110 vs 60, batch 1 x 100 keys 38 vs 11.

Decode only (one query per request, every key of the request's row visible: the caller's
key table already starts at the window for sliding layers), float32 K/V and queries. The
softmax runs in float32 with the maximum subtracted, like SDPA's, its exp a polynomial the
compiler vectorises (:func:`_exp_one`, within 5 ulps; tiny-swa decode tokens/s +5 %
at batch 16 and 64, ``kvcanary bench engine``); results differ from SDPA's by float rounding
only (~1e-6). A request's result depends on its own row only. Rows with no
key (graph padding) read slot 0, as the torch path's masks make them do. A slot outside the
buffer, or a key count past the slot table's width, raises ``IndexError`` before anything is
read (as ``index_select`` does).

Work of at least :data:`PARALLEL_MIN_WORK` multiply-adds runs on ``torch.get_num_threads()``
numba threads (a parallel launch costs ~10 us; smaller work runs on one), under
:mod:`kvcanary.jit.parallel`'s lock.

:func:`extend_attention` is a prefill's (or any extend forward's) attention: per request
and KV head, its keys gathered once, then each query over exactly the keys it may see
(causal; within the window on sliding layers). The torch path pads every request to the
longest, builds an additive mask and runs SDPA over all of it: a sliding layer's query
computes scores for every key of the table, not its W.

:func:`decode_layer` runs a decode layer's RoPE (with Qwen3's q/k norm), the K/V store and
this attention as one compiled call, from the QKV projection as the GEMM leaves it (no
q / k / v views made): one call a layer instead of three (rope, two ``index_copy_``,
attention) and their Python, the same bits
(the rotation is :mod:`kvcanary.ops.cpu.rope`'s, compiled apart so that this kernel's
``fastmath`` never reaches it). The backend takes it where the store is the pool's own or
the canary store check's wrapper of it, whose observation it then makes with the k rows the
kernel stored (:meth:`~kvcanary.engine.attention.PagedAttentionBackend.rope_forward`). tiny-swa shapes,
batch 16 x 100 random keys, warm: 45 us against 62 for the three calls (batch 64 x 150:
338 against 374: attention itself is most of it there).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
import torch
from numba import prange
from numba.core import types as nbtypes

from kvcanary.jit import calls
from kvcanary.jit import parallel as numba_parallel
from kvcanary.jit.calls import Callee, call
from kvcanary.jit.parallel import part_range, split_ranges
from kvcanary.jit.prefetch import prefetch
from kvcanary.jit.simd import (
    LANES,
    axpy1,
    axpy1x2,
    axpy4,
    axpy4x2,
    dot8,
    dot8x2,
    f32_from_bits,
    row_max,
    row_sum,
)
from kvcanary.ops.cpu import rmsnorm as norm_cpu
from kvcanary.ops.cpu import rope as rope_cpu

# bs x kv heads x keys x dim below which one thread does the work.
PARALLEL_MIN_WORK = 1 << 15
# _decode_layer's status when it did nothing (a shape or a slot it does not take).
_LAYER_REFUSED = -2
# _attend asks for a key's K rows this many keys before it reads them (one block of the
# vector kernels' 8 keys; 4 and 8 measured alike a key at a time, 16 no better), and for its
# V rows when it reads its K, when a key's rows of the task's heads are at most
# _PREFETCH_MAX_FLOATS long. Microbenchmark, 64 MB written between calls, pages of 4 slots
# in random order, us (none / ahead 4): 64 requests x 32 keys tiny-swa shapes (2 KV heads x
# 32) 359 / 226, x 130 keys 988 / 615; 8 tasks x 300 keys of one 128-wide head 267 / 205
# (warm: 83 / 86). A key's rows of Qwen3-0.6B's 8 heads (4 KB, a task per request at batch
# 16) are long runs the hardware prefetcher follows: 1073 / 1211 with every line asked for.
_PREFETCH_KEYS = 8
_PREFETCH_MAX_FLOATS = 128
_LINE_FLOATS = 16  # float32s in a 64-byte cache line


@numba.njit(cache=True, inline="always")
def _check_reads(slots, num_keys, num_slots, bs):  # type: ignore[no-untyped-def]
    """The first request row whose keys are not all in the buffer (or past the slot table's
    width), or -1."""
    for b in range(bs):
        if num_keys[b] > slots.shape[1]:
            return b
        for j in range(max(num_keys[b], 1)):
            if slots[b, j] < 0 or slots[b, j] >= num_slots:
                return b
    return -1


@numba.njit(cache=True, inline="always")
def _exp_one(x):  # type: ignore[no-untyped-def]
    """``exp(x)`` of a float32 ``x <= 0`` (softmax's shifted scores), inlined into loops the
    compiler vectorises (``np.exp`` is a scalar libm call per score: a quarter of a decode layer's
    attention at tiny-swa's shapes). Cody-Waite reduction ``x = k ln2 + r``, ``|r| <= ln2 / 2``,
    Cephes' ``expf`` polynomial for ``e^r``, ``2^k`` built from its bits
    (:func:`~kvcanary.jit.simd.f32_from_bits`); within 5 float32 ulps of the exact value
    (libm's: 1), below ``-87`` (weights past ``1e-38`` of the peak's) ``e^-87``. Exact up to
    ``x = 88`` too (``2^k`` stays a normal float): :func:`kvcanary.ops.cpu.decode._silu_mul`'s ``e^-g``,
    clamped there."""
    v = max(x, np.float32(-87.0))
    k = np.floor(v * np.float32(1.44269504088896341) + np.float32(0.5))
    r = v - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
    p = ((((np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)) * r
           + np.float32(8.3334519073e-3)) * r + np.float32(4.1665795894e-2)) * r
         + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1)  # fmt: skip
    return (p * (r * r) + r + np.float32(1.0)) * f32_from_bits(np.int32((np.int32(k) + np.int32(127)) << np.int32(23)))


@numba.njit(cache=True, inline="always")
def _prefetch_rows(buf, s, h0, h1, dim):  # type: ignore[no-untyped-def]
    """Prefetch slot ``s``'s rows of heads ``[h0, h1)`` (every 64-byte line of each)."""
    for h in range(h0, h1):
        for e in range(0, dim, _LINE_FLOATS):
            prefetch(buf, (s, h, e))


@numba.njit(cache=True, inline="always")
def _attend(q, k_buf, v_buf, slots, num_keys, scale, out, task, parts):  # type: ignore[no-untyped-def]
    """Part ``c`` of request ``b``, ``task = b * parts + c``: the query heads of KV heads
    ``[c * kv heads // parts, (c + 1) * kv heads // parts)``, their scores, softmax and
    weighted sum into ``out[b]``. Keys are the outer loops, in blocks of 8 (one key at a
    time where rows are not whole 8-float vectors of unit stride): a block's K (then V)
    rows of the part's heads are read together, one stream through the pool per request (a
    task per KV head read every other run of a slot's lines: ~30 % slower with the K/V out
    of the caches, as a decode step finds them), short rows (:data:`_PREFETCH_MAX_FLOATS`)
    asked for ahead: each key's K rows :data:`_PREFETCH_KEYS` keys (a block) before, its V
    rows with its K (:mod:`kvcanary.jit.prefetch`: the hardware prefetcher cannot follow
    a slot table's jumps between pages). Scores and weighted sums by
    :mod:`kvcanary.jit.simd`'s vector kernels (8 keys' scores a call, the output rows in
    registers across a block), softmax's maximum and sum by its row reductions (8 lanes a
    step; 64 requests x 160 keys, the compiled call alone, 301 -> 273 us warm). Each head's
    sums run in the same order whatever ``parts``: the same bits."""
    dim = q.shape[2]
    kv_heads = k_buf.shape[1]
    group = q.shape[1] // kv_heads
    b = task // parts
    c = task - b * parts
    h0 = c * kv_heads // parts
    nq = ((c + 1) * kv_heads // parts - h0) * group  # query heads q0.. of this part
    q0 = h0 * group
    n = max(num_keys[b], 1)
    vec = dim % LANES == 0 and k_buf.strides[2] == 4 and v_buf.strides[2] == 4
    step = LANES if vec else 1
    rows = 2 if vec and group % 2 == 0 else 1  # query rows a vector call takes
    scores = np.empty((nq, (n + LANES - 1) // LANES * LANES), dtype=np.float32)
    acc_out = np.zeros((nq, dim), dtype=np.float32)
    q_rows = np.empty((nq, dim), dtype=np.float32)  # (q may be a strided view: read once)
    h1 = h0 + nq // group
    ahead = _PREFETCH_KEYS if (h1 - h0) * dim <= _PREFETCH_MAX_FLOATS else 0
    for j in range(min(ahead, n)):  # the first keys' K rows on their way
        _prefetch_rows(k_buf, slots[b, j], h0, h1, dim)
    for i in range(nq):
        for e in range(dim):
            q_rows[i, e] = q[b, q0 + i, e]
    for j0 in range(0, n, step):
        j1 = min(j0 + step, n)
        if ahead:
            for j in range(j0 + ahead, min(j1 + ahead, n)):
                _prefetch_rows(k_buf, slots[b, j], h0, h1, dim)
            for j in range(j0, j1):  # (read after the softmax: cached by then)
                _prefetch_rows(v_buf, slots[b, j], h0, h1, dim)
        for i in range(0, nq, rows):
            h = h0 + i // group
            if rows == 2:  # two heads of a group: each K vector loaded once for both
                dot8x2(q_rows, i, k_buf, h, slots, b, j0, j1 - j0, scores, scale)
            elif vec:
                dot8(q_rows, i, k_buf, h, slots, b, j0, j1 - j0, scores, scale)
            else:
                s = slots[b, j0]
                acc = np.float32(0.0)
                for e in range(dim):
                    acc += q_rows[i, e] * k_buf[s, h, e]
                scores[i, j0] = acc * scale
    totals = np.empty(nq, dtype=np.float32)
    for i in range(nq):  # softmax: the maximum and the sum 8 lanes a step, exp vectorised
        peak = row_max(scores, i, n)
        row = scores[i]
        for j in range(n):
            row[j] = _exp_one(row[j] - peak)
        totals[i] = row_sum(scores, i, n)
    for j0 in range(0, n, step):
        j1 = min(j0 + step, n)
        for i in range(0, nq, rows):
            h = h0 + i // group
            if rows == 2:
                e0 = 0
                while e0 + 4 * LANES <= dim:
                    axpy4x2(acc_out, i, e0, scores, v_buf, h, slots, b, j0, j1)
                    e0 += 4 * LANES
                while e0 < dim:
                    axpy1x2(acc_out, i, e0, scores, v_buf, h, slots, b, j0, j1)
                    e0 += LANES
            elif vec:
                e0 = 0
                while e0 + 4 * LANES <= dim:
                    axpy4(acc_out, i, e0, scores, v_buf, h, slots, b, j0, j1)
                    e0 += 4 * LANES
                while e0 < dim:
                    axpy1(acc_out, i, e0, scores, v_buf, h, slots, b, j0, j1)
                    e0 += LANES
            else:
                s = slots[b, j0]
                p = scores[i, j0]
                for e in range(dim):
                    acc_out[i, e] += p * v_buf[s, h, e]
    for i in range(nq):
        inv = np.float32(1.0) / totals[i]
        for e in range(dim):
            out[b, q0 + i, e] = acc_out[i, e] * inv


_FLAGS: dict[str, Any] = dict(fastmath=True, boundscheck=False, nogil=True, cache=True, error_model="numpy")
# (numpy's error model: a NaN in a K / V row (a corrupted cache) makes the softmax's sum NaN
# or 0 and the outputs of the heads reading it NaN, as SDPA's; numba's default raised
# ZeroDivisionError out of the forward instead.)


@numba.njit(**_FLAGS)
def _attend_tasks(q, k_buf, v_buf, slots, num_keys, scale, out, parts, lo, hi):  # type: ignore[no-untyped-def]
    """Tasks ``[lo, hi)`` of :func:`_attend` (every slot read is in the buffer)."""
    for task in range(lo, hi):
        _attend(q, k_buf, v_buf, slots, num_keys, scale, out, task, parts)


# The task kernels as the decode attention, the decode layer and their parallel drivers call
# them: through their addresses (kvcanary.jit.calls), so that the attention body compiles
# once, not once a caller and variant. ``q``: any layout (a view of the QKV projection).
_F3A = nbtypes.Array(nbtypes.float32, 3, "A")
_F2, _F3 = nbtypes.Array(nbtypes.float32, 2, "C"), nbtypes.Array(nbtypes.float32, 3, "C")
_I1, _I2 = nbtypes.Array(nbtypes.int64, 1, "C"), nbtypes.Array(nbtypes.int64, 2, "C")
_ATTEND_ARGS = (_F3A, _F3, _F3, _I2, _I1, nbtypes.float32, _F3, nbtypes.int64, nbtypes.int64,
                nbtypes.int64)  # fmt: skip
ATTEND = Callee(_attend_tasks, nbtypes.none, *_ATTEND_ARGS)
_ATTEND_T = ATTEND.type


@numba.njit(parallel=True, **_FLAGS)
def _attend_tasks_parallel(fn, q, k_buf, v_buf, slots, num_keys, scale, out, parts, lo, hi):  # type: ignore[no-untyped-def]
    """:data:`ATTEND` (at address ``fn``) on one contiguous run of the tasks a thread."""
    n = split_ranges(lo, hi)
    for p in prange(n):
        a, b = part_range(lo, hi, p, n)
        call(_ATTEND_T, fn, (q, k_buf, v_buf, slots, num_keys, scale, out, parts, a, b))


ATTEND_PARALLEL = Callee(_attend_tasks_parallel, nbtypes.none, nbtypes.int64, *_ATTEND_ARGS)
_ATTEND_PARALLEL_T = ATTEND_PARALLEL.type


@numba.njit(cache=True, inline="always")
def _attend_all(fns, split, q, k_buf, v_buf, slots, num_keys, scale, out, parts):  # type: ignore[no-untyped-def]
    """Every task of ``q``'s requests, on threads if ``split`` (``fns``: :func:`addresses`)."""
    n = q.shape[0] * parts
    if split:
        call(_ATTEND_PARALLEL_T, fns[3], (fns[2], q, k_buf, v_buf, slots, num_keys, scale, out,
                                          parts, 0, n))  # fmt: skip
    else:
        call(_ATTEND_T, fns[2], (q, k_buf, v_buf, slots, num_keys, scale, out, parts, 0, n))


@numba.njit(**_FLAGS)
def _decode_attention(fns, split, q, k_buf, v_buf, slots, num_keys, scale, out, parts):  # type: ignore[no-untyped-def]
    bs = q.shape[0]  # every slot read is in the buffer (the caller raises otherwise)
    bad = _check_reads(slots, num_keys, k_buf.shape[0], bs)
    if bad >= 0:
        return bad
    _attend_all(fns, split, q, k_buf, v_buf, slots, num_keys, scale, out, parts)
    return -1


@numba.njit(**_FLAGS)
def _decode_layer(qkv, num_heads, weight, has_weight, norm_eps, lanes, cos, sin,  # type: ignore[no-untyped-def]
                  k_buf, v_buf, loc, slots, num_keys, scale, out, k_out, parts, split, fns):  # fmt: skip
    bs, dim = qkv.shape[0], qkv.shape[2]
    kv_heads, num_slots = k_buf.shape[1], k_buf.shape[0]
    first_v = num_heads + kv_heads  # qkv's heads: q, then k, then v
    if (loc.shape[0] != bs or qkv.shape[1] != first_v + kv_heads or k_buf.shape[2] != dim
            or out.shape[0] != bs or out.shape[1] != num_heads or out.shape[2] != dim
            or num_keys.shape[0] < bs or slots.shape[0] < bs or cos.shape[0] < bs
            or cos.shape[1] != dim or sin.shape[0] < bs or sin.shape[1] != dim
            or (has_weight and (weight.shape[0] < first_v or weight.shape[1] != dim))
            or num_heads % kv_heads or dim % 2
            or (k_out.shape[0] and (k_out.shape[0] != bs or k_out.shape[1] != kv_heads
                                    or k_out.shape[2] != dim))):  # fmt: skip
        return _LAYER_REFUSED
    for t in range(bs):
        if loc[t] < 0 or loc[t] >= num_slots:
            return _LAYER_REFUSED
    bad = _check_reads(slots, num_keys, num_slots, bs)
    if bad >= 0:
        return _LAYER_REFUSED
    # 1. rope (and q/k norm) of the q and k heads in one call of rope_cpu's pass (its own
    # float rounding: not this function's fastmath; its threads from rope's token count),
    # then k and v stored at loc. A per-head call of a compiled function from here
    # cost ~100 ns a head in argument passing and reference counts: a tiny-swa batch-64
    # layer's rope 33-39 -> ~15 us.
    q_k = np.empty((bs, first_v, dim), dtype=np.float32)
    rope_cpu.rope_nb(fns, qkv[:, :first_v], weight, has_weight, norm_eps, lanes, cos, sin, q_k)
    q = q_k[:, :num_heads]
    for t in range(bs):
        s = loc[t]
        for h in range(kv_heads):
            for e in range(dim):
                k_buf[s, h, e] = q_k[t, num_heads + h, e]
                v_buf[s, h, e] = qkv[t, first_v + h, e]
                if k_out.shape[0]:  # the stored k rows, for the caller too
                    k_out[t, h, e] = q_k[t, num_heads + h, e]
    # 2. attention, as _decode_attention
    _attend_all(fns, split, q, k_buf, v_buf, slots, num_keys, scale, out, parts)
    return -1


_LAYER_ARGS = (_F3, nbtypes.int64, _F2, nbtypes.boolean, nbtypes.float32, nbtypes.int64, _F2, _F2,
               _F3, _F3, _I1, _I2, _I1, nbtypes.float32, _F3, _F3, nbtypes.int64, nbtypes.boolean,
               _I1)  # fmt: skip
LAYER = Callee(_decode_layer, nbtypes.int64, *_LAYER_ARGS)  # (the compiled decode forward's)
@functools.cache
def addresses() -> np.ndarray:
    """The ``fns`` of :func:`_decode_layer` and :func:`_decode_attention`: this process's
    RoPE token kernel and its parallel pass (:func:`kvcanary.ops.cpu.rope.addresses`), then
    :data:`ATTEND` and :data:`ATTEND_PARALLEL`."""
    return np.concatenate((rope_cpu.addresses(), calls.addresses(ATTEND, ATTEND_PARALLEL)))


def _contiguous(*arrays: np.ndarray) -> bool:
    return all(a.flags.c_contiguous for a in arrays)


def _threaded(split: bool) -> bool:
    """``split`` (the work is worth the threads) where there are threads to split it among."""
    return split and numba_parallel.parallel_threads() > 1


def _call(kernel: Any, *args: Any) -> Any:
    """``kernel(*args)`` under :mod:`kvcanary.jit.parallel`'s lock, on this thread's count:
    any of these kernels may enter a parallel region (a split pass, the decode layer's
    RoPE from 16 tokens)."""
    return numba_parallel.run_parallel(kernel, *args)


def _split(bs: int, k_buf: np.ndarray, slots: np.ndarray) -> tuple[bool, int]:
    """How attention over ``bs`` requests reading ``k_buf [slots, kv heads, dim]`` through a
    ``slots`` table this wide runs: whether it is worth the threads
    (:data:`PARALLEL_MIN_WORK`), and its tasks per request (:func:`_attend`): one, all its
    heads, unless the threads would get fewer than four tasks each; then its KV heads split
    so that each gets four (Qwen3-0.6B shapes, batch 1: a task per KV head, 232 us a full
    layer against 255 with two heads a task)."""
    if bs * k_buf.shape[1] * slots.shape[1] * k_buf.shape[2] < PARALLEL_MIN_WORK:
        return False, 1
    return True, max(1, min(k_buf.shape[1], -(-4 * numba_parallel.parallel_threads() // bs)))


def applies(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these (else the torch path): CPU float32 query
    and K/V buffers ``[slots, kv heads, dim]``, outside ``torch.compile`` tracing."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_buf.dtype == torch.float32
        and v_buf.dtype == torch.float32
        and k_buf.device.type == "cpu"
        and k_buf.dim() == 3
        and v_buf.shape == k_buf.shape
        and not torch.compiler.is_compiling()
    )


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    num_keys: torch.Tensor,
    scale: float,
    host: tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None] | None = None,
) -> torch.Tensor:
    """``q [bs, heads, dim]`` (one query per request), ``k_buf`` / ``v_buf [slots, kv heads,
    dim]``, ``slots [bs, >= max(num_keys)]`` int64 (request ``b``'s keys are
    ``slots[b, :num_keys[b]]``) -> ``[bs, heads, dim]``; query head ``h`` attends with KV
    head ``h // (heads / kv heads)``. Call only where :func:`applies`. ``host``: the caller's
    numpy views of ``k_buf``, ``v_buf`` and (when it has them) of ``slots`` and ``num_keys``
    as int64 (:func:`decode_tables`' arrays), instead of views made per call."""
    bs, heads, dim = q.shape
    out = torch.empty((bs, heads, dim), dtype=torch.float32, device=q.device)
    k_np, v_np, tables = (k_buf.numpy(), v_buf.numpy(), None) if host is None else host
    slots_np, keys_np = tables if tables is not None else (
        slots.to(torch.int64).contiguous().numpy(), num_keys.to(torch.int64).contiguous().numpy()
    )  # fmt: skip
    # q as it is (a decode step's is a view of the q/k projection): the kernel copies each
    # query row once, where a contiguous() copy of all of q cost a torch op per layer.
    split, parts = _split(bs, k_np, slots_np)
    split = _threaded(split)
    k_np, v_np = np.ascontiguousarray(k_np), np.ascontiguousarray(v_np)  # (theirs are: no copy)
    slots_np, keys_np = np.ascontiguousarray(slots_np), np.ascontiguousarray(keys_np)
    args = (addresses(), split, q.numpy(), k_np, v_np, slots_np, keys_np, np.float32(scale),
            out.numpy(), parts)  # fmt: skip
    bad_row = _call(_decode_attention, *args)
    if bad_row >= 0:  # as index_select would refuse it (nothing was read)
        n = max(int(num_keys[bad_row]), 1)
        raise IndexError(
            f"decode attention: request row {bad_row} reads {n} keys, slots "
            f"{slots[bad_row, :n].tolist()}; allowed slots in [0, {k_buf.shape[0]}), at most "
            f"{slots.shape[1]} keys (the slot table's width)"
        )
    return out


# ----------------------------------------------------------------- extend (prefill)
# A prefill / extend forward's attention, request by request without padding: the torch
# path runs SDPA on every request padded to the longest and masked (a sliding layer's
# queries see at most W keys but SDPA computes all of them, then masks).


@numba.njit(cache=True, inline="always")
def _extend_task(q, k_buf, v_buf, slots, num_keys, starts, ext, first_col, window, scale,  # type: ignore[no-untyped-def]
                 out, task):  # fmt: skip
    """Request ``b`` and KV head ``h`` (``task = b * kv heads + h``): its K rows gathered
    transposed (``kt [dim, keys]``) and its V rows (``vv [keys, dim]``) once, then per query
    ``i`` (table column ``c = first_col[b] + i``; keys ``[max(0, c - window + 1), c]``, all
    of ``[0, c]`` with ``window == 0``) and query head of the group: scores over those keys
    (a loop over keys the compiler vectorises), softmax with the maximum subtracted
    (maximum and sum by :func:`~kvcanary.jit.simd.row_max` / ``row_sum``, exp by
    :func:`_exp_one`), weighted sum of the V rows (where they are whole 8-float
    vectors, :func:`~kvcanary.jit.simd.axpy4`: the output row in registers across the
    keys; a tiny-swa prefill chunk of 4096 tokens, both compiled in one process, medians of
    8 alternated runs: a full layer 4079 -> 3583 us, a windowed one 2275 -> 2222; on those
    chunks the outputs were bit for bit the four-keys-a-pass loop's). The scores read K
    through slices of ``kt``'s rows, the softmax's maximum and sum by the row reductions
    (the same chunks, 16 alternated calls: full 3121 -> 2658 us, windowed 2174
    -> 2073). Its scores with keys
    in the lanes by the same kernel (32 keys' scores in registers across the dims) measured
    1.5-2x slower: short rows leave it loop overhead."""
    dim = q.shape[2]
    kv_heads = k_buf.shape[1]
    group = q.shape[1] // kv_heads
    b = task // kv_heads
    h = task - b * kv_heads
    nk = num_keys[b]
    if ext[b] == 0 or nk == 0:
        return
    kt = np.empty((dim, nk), dtype=np.float32)
    vv = np.empty((nk, dim), dtype=np.float32)
    for j in range(nk):
        s = slots[b, j]
        for e in range(dim):
            kt[e, j] = k_buf[s, h, e]
            vv[j, e] = v_buf[s, h, e]
    # (2-D / 3-D views and an identity slot row, as numba_simd's axpy kernels index)
    scores2 = np.empty((1, nk), dtype=np.float32)
    scores = scores2[0]
    acc2 = np.empty((1, dim), dtype=np.float32)
    acc = acc2[0]
    vv3 = vv.reshape(nk, 1, dim)
    ident = np.empty((1, nk), dtype=np.int64)
    for j in range(nk):
        ident[0, j] = j
    q_row = np.empty(dim, dtype=np.float32)
    for i in range(ext[b]):
        c = first_col[b] + i
        lo = max(c - window + 1, 0) if window > 0 else 0
        n = c - lo + 1
        t = starts[b] + i
        for g in range(group):
            qh = h * group + g
            for e in range(dim):
                q_row[e] = q[t, qh, e] * scale
            for j in range(n):
                scores[j] = np.float32(0.0)
            e = 0
            while e + 4 <= dim:  # four dims a pass: one load and store of a score per 4 FMAs
                x0, x1, x2, x3 = q_row[e], q_row[e + 1], q_row[e + 2], q_row[e + 3]
                # (slices: an index lo + j keeps numba's wrap-around and compiles scalar)
                k0, k1, k2, k3 = kt[e, lo:c + 1], kt[e + 1, lo:c + 1], kt[e + 2, lo:c + 1], kt[e + 3, lo:c + 1]
                for j in range(n):
                    scores[j] += x0 * k0[j] + x1 * k1[j] + x2 * k2[j] + x3 * k3[j]
                e += 4
            while e < dim:
                x0 = q_row[e]
                k0 = kt[e, lo:c + 1]
                for j in range(n):
                    scores[j] += x0 * k0[j]
                e += 1
            peak = row_max(scores2, 0, n)
            for j in range(n):
                scores[j] = _exp_one(scores[j] - peak)
            total = row_sum(scores2, 0, n)
            for e in range(dim):
                acc[e] = np.float32(0.0)
            if dim % LANES == 0:  # the output row in registers across the keys
                rows = vv3[lo:]
                e0 = 0
                while e0 + 4 * LANES <= dim:
                    axpy4(acc2, 0, e0, scores2, rows, 0, ident, 0, 0, n)
                    e0 += 4 * LANES
                while e0 < dim:
                    axpy1(acc2, 0, e0, scores2, rows, 0, ident, 0, 0, n)
                    e0 += LANES
            else:
                j = 0
                while j + 4 <= n:  # four keys a pass over the output row
                    p0, p1, p2, p3 = scores[j], scores[j + 1], scores[j + 2], scores[j + 3]
                    r = lo + j
                    for e in range(dim):
                        acc[e] += (p0 * vv[r, e] + p1 * vv[r + 1, e]
                                   + p2 * vv[r + 2, e] + p3 * vv[r + 3, e])  # fmt: skip
                    j += 4
                while j < n:
                    p0 = scores[j]
                    for e in range(dim):
                        acc[e] += p0 * vv[lo + j, e]
                    j += 1
            inv = np.float32(1.0) / total
            for e in range(dim):
                out[t, qh, e] = acc[e] * inv


@numba.njit(**_FLAGS)
def _extend_tasks(q, k_buf, v_buf, slots, num_keys, starts, ext, first_col, window, scale, out,  # type: ignore[no-untyped-def]
                  lo, hi):  # fmt: skip
    """Tasks ``[lo, hi)`` of :func:`_extend_task` (the tables checked before)."""
    for task in range(lo, hi):
        _extend_task(q, k_buf, v_buf, slots, num_keys, starts, ext, first_col, window, scale,
                     out, task)  # fmt: skip


# As ATTEND: the task kernel through its address, from the checks and the parallel driver.
_EXTEND_ARGS = (_F3A, _F3, _F3, _I2, _I1, _I1, _I1, _I1, nbtypes.int64, nbtypes.float32, _F3,
                nbtypes.int64, nbtypes.int64)  # fmt: skip
EXTEND = Callee(_extend_tasks, nbtypes.none, *_EXTEND_ARGS)
_EXTEND_T = EXTEND.type


@numba.njit(parallel=True, **_FLAGS)
def _extend_tasks_parallel(fn, q, k_buf, v_buf, slots, num_keys, starts, ext, first_col,  # type: ignore[no-untyped-def]
                           window, scale, out, lo, hi):  # fmt: skip
    """:data:`EXTEND` (at address ``fn``) on one contiguous run of the tasks a thread."""
    n = split_ranges(lo, hi)
    for p in prange(n):
        a, b = part_range(lo, hi, p, n)
        call(_EXTEND_T, fn, (q, k_buf, v_buf, slots, num_keys, starts, ext, first_col, window,
                             scale, out, a, b))  # fmt: skip


EXTEND_PARALLEL = Callee(_extend_tasks_parallel, nbtypes.none, nbtypes.int64, *_EXTEND_ARGS)
_EXTEND_PARALLEL_T = EXTEND_PARALLEL.type


@numba.njit(**_FLAGS)
def _extend_attention(fns, split, q, k_buf, v_buf, slots, num_keys, starts, ext, first_col,  # type: ignore[no-untyped-def]
                      window, scale, out):  # fmt: skip
    """Every request's queries over its keys (:func:`_extend_task`, on threads if ``split``;
    ``fns``: :data:`EXTEND`'s and :data:`EXTEND_PARALLEL`'s addresses); -1, or the first
    request row whose tables do not hold (nothing read then)."""
    bs = ext.shape[0]
    if (num_keys.shape[0] < bs or starts.shape[0] < bs or first_col.shape[0] < bs
            or slots.shape[0] < bs or (bs and slots.shape[1] == 0)):  # fmt: skip
        return 0
    for b in range(bs):
        if (ext[b] < 0 or first_col[b] < 0 or first_col[b] + ext[b] > num_keys[b]
                or starts[b] < 0 or starts[b] + ext[b] > q.shape[0] or starts[b] + ext[b] > out.shape[0]):  # fmt: skip
            return b
    bad = _check_reads(slots, num_keys, k_buf.shape[0], bs)
    if bad >= 0:
        return bad
    n = bs * k_buf.shape[1]
    if split:
        call(_EXTEND_PARALLEL_T, fns[1], (fns[0], q, k_buf, v_buf, slots, num_keys, starts, ext,
                                          first_col, window, scale, out, 0, n))  # fmt: skip
    else:
        call(_EXTEND_T, fns[0], (q, k_buf, v_buf, slots, num_keys, starts, ext, first_col, window,
                                 scale, out, 0, n))  # fmt: skip
    return -1


@functools.cache
def _extend_fns() -> np.ndarray:
    return calls.addresses(EXTEND, EXTEND_PARALLEL)


# extend_attention against the torch path's padded, masked SDPA (whose rate per score is
# higher: GEMM blocking), tiny-swa / Qwen3-0.6B shapes, 2 threads, ms (torch / kernel): 40
# prompts of 64-128 tokens full 10.4 / 4.6, window 32 7.6 / 3.3, 0.6B 16 prompts 45.7 / 17.0;
# one 512-token chunk after 512 cached: full 4.5 / 4.6, window 32 2.8 / 0.4, 0.6B full
# 36.0 / 46.9, window 512 34.7 / 35.1: per score seen, the kernel is 1.3 (dim 32) to 1.7
# (dim 128) times slower. It is taken where the padded table holds at least this many
# times the scores the queries may see (prompts of one length from scratch: 2L / (L + 1)).
EXTEND_MIN_PADDING = 1.75


def extend_pays(first_col: np.ndarray, ext: np.ndarray, window: int, width: int) -> bool:
    """Whether :func:`extend_attention` beats the torch path on these tables (request
    ``b``'s ``ext[b]`` queries from column ``first_col[b]``, ``width`` columns, ``window``
    0: causal only): the scores SDPA computes, ``bs x max(ext) x width``, against those the
    queries may see (:data:`EXTEND_MIN_PADDING`)."""
    if ext.size == 0:
        return False
    a = first_col.astype(np.float64) + 1  # keys seen by each request's first query ..
    z = a + ext - 1  # .. and by its last (causal: column + 1)
    seen = (a + z) * ext / 2
    if window > 0:  # each query sees min(column + 1, window)
        w = float(window)
        below = np.clip(np.minimum(z, w) - a + 1, 0, None)  # queries under the window
        seen = np.where(a >= w, w * ext, (a + a + below - 1) * below / 2 + w * (ext - below))
    padded = float(ext.size) * float(ext.max()) * float(width)
    return padded >= EXTEND_MIN_PADDING * float(seen.sum())


def extend_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: np.ndarray,
    num_keys: np.ndarray, starts: np.ndarray, ext: np.ndarray, first_col: np.ndarray,
    window: int, scale: float,
) -> torch.Tensor:
    """An extend forward's attention: ``q [tokens, heads, dim]`` (request ``b``'s ``ext[b]``
    new tokens at rows ``starts[b]..``), ``k_buf`` / ``v_buf [slots, kv heads, dim]`` (this
    forward's K/V already stored), request ``b``'s keys ``slots[b, :num_keys[b]]`` (int64),
    its first query at table column ``first_col[b]`` (position - the table's first key's);
    a query at column ``c`` sees columns ``[c - window + 1, c]`` (``window`` 0: ``[0, c]``)
    -> ``[tokens, heads, dim]`` (rows no request covers: zeros). Call only where
    :func:`applies`. The same values as the torch path's masked SDPA up to float rounding
    (~1e-6). A table that does not hold (a slot outside the buffer, a query past its keys)
    raises ``IndexError`` before anything is read."""
    tokens, heads, dim = q.shape
    # Requests back to back over every row (the engine's forwards): each row is written,
    # so no zero fill first (Qwen3-0.6B shapes, 16 prompts: 12.6 MB, ~2.8 ms a layer).
    queries = int(ext.sum())
    covers = queries == tokens and np.array_equal(starts, np.cumsum(ext) - ext)
    out = (torch.empty if covers else torch.zeros)((tokens, heads, dim), dtype=torch.float32)
    # (contiguous: the types the task kernel is compiled for; the engine's are, no copy made)
    k_np, v_np = np.ascontiguousarray(k_buf.numpy()), np.ascontiguousarray(v_buf.numpy())
    slots, num_keys, starts, ext, first_col = (np.ascontiguousarray(a, dtype=np.int64) for a in (
        slots, num_keys, starts, ext, first_col))  # fmt: skip
    work = queries * heads * dim * (min(window, slots.shape[1]) if window > 0 else slots.shape[1])
    split = work >= PARALLEL_MIN_WORK and numba_parallel.parallel_threads() > 1
    args = (_extend_fns(), split, q.numpy(), k_np, v_np, slots, num_keys, starts, ext, first_col,
            np.int64(window), np.float32(scale), out.numpy())  # fmt: skip
    bad = _call(_extend_attention, *args)
    if bad >= 0:
        raise IndexError(
            f"extend attention: request row {bad} (ext {int(ext[bad])}, first column "
            f"{int(first_col[bad])}, keys {int(num_keys[bad])}, rows from {int(starts[bad])}) "
            f"does not fit its tables: slots in [0, {k_buf.shape[0]}), {q.shape[0]} query rows, "
            f"at most {slots.shape[1]} keys"
        )
    return out


_NO_WEIGHT = np.ones((1, 1), dtype=np.float32)
_NO_K_OUT = np.zeros((0, 1, 1), dtype=np.float32)


def decode_layer(
    qkv: np.ndarray, num_heads: int, cos: np.ndarray, sin: np.ndarray,
    weight: np.ndarray | None, norm_eps: float | None, k_np: np.ndarray, v_np: np.ndarray,
    loc: np.ndarray, slots: np.ndarray, num_keys: np.ndarray, scale: float, out: np.ndarray,
    k_out: np.ndarray | None = None,
) -> bool:
    """A decode layer's attention from its QKV projection ``qkv [bs, heads + 2 kv heads,
    dim]`` (float32; its heads q, then k, then v) into ``out [bs, heads, dim]``, in one
    compiled call: per token the q and k heads normed / weighted / rotated as
    :func:`kvcanary.ops.cpu.rope.rope` does (``weight [heads + kv heads, dim]``, ``norm_eps``: as its;
    ``cos`` / ``sin`` ``[>= bs, dim]``, :func:`kvcanary.ops.cpu.rope.tables`), k and v stored at slot
    ``loc[t]`` of the layer's K / V buffers (``k_np`` / ``v_np``, ``[slots, kv heads, dim]``
    float32, as ``index_copy_`` would), then :func:`decode_attention` over ``slots`` /
    ``num_keys`` (int64, as its host tables). The same bits as those three calls.
    ``k_out [bs, kv heads, dim]``, when given: the rotated k rows stored, also written there
    (for a store check to see what was stored, :meth:`PagedAttentionBackend.rope_forward`). False, with
    nothing done (the caller takes the three calls, which raise their own errors), when a
    shape or a slot is not one it takes, or the norm has no width here
    (:func:`kvcanary.ops.cpu.rmsnorm.lanes`)."""
    lanes = 0
    if norm_eps is not None and not (lanes := norm_cpu.lanes()):
        return False
    k_out = _NO_K_OUT if k_out is None else k_out
    w = _NO_WEIGHT if weight is None else weight
    if not _contiguous(qkv, w, cos, sin, k_np, v_np, loc, slots, num_keys, out, k_out):
        return False  # (the types the kernel is compiled for; the engine's arrays are)
    split, parts = _split(qkv.shape[0], k_np, slots)
    split = _threaded(split)
    status = _call(
        _decode_layer, qkv, num_heads, w, weight is not None,
        np.float32(norm_eps or 0.0), lanes, cos, sin, k_np, v_np, loc, slots, num_keys,
        np.float32(scale), out, k_out, parts, split, addresses(),
    )  # fmt: skip
    return bool(status != _LAYER_REFUSED)


# ----------------------------------------------------------------- decode key tables
# A decode step's attention metadata built by one compiled pass instead of ~30 torch ops
# (QueryLayout + two key_view calls + the SWA concatenation: ~190 us a tiny-swa decode step
# on this machine, ~12 % of it). The tables are the ones the torch path makes, bit for bit.


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _decode_tables_nb(r2t, rows, pre, seq, window, loc):  # type: ignore[no-untyped-def]
    """One query per request at position ``pre[b]``, keys ``[0, seq[b])``: (-1, full slots
    ``[bs, max_k]``, their visibility ``[bs, 1, max_k]``, then with ``window > 0`` the sliding
    tables: ``loc`` followed by the slots ``[bs, kw]`` from ``max(0, pre - window + 1)``
    (flat, translated by the caller), visibility ``[bs, 1, kw]``, key counts ``[bs]``; else
    empty arrays). On a request row or length out of ``r2t``'s range: (that row, empty
    arrays), nothing read."""
    bs = rows.shape[0]
    max_k = 0
    kw = 0
    for b in range(bs):
        if rows[b] < 0 or rows[b] >= r2t.shape[0] or seq[b] < 0 or seq[b] > r2t.shape[1]:
            z = np.zeros(0, dtype=np.int64)
            return b, z.reshape(0, 0), np.zeros((0, 1, 0), dtype=np.bool_), z, \
                np.zeros((0, 1, 0), dtype=np.bool_), z  # fmt: skip
        max_k = max(max_k, seq[b])
        if window > 0:
            kw = max(kw, seq[b] - max(pre[b] - window + 1, 0))
    full_slots = np.empty((bs, max_k), dtype=np.int64)
    full_mask = np.empty((bs, 1, max_k), dtype=np.bool_)
    for b in range(bs):
        r, s, p = rows[b], seq[b], pre[b]
        for j in range(max_k):
            valid = j < s
            full_slots[b, j] = r2t[r, j] if valid else 0
            full_mask[b, 0, j] = valid and j <= p
    n = loc.shape[0] if window > 0 else 0
    both = np.empty(n + bs * kw, dtype=np.int64)
    sw_mask = np.empty((bs if window > 0 else 0, 1, kw), dtype=np.bool_)
    sw_keys = np.empty(bs if window > 0 else 0, dtype=np.int64)
    if window > 0:
        for i in range(n):
            both[i] = loc[i]
        for b in range(bs):
            r, s, p = rows[b], seq[b], pre[b]
            start = max(p - window + 1, 0)
            num = s - start
            sw_keys[b] = num
            base = n + b * kw
            for j in range(kw):
                k = start + j
                valid = j < num
                both[base + j] = r2t[r, k] if valid else 0
                sw_mask[b, 0, j] = valid and k <= p and k > p - window
    return -1, full_slots, full_mask, both, sw_mask, sw_keys


def decode_tables(
    r2t: np.ndarray, rows: np.ndarray, pre: np.ndarray, seq: np.ndarray, window: int,
    loc: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """The key tables of a decode forward (one new token per request, ``seq = pre + 1``):
    ``(full slots [bs, max seq] int64, full mask [bs, 1, max seq] bool, sliding)``, sliding
    None without a ``window`` (> 0) or ``(loc then the sliding slots, flat int64, untranslated;
    mask [bs, 1, kw] bool; key counts [bs] int64)`` with ``kw`` the most keys a request sees
    in the window. Each table equals :func:`kvcanary.engine.attention.key_view`'s. A request
    row or length outside ``r2t`` raises ``IndexError`` (as the torch gather does)."""
    bad, full_slots, full_mask, both, sw_mask, sw_keys = _decode_tables_nb(
        r2t, rows, pre, seq, window, loc
    )
    if bad >= 0:
        raise IndexError(
            f"decode key tables: request row {int(rows[bad])} with {int(seq[bad])} keys; allowed "
            f"rows in [0, {r2t.shape[0]}), at most {r2t.shape[1]} keys (req_to_token's shape)"
        )
    return full_slots, full_mask, None if window <= 0 else (both, sw_mask, sw_keys)


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _fill_tables_nb(slots, mask, write_loc, num_keys, dst_slots, dst_mask, dst_write_loc,  # type: ignore[no-untyped-def]
                    dst_num_keys, width):  # fmt: skip
    n, k = slots.shape
    if k > width or n * width > dst_slots.shape[0] or n > dst_num_keys.shape[0] \
            or write_loc.shape[0] != n or mask.shape[2] != k or num_keys.shape[0] != n:  # fmt: skip
        return False
    for b in range(n):
        for j in range(width):
            inside = j < k
            dst_slots[b * width + j] = slots[b, j] if inside else 0
            dst_mask[b * width + j] = mask[b, 0, j] if inside else False
        dst_num_keys[b] = num_keys[b]
        dst_write_loc[b] = write_loc[b]
    return True


def fill_tables(slots: np.ndarray, mask: np.ndarray, write_loc: np.ndarray, num_keys: np.ndarray,
                dst_slots: np.ndarray, dst_mask: np.ndarray, dst_write_loc: np.ndarray,
                dst_num_keys: np.ndarray, width: int) -> bool:  # fmt: skip
    """Copy a decode forward's key tables (:func:`decode_tables`' arrays: ``slots [n, k]``,
    ``mask [n, 1, k]``, ``write_loc [n]``, ``num_keys [n]``) into flat static buffers, each
    row padded to ``width >= k`` (slot 0, masked out); False, with nothing copied, when they
    do not fit."""
    return bool(_fill_tables_nb(slots, mask, write_loc, num_keys, dst_slots, dst_mask,
                                dst_write_loc, dst_num_keys, width))  # fmt: skip
