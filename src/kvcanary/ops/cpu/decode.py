"""A CPU decode forward of a :class:`~kvcanary.model.decoder.HybridDecoder` in one compiled
call (numba): embeddings, every layer (norms, QKV GEMM, the fused RoPE + K/V store +
attention of :func:`kvcanary.ops.cpu.attention.decode_layer`, o-projection, MLP) and the final norm.

The eager forward of a tiny model's decode step is mostly Python: ~9 calls a layer into
torch or numba, each a few microseconds of dispatch around microseconds of work (tiny-swa
batch 16, py-spy: ~25 % of a step inside ``ModelRunner.forward`` is neither a GEMM nor a
compiled pass). Here the layers run in one compiled loop with the same kernels:

    per layer                     eager                         here
    input norm (+ residual add)   norm_cpu.add_rms_norm         the same compiled rows
    QKV / o / gate-up / down      F.linear (MKL sgemm)          MKL's sgemm_, called from
                                                                numba with F.linear's
                                                                arguments: the same bits
    RoPE, K/V store, attention    attention_cpu.decode_layer    the same kernel
    silu(gate) * up               torch silu, mul_              a compiled pass (exp: a
                                                                Cody-Waite polynomial, within
                                                                a few float32 ulps of torch's)

so a step's hidden states differ from the eager forward's only by the activation's rounding
(``tests/engine/test_decode_cpu.py`` compares logprobs, greedy tokens and KV). The GEMM is
the Fortran ``sgemm_`` torch's CPU library exports (MKL, linked into ``libtorch_cpu``);
:func:`sgemm_address` checks once per process that calling it from here gives
``F.linear``'s bits on a few shapes, and the path is off where it does not (or torch has
no MKL, or the symbol is missing).

It runs a decode forward where every layer would take the eager path's fused decode layer
and its store is the pool's own or the canary store check's wrapper of it, whose observers
get the rows it stored, as the fused layer hands them (never under a fault's wrapper, which
must see the store: :meth:`.attention.PagedAttentionBackend.decode_buffers`); where every
linear would run through ``F.linear`` at this batch size (not oneDNN-packed: weights under
1 MiB, ``KVCANARY_CPU_GEMM`` auto or torch); and where the model is a plain pre-norm
decoder: float32, no biases, no sandwich norms, no embed scale, one rotary table, q/k norms
folded into the rotation or absent, SiLU, and no module has a forward hook (a hook must see
its module run: a fault's, a user's). A layer whose fused call refuses its inputs (a
slot outside the buffers) or a token id outside the embedding hands the forward back to
the eager path, which raises the error. ``KVCANARY_CPU_DECODE=eager`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, cast

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic
from numba.typed import List
from torch.nn import functional as F
from torch.nn.modules import module as torch_module

from kvcanary import envs
from kvcanary.jit import calls
from kvcanary.jit import parallel as numba_parallel
from kvcanary.jit.calls import Callee, call
from kvcanary.ops.cpu import attention as attention_cpu
from kvcanary.ops.cpu import rmsnorm as norm_cpu
from kvcanary.ops.cpu import rope as rope_cpu
from kvcanary.ops.cpu.gemm import MIN_PACKED_BYTES, SMALL_PACKED_ROWS, cpu_gemm_mode

# Scratch of one sgemm_ call: int32 [m, n, k, lda, ldb, ldc, transa, transb], float32
# [alpha, beta] (Fortran passes every argument by address).
_M, _N, _K, _LDA, _LDB, _LDC, _TA, _TB = range(8)


@intrinsic
def _call_sgemm(typingctx, fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):  # type: ignore[no-untyped-def]
    """Call the Fortran ``sgemm_`` at address ``fn`` with the 13 argument addresses."""
    sig = types.void(*([types.int64] * 14))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [ptr] * 13)
        callee = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(callee, [builder.inttoptr(a, ptr) for a in args[1:]])
        return context.get_dummy_value()

    return sig, codegen


_sgemm_call: Any = _call_sgemm  # (the intrinsic's typing context argument confuses mypy)


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _linear(fn, x, w, out, si, sf):  # type: ignore[no-untyped-def]
    """``out [m, n] = x [m, k] @ w [n, k]^T`` (C-contiguous float32) by sgemm_ at ``fn``, as
    ``F.linear`` calls it: column-major ``out^T = w^T' x^T`` (``transa = T``)."""
    m, k = x.shape
    n = w.shape[0]
    si[_M], si[_N], si[_K] = n, m, k
    si[_LDA], si[_LDB], si[_LDC] = k, k, n
    si[_TA], si[_TB] = 84, 78  # 'T', 'N'
    sf[0], sf[1] = np.float32(1.0), np.float32(0.0)
    ip, fp = si.ctypes.data, sf.ctypes.data
    _sgemm_call(fn, ip + 4 * _TA, ip + 4 * _TB, ip + 4 * _M, ip + 4 * _N, ip + 4 * _K, fp,
                w.ctypes.data, ip + 4 * _LDA, x.ctypes.data, ip + 4 * _LDB, fp + 4,
                out.ctypes.data, ip + 4 * _LDC)  # fmt: skip


