"""Vector kernels for decode attention's inner loops, as LLVM IR for numba intrinsics: 8-lane
float32 vectors (``<8 x float>``, one AVX register) the compiler cannot be talked into from
numba loops.

* :func:`dot8` -- 8 keys' scores of one query head at once: per key, its K row times the
  query row in 8-lane chunks accumulated in a register (one FMA chain per key, 8 chains in
  flight), then the 8 accumulators summed lane-wise in one tree of shuffles (three stages of
  pairwise ``shufflevector`` + add, :data:`_STAGES`): 7 adds and 14 shuffles for 8 scores,
  where a numba loop reduces each key's dot product on its own (a horizontal sum per score,
  and the loop's remainder code per key). The sums' order differs from a sequential one
  (float rounding, ~1e-7 relative); it is fixed: the same bits on every call.
* :func:`axpy4` / :func:`axpy1` -- ``acc[i, e0 : e0 + 32]`` (``+ 8``) ``+= p[i, j] *
  V[slot j, h, e0 : ...]`` over keys ``[j0, j1)``, the 32 (8) accumulators in registers
  across the keys; a numba loop loads and stores its accumulator row every key (the
  compiler cannot keep an array row in registers). Each element's sum runs over the keys in
  order with one FMA a key: the same bits as the loop ``acc[i, e] += p * v[e]`` compiled
  with FMA contraction (numba's ``fastmath``).
* :func:`row_max` / :func:`row_sum` -- softmax's maximum and sum of a row, 8 lanes a step
  (a running maximum / sum per lane in one register, folded at the end), where a loop in
  float32 waits for each comparison or add before the next (one thread, 4 rows of 130
  scores, exp included: ~35 -> ~6 ns a key, a strict-order build).
* :func:`f32_from_bits` -- an int32's bits as a float32 (the exponent a polynomial ``exp``
  builds), so that it stays in one vectorised loop (a scratch array viewed as float32
  splits it in two).

Measured (microbenchmark, one thread, tiny-swa shapes: 4 query / 2 KV heads, dim 32, 64
requests x 165 keys, K/V in L1): scores 13.3 -> 8.3 ns a key, weighted sum 15.7 -> 5.6. In
the engine (tiny-swa, batch 64, 128 in / 64 out, the decode attention kernel
:func:`kvcanary.ops.cpu.attention._attend` with them, old / new alternated): a decode
step's attention at its last step's tables, warm, 2 full layers 1191-1335 -> 623-757 us, 4
sliding 732-806 -> 444-532; the compiled decode forward over a run's 63 steps 170-243 ->
146-186 ms.

No bounds check and no layout check: the caller keeps every index in its array and the last
dimension of ``q_rows`` / ``k_buf`` / ``v_buf`` / ``acc`` / ``scores`` of unit stride, the
row length (``k_buf``'s last dimension) a multiple of 8, and ``scores`` 8 columns wide past
``j0`` (:func:`dot8` stores all 8 lanes; lanes past ``cnt`` score the first key again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvcanary.jit.prefetch import array_pointer, load_index
from kvcanary.jit.transpose import vector_pointer

LANES = 8
_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, LANES)
# Lane-wise sums of 8 vectors in three stages of pairs: after stage s, vector m holds, in
# groups, partial sums of 2^(s+1) input vectors; after the last, lane k is vector k's total.
_STAGES = (
    ((0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15)),
    ((0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)),
    ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)),
)


def _mask(lanes: tuple[int, ...]) -> ir.Constant:
    return ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), list(lanes))


def _sum_lanes(builder: Any, vecs: list[Any]) -> Any:
    """IR: 8 ``<8 x float>`` -> one whose lane ``k`` is the sum of ``vecs[k]``'s lanes."""
    for lo, hi in _STAGES:
        vecs = [builder.fadd(builder.shuffle_vector(a, b, _mask(lo)),
                             builder.shuffle_vector(a, b, _mask(hi)))
                for a, b in zip(vecs[0::2], vecs[1::2], strict=True)]  # fmt: skip
    return vecs[0]


