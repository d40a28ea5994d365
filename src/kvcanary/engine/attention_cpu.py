"""Decode attention on the CPU straight from the paged K/V buffers (numba).

The torch path (:class:`~kvcanary.engine.attention.PagedAttentionBackend`) gathers every
request's keys and values into a padded ``[bs, kv heads, max_keys, dim]`` copy per layer
(``index_select``) and runs masked SDPA on it: per decode step it writes and reads the whole
visible KV twice more than attention needs. Here one compiled loop per (request, KV head)
reads each key and value row where it lies in the pool, once, through the request's slot
row: scores for the ``group`` query heads that share the KV head, softmax, weighted sum.
Measured (microbenchmark, this repo's 2-core machine, random slots, us per layer; torch =
gather + SDPA, whose time varies run to run): Qwen3-0.6B shapes (16 q / 8 kv heads, dim
128) batch 16 x 64 keys 690 vs 365, batch 64 x 80 keys 2957..15061 vs 1281; tiny-swa shapes
(4 / 2 heads, dim 32) batch 16 x 160 keys 110 vs 60, batch 1 x 100 keys 38 vs 11.

Decode only (one query per request, every key of the request's row visible: the caller's
key table already starts at the window for sliding layers), float32 K/V and queries. The
softmax runs in float32 with the maximum subtracted, like SDPA's; results differ from it by
float rounding only (~1e-6). A request's result depends on its own row only. Rows with no
key (graph padding) read slot 0, as the torch path's masks make them do. A slot outside the
buffer, or a key count past the slot table's width, raises ``IndexError`` before anything is
read (as ``index_select`` does).

Work of at least :data:`PARALLEL_MIN_WORK` multiply-adds runs on ``torch.get_num_threads()``
numba threads (a parallel launch costs ~10 us; smaller work runs on one). Calls into the
parallel kernel are serialized by a lock: numba's ``workqueue`` threading layer (its fallback
when no OpenMP / TBB is found) must not be entered by two Python threads at once.
"""

from __future__ import annotations

import threading
import types

import numba
import numpy as np
import torch
from numba import prange

# bs x kv heads x keys x dim below which one thread does the work.
PARALLEL_MIN_WORK = 1 << 15
_parallel_lock = threading.Lock()


def _decode_attention(q, k_buf, v_buf, slots, num_keys, scale, out):  # type: ignore[no-untyped-def]
    bs, num_heads, dim = q.shape
    kv_heads = k_buf.shape[1]
    group = num_heads // kv_heads
    num_slots = k_buf.shape[0]
    for b in range(bs):  # every slot read is in the buffer (the caller raises otherwise)
        if num_keys[b] > slots.shape[1]:
            return b
        for j in range(max(num_keys[b], 1)):
            if slots[b, j] < 0 or slots[b, j] >= num_slots:
                return b
    for task in prange(bs * kv_heads):
        b = task // kv_heads
        h = task - b * kv_heads
        n = max(num_keys[b], 1)
        scores = np.empty(n, dtype=np.float32)
        acc_out = np.zeros(dim, dtype=np.float32)
        for g in range(group):
            qh = h * group + g
            peak = np.float32(-np.inf)
            for j in range(n):
                s = slots[b, j]
                acc = np.float32(0.0)
                for e in range(dim):
                    acc += q[b, qh, e] * k_buf[s, h, e]
                acc *= scale
                scores[j] = acc
                peak = max(peak, acc)
            total = np.float32(0.0)
            for j in range(n):
                p = np.exp(scores[j] - peak)
                scores[j] = p
                total += p
            acc_out[:] = 0.0
            for j in range(n):
                s = slots[b, j]
                p = scores[j]
                for e in range(dim):
                    acc_out[e] += p * v_buf[s, h, e]
            inv = np.float32(1.0) / total
            for e in range(dim):
                out[b, qh, e] = acc_out[e] * inv
    return -1


def _compile(parallel: bool):  # type: ignore[no-untyped-def]
    """The kernel compiled with or without ``prange`` threads. Each copy gets its own
    qualified name: numba's on-disk cache is indexed by it, and two jits of one function
    would share (and serve each other) one cache entry."""
    copy = types.FunctionType(_decode_attention.__code__, _decode_attention.__globals__)
    copy.__qualname__ = copy.__name__ = f"decode_attention_{'parallel' if parallel else 'serial'}"
    return numba.njit(parallel=parallel, fastmath=True, boundscheck=False, nogil=True, cache=True)(
        copy
    )


_serial = _compile(False)
_parallel = _compile(True)


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
) -> torch.Tensor:
    """``q [bs, heads, dim]`` (one query per request), ``k_buf`` / ``v_buf [slots, kv heads,
    dim]``, ``slots [bs, >= max(num_keys)]`` int64 (request ``b``'s keys are
    ``slots[b, :num_keys[b]]``) -> ``[bs, heads, dim]``; query head ``h`` attends with KV
    head ``h // (heads / kv heads)``. Call only where :func:`applies`."""
    bs, heads, dim = q.shape
    out = torch.empty((bs, heads, dim), dtype=torch.float32, device=q.device)
    args = (q.contiguous().numpy(), k_buf.numpy(), v_buf.numpy(),
            slots.to(torch.int64).contiguous().numpy(), num_keys.to(torch.int64).contiguous().numpy(),
            np.float32(scale), out.numpy())  # fmt: skip
    threads = torch.get_num_threads()
    if threads > 1 and bs * k_buf.shape[1] * slots.shape[1] * dim >= PARALLEL_MIN_WORK:
        with _parallel_lock:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
            bad_row = _parallel(*args)
    else:
        bad_row = _serial(*args)
    if bad_row >= 0:  # as index_select would refuse it (nothing was read)
        n = max(int(num_keys[bad_row]), 1)
        raise IndexError(
            f"decode attention: request row {bad_row} reads {n} keys, slots "
            f"{slots[bad_row, :n].tolist()}; allowed slots in [0, {k_buf.shape[0]}), at most "
            f"{slots.shape[1]} keys (the slot table's width)"
        )
    return out