@numba.njit(cache=True, inline="always")
def _silu_row(gu, t, inter, out, buf):  # type: ignore[no-untyped-def]
    """Row ``t`` of :func:`_silu_mul` (``buf``: ``inter`` floats of scratch)."""
    u = np.uint64  # (an unsigned offset: no wrap-around code, which compiles scalar)
    for j in range(inter):
        buf[j] = attention_cpu._exp_one(min(-gu[t, j], np.float32(88.0)))
    for j in range(inter):
        out[t, j] = gu[t, j] / (np.float32(1.0) + buf[j]) * gu[t, u(inter) + u(j)]


@numba.njit(cache=True, boundscheck=False, nogil=True, fastmath=False, error_model="numpy")
def _silu_mul(gu, inter, out, buf):  # type: ignore[no-untyped-def]
    """``out[t] = silu(gu[t, :inter]) * gu[t, inter:]`` with ``silu(g) = g / (1 + e^-g)``,
    ``e^-g`` by :func:`kvcanary.ops.cpu.attention._exp_one` (its argument clamped to ``[-87, 88]``: no
    overflow of ``2^k``) into ``buf`` (``inter`` floats), then the product: two loops a row
    the compiler vectorises (one loop of both is not: ~4x slower). numpy's error model:
    numba's default checks every float division for a zero divisor (Python's
    ``ZeroDivisionError``), which kept the product's loop scalar (``1 + e^-g >= 1``; a
    tiny-swa batch-64 layer 38 -> 17 us)."""
    for t in range(gu.shape[0]):
        _silu_row(gu, t, inter, out, buf)


@numba.njit(cache=True, boundscheck=False, nogil=True, fastmath=False, error_model="numpy",
            parallel=True)  # fmt: skip
def _silu_mul_parallel(gu, inter, out):  # type: ignore[no-untyped-def]
    """:func:`_silu_mul` with its rows split among the threads (the same bits)."""
    for t in prange(gu.shape[0]):
        _silu_row(gu, t, inter, out, np.empty(inter, dtype=np.float32))


# _forward_nb splits SiLU's rows among threads from this many elements (a parallel region
# costs ~3 us; a tiny-swa batch-64 layer's 16384 elements took ~17 us on one thread).
SILU_PARALLEL_MIN = 8192


_BAD_TOKEN = 1 << 30  # _forward_nb: a token id outside the embedding
_NO_ROWS = np.zeros((0, 1, 1), dtype=np.float32)  # _forward_nb: a layer's rows not kept

# The kernels _forward_nb calls once a layer (or once a forward), through their addresses
# (kvcanary.jit.calls): linked, each would be compiled again into the forward (~44 s of
# compile on the 2-core host for a call a layer costs nothing).
_A1, _A2 = (types.Array(types.float32, n, "C") for n in (1, 2))
_SILU = (Callee(_silu_mul, types.none, _A2, types.int64, _A2, _A1),
         Callee(_silu_mul_parallel, types.none, _A2, types.int64, _A2))  # fmt: skip
_RMS_PAR = Callee(norm_cpu._rms_rows_parallel, types.none, types.int64, *norm_cpu._RMS_ARGS)
_ADD_RMS_PAR = Callee(norm_cpu._add_rms_rows_parallel, types.none, types.int64,
                      *norm_cpu._ADD_RMS_ARGS)  # fmt: skip