def _fma(builder: Any, a: Any, b: Any, c: Any) -> Any:
    """IR: ``a * b + c`` lane-wise, one rounding (``llvm.fma.v8f32``)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8, [_V8, _V8, _V8]), "llvm.fma.v8f32"
    )
    return builder.call(fn, [a, b, c])


def _splat(builder: Any, x: Any) -> Any:
    """IR: float ``x`` in all 8 lanes."""
    one = builder.insert_element(ir.Constant(_V8, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(_V8, ir.Undefined), _mask((0,) * LANES))


def _load8(builder: Any, ptr: Any) -> Any:
    return builder.load(vector_pointer(builder, ptr, _V8), align=4, typ=_V8)


def _loop(builder: Any, start: Any, stop: Any, step: int, inits: list[Any],
          body: Callable[[Any, list[Any]], list[Any]]) -> list[Any]:
    """IR: ``for idx in range(start, stop, step): values = body(idx, values)`` with the
    values carried in registers (phi nodes); the values after the loop."""
    pre = builder.block
    head = builder.append_basic_block("simd.head")
    block = builder.append_basic_block("simd.body")
    done = builder.append_basic_block("simd.done")
    builder.branch(head)
    builder.position_at_end(head)
    idx = builder.phi(start.type)
    idx.add_incoming(start, pre)
    phis = []
    for value in inits:
        phi = builder.phi(value.type)
        phi.add_incoming(value, pre)
        phis.append(phi)
    builder.cbranch(builder.icmp_signed("<", idx, stop), block, done)
    builder.position_at_end(block)
    new = body(idx, phis)
    end = builder.block
    idx.add_incoming(builder.add(idx, ir.Constant(start.type, step)), end)
    for phi, value in zip(phis, new, strict=True):
        phi.add_incoming(value, end)
    builder.branch(head)
    builder.position_at_end(done)
    return phis


def _indices(context: Any, builder: Any, pairs: list[tuple[Any, Any]]) -> list[Any]:
    """Integer arguments (type, value) as intp values."""
    return [context.cast(builder, v, t, types.intp) for t, v in pairs]


def _float_arrays(*arrays: Any) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.float32 for a in arrays)


def _ints(*values: Any) -> bool:
    return all(isinstance(v, types.Integer) for v in values)


def _make_dot8(rows: int) -> Any:
    """The intrinsic scoring 8 keys for ``rows`` query rows that share a KV head
    (:func:`dot8`, :func:`dot8x2`): each K vector loaded once for all of them."""

    def dot(typingctx: Any, q_rows: Any, i: Any, k_buf: Any, h: Any, slots: Any, b: Any,
            j0: Any, cnt: Any, scores: Any, scale: Any) -> Any:  # fmt: skip
        if not (_float_arrays(q_rows, k_buf, scores) and q_rows.ndim == 2 and k_buf.ndim == 3
                and scores.ndim == 2 and isinstance(slots, types.Array) and slots.ndim == 2
                and isinstance(slots.dtype, types.Integer) and _ints(i, h, b, j0, cnt)
                and scale == types.float32):  # fmt: skip
            return None
        sig = types.void(q_rows, i, k_buf, h, slots, b, j0, cnt, scores, scale)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            qt, it, kt, ht, st, bt, jt, ct, sct, _ = signature.args
            qv, iv, kv, hv, sv, bv, jv, cv, scv, scale_v = args
            i_, h_, b_, j_, c_ = _indices(context, builder, [(it, iv), (ht, hv), (bt, bv), (jt, jv), (ct, cv)])
            intp = i_.type
            zero = ir.Constant(intp, 0)
            dim = builder.extract_value(context.make_array(kt)(context, builder, kv).shape, 2)
            keys = []
            for k in range(LANES):
                kk = ir.Constant(intp, k)
                col = builder.select(builder.icmp_signed("<", kk, c_), builder.add(j_, kk), j_)
                slot = load_index(context, builder, st, sv, [b_, col])
                keys.append(array_pointer(context, builder, kt, kv, [slot, h_, zero]))
            row_ids = [builder.add(i_, ir.Constant(intp, r)) for r in range(rows)]
            q_ptrs = [array_pointer(context, builder, qt, qv, [r, zero]) for r in row_ids]

            def body(e: Any, accs: list[Any]) -> list[Any]:
                ks = [_load8(builder, builder.gep(p, [e])) for p in keys]
                out = []
                for r, q_ptr in enumerate(q_ptrs):
                    qx = _load8(builder, builder.gep(q_ptr, [e]))
                    out += [_fma(builder, qx, kx, a)
                            for kx, a in zip(ks, accs[r * LANES : (r + 1) * LANES], strict=True)]  # fmt: skip
                return out

            zeros = [ir.Constant(_V8, [0.0] * LANES)] * (LANES * rows)
            accs = _loop(builder, zero, dim, LANES, zeros, body)
            for r, row in enumerate(row_ids):
                total = builder.fmul(_sum_lanes(builder, accs[r * LANES : (r + 1) * LANES]),
                                     _splat(builder, scale_v))  # fmt: skip
                out = array_pointer(context, builder, sct, scv, [row, j_])
                builder.store(total, vector_pointer(builder, out, _V8), align=4)
            return context.get_dummy_value()

        return sig, codegen

    dot.__name__ = dot.__qualname__ = "dot8" if rows == 1 else f"dot8x{rows}"
    return intrinsic(dot)


dot8: Any = _make_dot8(1)
"""``scores[i, j0 + k] = scale * (q_rows[i, :] . k_buf[slots[b, j0 + k], h, :])`` for ``k <
8``; lanes ``k >= cnt`` use key ``j0`` (a valid slot) and their scores are not meant to be
read. ``q_rows`` / ``scores`` 2-D, ``k_buf`` 3-D float32, ``slots`` 2-D integers, ``scale``
float32."""
dot8x2: Any = _make_dot8(2)
""":data:`dot8` of rows ``i`` and ``i + 1`` (both of KV head ``h``: a GQA group's heads),
each K vector loaded once for both; each row's scores are :data:`dot8`'s bits."""


def _make_axpy(vectors: int, rows: int = 1) -> Any:
    """The intrinsic adding ``vectors`` x 8 floats of V rows into ``rows`` accumulator rows
    (:func:`axpy4`, :func:`axpy1`, :func:`axpy4x2`, :func:`axpy1x2`)."""

    def axpy(typingctx: Any, acc: Any, i: Any, e0: Any, scores: Any, v_buf: Any, h: Any,
             slots: Any, b: Any, j0: Any, j1: Any) -> Any:  # fmt: skip
        if not (_float_arrays(acc, scores, v_buf) and acc.ndim == 2 and scores.ndim == 2
                and v_buf.ndim == 3 and isinstance(slots, types.Array) and slots.ndim == 2
                and isinstance(slots.dtype, types.Integer) and _ints(i, e0, h, b, j0, j1)):  # fmt: skip
            return None
        sig = types.void(acc, i, e0, scores, v_buf, h, slots, b, j0, j1)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            at, it, et, sct, vt, ht, st, bt, jt, j1t = signature.args
            av, iv, ev, scv, vv, hv, sv, bv, jv, j1v = args
            i_, e_, h_, b_, j_, end = _indices(context, builder, [
                (it, iv), (et, ev), (ht, hv), (bt, bv), (jt, jv), (j1t, j1v)])  # fmt: skip
            intp = i_.type
            row_ids = [builder.add(i_, ir.Constant(intp, r)) for r in range(rows)]
            chunks = []
            for row in row_ids:
                base = array_pointer(context, builder, at, av, [row, e_])
                chunks += [builder.gep(base, [ir.Constant(intp, LANES * c)]) for c in range(vectors)]

            def body(j: Any, accs: list[Any]) -> list[Any]:
                slot = load_index(context, builder, st, sv, [b_, j])
                v_row = array_pointer(context, builder, vt, vv, [slot, h_, e_])
                vs = [_load8(builder, builder.gep(v_row, [ir.Constant(intp, LANES * c)]))
                      for c in range(vectors)]  # fmt: skip
                out = []
                for r, row in enumerate(row_ids):
                    p = _splat(builder, builder.load(array_pointer(context, builder, sct, scv, [row, j])))
                    out += [_fma(builder, p, vx, a)
                            for vx, a in zip(vs, accs[r * vectors : (r + 1) * vectors], strict=True)]  # fmt: skip
                return out

            accs = _loop(builder, j_, end, 1, [_load8(builder, c) for c in chunks], body)
            for c, a in zip(chunks, accs, strict=True):
                builder.store(a, vector_pointer(builder, c, _V8), align=4)
            return context.get_dummy_value()

        return sig, codegen

    axpy.__name__ = axpy.__qualname__ = f"axpy{vectors}" + (f"x{rows}" if rows > 1 else "")
    return intrinsic(axpy)


axpy4 = _make_axpy(4)
"""``acc[i, e0 : e0 + 32] += sum over j in [j0, j1) of scores[i, j] * v_buf[slots[b, j], h,
e0 : e0 + 32]`` (``acc`` / ``scores`` 2-D, ``v_buf`` 3-D float32, ``slots`` 2-D integers)."""
axpy1 = _make_axpy(1)
"""As :data:`axpy4`, 8 floats ``[e0, e0 + 8)``."""
axpy4x2 = _make_axpy(4, 2)
""":data:`axpy4` of rows ``i`` and ``i + 1`` (both of KV head ``h``), each V vector loaded
once for both; each row's sums are :data:`axpy4`'s bits."""
axpy1x2 = _make_axpy(1, 2)
"""As :data:`axpy4x2`, 8 floats."""


def _make_row_reduce(kind: str) -> Any:
    """The intrinsic reducing ``x[i, :n]`` (:func:`row_max`, :func:`row_sum`)."""

    def reduce(typingctx: Any, x: Any, i: Any, n: Any) -> Any:
        if not (_float_arrays(x) and x.ndim == 2 and _ints(i, n)):
            return None
        sig = types.float32(x, i, n)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            xt, it, nt = signature.args
            xv, iv, nv = args
            i_, n_ = _indices(context, builder, [(it, iv), (nt, nv)])
            intp = i_.type
            zero = ir.Constant(intp, 0)
            row = array_pointer(context, builder, xt, xv, [i_, zero])
            lanes = ir.Constant(intp, LANES)
            whole = builder.mul(builder.sdiv(n_, lanes), lanes)  # (n >= 0)
            if kind == "max":
                init = ir.Constant(_F32, float("-inf"))

                def combine(a: Any, b: Any) -> Any:  # b where b > a (a NaN b: a)
                    return builder.select(builder.fcmp_ordered(">", b, a), b, a)
            else:
                init = ir.Constant(_F32, 0.0)

                def combine(a: Any, b: Any) -> Any:
                    return builder.fadd(a, b)

            def vector(j: Any, accs: list[Any]) -> list[Any]:
                return [combine(accs[0], _load8(builder, builder.gep(row, [j])))]

            (acc,) = _loop(builder, zero, whole, LANES, [_splat(builder, init)], vector)
            for lo, hi in _HALVES:  # 8 lanes -> 4 -> 2 -> 1
                acc = combine(builder.shuffle_vector(acc, acc, _mask(lo)),
                              builder.shuffle_vector(acc, acc, _mask(hi)))  # fmt: skip
            total = builder.extract_element(acc, ir.Constant(ir.IntType(32), 0))

            def scalar(j: Any, vals: list[Any]) -> list[Any]:
                return [combine(vals[0], builder.load(builder.gep(row, [j])))]

            (total,) = _loop(builder, whole, n_, 1, [total], scalar)
            return total

        return sig, codegen

    reduce.__name__ = reduce.__qualname__ = f"row_{kind}"
    return intrinsic(reduce)


# Lane pairs folded at each halving of an 8-lane vector (lanes past the half: don't care).
_HALVES = (((0, 1, 2, 3, 0, 1, 2, 3), (4, 5, 6, 7, 4, 5, 6, 7)),
           ((0, 1, 0, 1, 0, 1, 0, 1), (2, 3, 2, 3, 2, 3, 2, 3)),
           ((0, 0, 0, 0, 0, 0, 0, 0), (1, 1, 1, 1, 1, 1, 1, 1)))  # fmt: skip

row_max = _make_row_reduce("max")
"""``max(x[i, :n])`` (float32; ``-inf`` for ``n == 0``; a NaN among them is passed over),
8 lanes a step: a running maximum in one register per lane, folded at the end, where a
scalar loop waits for each comparison's result before the next."""
row_sum = _make_row_reduce("sum")
"""``sum(x[i, :n])`` (float32), 8 lanes a step as :data:`row_max`: lane ``k`` sums elements
``k, k + 8, ...`` of the whole vectors, the lanes folded pairwise, then the last ``n % 8``
in order (a fixed order: the same bits on every call; not a sequential sum's rounding)."""


@intrinsic
def _f32_from_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bit pattern is int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], _F32)

    return types.float32(types.int32), codegen


f32_from_bits: Any = _f32_from_bits