_RMS_T, _ADD_RMS_T = norm_cpu._RMS_ROWS_T, norm_cpu._ADD_RMS_ROWS_T
_RMS_PAR_T, _ADD_RMS_PAR_T = _RMS_PAR.type, _ADD_RMS_PAR.type
_LAYER_T = attention_cpu.LAYER.type
_SILU_T, _SILU_PAR_T = _SILU[0].type, _SILU[1].type
# _forward_nb's fns, in this order
_RMS_I, _RMS_PAR_I, _ADD_RMS_I, _ADD_RMS_PAR_I, _LAYER_I, _SILU_I, _SILU_PAR_I = range(7)
@functools.cache
def _callee_addresses() -> np.ndarray:
    """The addresses of the kernels :func:`_forward_nb` calls (compiled or loaded at the
    first call; the norm's row kernels of this process's width)."""
    lanes = norm_cpu.lanes()
    return calls.addresses(norm_cpu.RMS_ROWS[lanes], _RMS_PAR, norm_cpu.ADD_RMS_ROWS[lanes],
                           _ADD_RMS_PAR, attention_cpu.LAYER, *_SILU)  # fmt: skip


@numba.njit(cache=True, inline="always")
def _add_rms(fns, split, x, y, weight, eps, total, out):  # type: ignore[no-untyped-def]
    """``total = x + y``, ``out = rms_norm(total) * weight`` on every row, on threads if ``split``."""
    rows = x.shape[0]
    if split:
        call(_ADD_RMS_PAR_T, fns[_ADD_RMS_PAR_I], (fns[_ADD_RMS_I], x, y, weight, eps, total, out,
                                                   0, rows))  # fmt: skip
    else:
        call(_ADD_RMS_T, fns[_ADD_RMS_I], (x, y, weight, eps, total, out, 0, rows))


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _forward_nb(fn, fns, layer_fns, ids, embed, vecs, mats, k_bufs, v_bufs, sliding, scales, full, swa,  # type: ignore[no-untyped-def]
                k_outs, v_outs, num_heads, eps, qk_eps, qk_lanes, has_qk, cos, sin,
                norm_split, hidden):  # fmt: skip
    """The forward (module doc) into ``hidden [bs, H]`` (after the final norm). ``fns``:
    :func:`_callee_addresses`; ``layer_fns``: :func:`kvcanary.ops.cpu.attention.addresses`. ``vecs``:
    per layer input norm, post-attention norm, then the final norm's weight; ``mats``: per
    layer QKV, q/k norm weight (``[heads + kv heads, dim]``, or a placeholder), o, gate-up,
    down. ``full`` / ``swa``: the key tables (slots, write slots, key counts, tasks a
    request, split) of full and sliding layers. ``k_outs`` / ``v_outs``: per layer
    ``[bs, kv heads, dim]`` arrays that get the k / v rows it stores (for a store check's
    observers), or ``[0, 1, 1]`` placeholders. Returns -1, or the layer whose fused decode
    call refused its inputs (nothing after it ran; the caller runs the eager forward), or
    :data:`_BAD_TOKEN` for a token id outside the embedding (nothing ran)."""
    bs, width = ids.shape[0], embed.shape[1]
    si = np.empty(8, dtype=np.int32)
    sf = np.empty(2, dtype=np.float32)
    x = np.empty((bs, width), dtype=np.float32)
    total = np.empty((bs, width), dtype=np.float32)
    normed = np.empty((bs, width), dtype=np.float32)
    mlp = np.empty((bs, width), dtype=np.float32)
    for t in range(bs):
        if ids[t] < 0 or ids[t] >= embed.shape[0]:
            return _BAD_TOKEN  # (the eager forward raises the embedding's error)
    for t in range(bs):
        for e in range(width):
            x[t, e] = embed[ids[t], e]
    num_layers = sliding.shape[0]
    for i in range(num_layers):
        w_qkv, w_qk, w_o, w_gu, w_down = mats[5 * i], mats[5 * i + 1], mats[5 * i + 2], \
            mats[5 * i + 3], mats[5 * i + 4]  # fmt: skip
        if i == 0:
            if norm_split:
                call(_RMS_PAR_T, fns[_RMS_PAR_I], (fns[_RMS_I], x, vecs[0], True, eps, normed, 0,
                                                   bs))  # fmt: skip
            else:
                call(_RMS_T, fns[_RMS_I], (x, vecs[0], True, eps, normed, 0, bs))
        else:  # x + the previous layer's MLP output
            _add_rms(fns, norm_split, x, mlp, vecs[2 * i], eps, total, normed)
            x, total = total, x
        qkv = np.empty((bs, w_qkv.shape[0]), dtype=np.float32)
        _linear(fn, normed, w_qkv, qkv, si, sf)
        dim = cos.shape[1]
        heads3 = qkv.reshape(bs, w_qkv.shape[0] // dim, dim)
        att = np.empty((bs, num_heads, dim), dtype=np.float32)
        tb = swa if sliding[i] else full
        slots, loc, num_keys, parts, split = tb
        status = call(_LAYER_T, fns[_LAYER_I], (
                heads3, num_heads, w_qk, has_qk, qk_eps, qk_lanes, cos, sin, k_bufs[i],
                v_bufs[i], loc, slots, num_keys, scales[i], att, k_outs[i],
                parts, split, layer_fns))  # fmt: skip
        if status == attention_cpu._LAYER_REFUSED:
            return i
        v_out = v_outs[i]
        if v_out.shape[0]:  # the v rows it stored, for the observers
            kv_heads = v_out.shape[1]
            first_v = heads3.shape[1] - kv_heads
            for t in range(bs):
                for h in range(kv_heads):
                    for e in range(dim):
                        v_out[t, h, e] = heads3[t, first_v + h, e]
        o = np.empty((bs, width), dtype=np.float32)
        _linear(fn, att.reshape(bs, num_heads * dim), w_o, o, si, sf)
        _add_rms(fns, norm_split, x, o, vecs[2 * i + 1], eps, total, normed)
        x, total = total, x
        inter = w_gu.shape[0] // 2
        gu = np.empty((bs, 2 * inter), dtype=np.float32)
        _linear(fn, normed, w_gu, gu, si, sf)
        act = np.empty((bs, inter), dtype=np.float32)
        if bs * inter >= SILU_PARALLEL_MIN:
            call(_SILU_PAR_T, fns[_SILU_PAR_I], (gu, inter, act))
        else:
            call(_SILU_T, fns[_SILU_I], (gu, inter, act, np.empty(inter, dtype=np.float32)))
        _linear(fn, act, w_down, mlp, si, sf)
    _add_rms(fns, norm_split, x, mlp, vecs[2 * num_layers], eps, total, hidden)
    return -1


# ----------------------------------------------------------------- the BLAS and its check

_sgemm: int | None = None  # sgemm_'s address; 0: not available (probed once)


def _probe_sgemm() -> int:
    """sgemm_'s address in torch's CPU library when calling it gives ``F.linear``'s bits on
    a few decode shapes (module doc); else 0."""
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return 0
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        addr = ctypes.cast(lib.sgemm_, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0
    if not addr:
        return 0
    gen = torch.Generator().manual_seed(0)
    si, sf = np.empty(8, dtype=np.int32), np.empty(2, dtype=np.float32)
    for m, n, k in ((1, 24, 16), (5, 40, 32), (16, 96, 64), (33, 17, 48)):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        out = torch.empty(m, n)
        _linear(addr, x.numpy(), w.numpy(), out.numpy(), si, sf)
        if not torch.equal(out, F.linear(x, w)):
            return 0
    return addr


def sgemm_address() -> int:
    """:func:`_probe_sgemm`, once per process."""
    global _sgemm
    if _sgemm is None:
        _sgemm = _probe_sgemm()
    return _sgemm


# ----------------------------------------------------------------- the model's side

# torch's hooks on every module's forward (dicts updated in place by register_module_*)
_GLOBAL_HOOKS = (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks)


class CompiledDecode:
    """The compiled decode forward of one :class:`~kvcanary.model.decoder.HybridDecoder`
    (the caller's choice: this module reads its layers by name and does not import the
    model package) with weights as numpy views, checked per call against the tensors'
    addresses; :meth:`forward` or None (the eager forward)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._weights: tuple[int, ...] | None = None
        self._tensors: list[torch.Tensor] = []
        self._derived_from: list[torch.Tensor] = []
        self._packable = self._big = False
        self._vecs: Any = None
        self._no_rows: Any = None
        self._hook_dicts: list[Any] = []
        self._rows_cache: dict[tuple[int, tuple[int, ...]], Any] = {}
        self._mats: Any = None
        self._ok = self._eligible(model)
        if self._ok:  # (the sizes gemm.PackedLinear decides by: fixed with the model)
            linears = [w for layer in model.layers
                       for w in (layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight,
                                 layer.mlp.gate_up_weight, layer.mlp.down_proj.weight)]  # fmt: skip
            # (PackedLinear never packs a weight that requires grad or is an inference tensor)
            packable = [w for w in linears if not (w.requires_grad or w.is_inference())]
            self._packable = bool(packable)
            self._big = any(w.numel() * w.element_size() >= MIN_PACKED_BYTES for w in packable)

    @staticmethod
    def _eligible(model: Any) -> bool:
        """The model-level conditions (module doc); the per-forward ones are :meth:`forward`'s."""
        if envs.KVCANARY_CPU_DECODE.get() != "compiled":
            return False
        m: Any = model  # (its layers are DecoderLayers)
        c = m.config
        if (c.sandwich_norm or c.norm_weight_offset or model.embed_scale is not None
                or model.local_rotary is not None or c.hidden_act != "silu" or c.qkv_bias
                or c.o_bias or c.mlp_bias or model.embed_tokens.weight.dtype is not torch.float32
                or model.embed_tokens.weight.device.type != "cpu"):  # fmt: skip
            return False
        for layer in m.layers:
            attn = layer.self_attn
            if attn._qk_fold is False:  # (q/k norms that run apart)
                return False
            weights = (attn.qkv_weight, attn.o_proj.weight, layer.mlp.gate_up_weight,
                       layer.mlp.down_proj.weight)  # fmt: skip
            if any(not w.is_contiguous() for w in weights):
                return False
        return bool(sgemm_address()) and norm_cpu.lanes() > 0

    def _packs(self, rows: int) -> bool:
        """Whether the eager forward's linears would take oneDNN's packed GEMM at ``rows``
        rows (:class:`~kvcanary.ops.cpu.gemm.PackedLinear`'s policy): then this path's GEMMs
        would not be theirs."""
        mode = cpu_gemm_mode()
        if mode != "auto":
            return mode == "onednn" and self._packable
        small = SMALL_PACKED_ROWS.get(torch.float32)
        return self._big or (self._packable and small is not None and rows >= small[0])

    def _bind_weights(self) -> None:
        """The weights as numpy views in typed lists (once; again when a tensor moved)."""
        model = self.model
        tensors: list[torch.Tensor] = []
        derived_from: list[torch.Tensor] = []
        vecs, mats = List(), List()
        for layer in model.layers:
            attn = layer.self_attn
            qk = (attn._qk_norm_weight(torch.float32) if attn._qk_fold
                  else torch.ones(1, 1))  # fmt: skip
            vecs.append(layer.input_layernorm.weight.detach().numpy())
            vecs.append(layer.post_attention_layernorm.weight.detach().numpy())
            for w in (attn.qkv_weight, qk, attn.o_proj.weight, layer.mlp.gate_up_weight,
                      layer.mlp.down_proj.weight):  # fmt: skip
                mats.append(w.detach().numpy())
            tensors += [attn.qkv_weight, attn.o_proj.weight, layer.mlp.gate_up_weight,
                        layer.mlp.down_proj.weight, layer.input_layernorm.weight,
                        layer.post_attention_layernorm.weight]  # fmt: skip
            if attn._qk_fold:  # (the q/k weight above is made of these: versions too)
                derived_from += [cast(Any, attn.q_norm).weight, cast(Any, attn.k_norm).weight]
        vecs.append(model.norm.weight.detach().numpy())
        tensors += [model.embed_tokens.weight, model.norm.weight]
        # Every module's forward (pre-)hook dicts: a hook must see its module run (a fault's
        # hook, a user's instrumentation), so a model with one runs eagerly.
        self._hook_dicts = [d for mod in model.modules()
                            for d in (mod._forward_hooks, mod._forward_pre_hooks)]  # fmt: skip
        self._vecs, self._mats = vecs, mats
        self._no_rows = List([_NO_ROWS] * len(model.layers))  # (no store observed)
        self._tensors, self._derived_from = tensors, derived_from
        self._weights = self._key()

    def _key(self) -> tuple[int, ...]:
        """Where each weight lies (the views see in-place writes) and how often the q/k
        norm weights were written (the q/k weight is a copy of them; an inference tensor
        has no counter and cannot be written outside inference mode)."""
        return tuple([t.data_ptr() for t in self._tensors] + [
            0 if t.is_inference() else t._version for t in self._derived_from])

    def _rows_for(self, bs: int, layers: tuple[int, ...]) -> tuple[Any, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(k rows, v rows) arrays ``[bs, kv heads, dim]`` for ``layers`` (placeholders for the
        others) as typed lists, and those layers' (k, v) tensors; made once per batch size and
        layer set (a typed list made from Python costs ~75-250 us; the observers fold the
        rows they are given before the next forward, so the arrays can be reused)."""
        key = (bs, layers)
        cached = self._rows_cache.get(key)
        if cached is None:
            if len(self._rows_cache) >= 16:
                self._rows_cache.clear()
            spec = self.model.attention_specs[0]
            shape = (bs, spec.num_kv_heads, spec.head_dim)
            k_outs, v_outs = List(self._no_rows), List(self._no_rows)
            rows = []
            for i in layers:
                k, v = torch.empty(shape), torch.empty(shape)
                k_outs[i], v_outs[i] = k.numpy(), v.numpy()
                rows.append((k, v))
            cached = self._rows_cache[key] = (k_outs, v_outs, rows)
        return cached

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: Any) -> torch.Tensor | None:
        """The decode forward's hidden states ``[bs, H]`` (after the final norm), or None with
        nothing done where this path does not apply."""
        if not self._ok:
            return None
        model = self.model
        bs = input_ids.shape[0]
        if bs == 0 or input_ids.dtype is not torch.int64:
            return None
        if self._packs(bs):  # (a model of weights >= 1 MiB: every forward, at once)
            return None
        if self._weights is None or self._key() != self._weights:
            self._bind_weights()
        if _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or any(self._hook_dicts):
            return None
        backend = fb.attn_backend
        decode_buffers = getattr(backend, "decode_buffers", None)
        if decode_buffers is None:
            return None
        buffers = decode_buffers(model.attention_specs)
        if buffers is None:
            return None
        *tables, observed = buffers
        attn0 = model.layers[0].self_attn
        cos, sin = model.rotary.cos_sin(positions)
        dim = attn0.spec.head_dim
        cos_np, sin_np = rope_cpu.tables(cos, sin, bs, dim)
        has_qk = attn0._qk_fold is True
        qk_eps = np.float32(attn0.q_norm.eps if has_qk else 0.0)
        hidden = torch.empty((bs, model.config.hidden_size), dtype=torch.float32)
        width = model.config.hidden_size
        norm_split = bs >= norm_cpu._PARALLEL_MIN_ROWS and bs * width >= norm_cpu._PARALLEL_MIN_ELEMENTS
        lanes = norm_cpu.lanes()
        k_outs, v_outs = self._no_rows, self._no_rows
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        if observed:  # the stored rows of the layers a store check observes
            k_outs, v_outs, rows = self._rows_for(bs, tuple(i for i, *_ in observed))
        with numba_parallel.parallel_lock:
            numba_parallel.set_threads()
            bad = _forward_nb(  # type: ignore[call-arg]
                sgemm_address(), _callee_addresses(), attention_cpu.addresses(), input_ids.numpy(), model.embed_tokens.weight.detach().numpy(),
                self._vecs, self._mats, *tables, k_outs, v_outs, attn0.spec.num_heads,
                np.float32(model.norm.eps), qk_eps, lanes if has_qk else 0, has_qk,
                cos_np, sin_np, norm_split, hidden.numpy(),
            )  # fmt: skip
        if bad >= 0:
            return None
        if observed:
            backend.observe_decode(observed, [k for k, _ in rows], [v for _, v in rows])
        return hidden
