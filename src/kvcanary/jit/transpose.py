"""8 x 8 transposes of int64 words, as LLVM IR for numba intrinsics: :func:`load_lines`
loads one 64-byte line (8 consecutive words) of each of 8 lanes, lane ``k`` at
``src[rows[lane0 + k], cols[lane0 + k] + word : ... + 8]``, each one vector load, and
:func:`transpose_lines` turns them into 8 vectors, vector ``j`` holding word ``j`` of every
lane, with 24 shuffles in registers (``shufflevector`` in three stages of pairs, which x86-64
lowers to unpacks and permutes).

For kernels that run a serial chain per lane (the real-KV fingerprint: one hash step per word
of a slot, :func:`kvcanary.canary.wire.real_kv._fold_lines_of`) and vectorise across lanes: the
words of 8 slots side by side, from rows that lie anywhere in a pool. Copying the rows
element by element into a word-major tile instead (each store to another cache line) cost
twice the hashing itself (32 slots x 4 KiB, warm: 11.5 us copy, 4.7 us hash).

No bounds check: the caller keeps ``cols[k] + word + 8`` within ``src``'s rows and the rows
within ``src``. ``src``'s last dimension must have unit stride (any layout otherwise).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import types

from kvcanary.jit.prefetch import array_pointer, load_index

LANES = 8
_WORDS = (types.int64, types.uint64)
# Three stages of pairwise shuffles; after them vector j holds word j of lanes 0..7.
_STAGES = (
    # (pairs (a, b) of input vectors -> (out_a, out_b), mask of out_a, mask of out_b)
    ([(0, 1), (2, 3), (4, 5), (6, 7)], (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15)),
    ([(0, 2), (1, 3), (4, 6), (5, 7)], (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)),
    ([(0, 4), (1, 5), (2, 6), (3, 7)], (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)),
)


def vector_pointer(builder: Any, ptr: Any, vec: ir.VectorType) -> Any:
    """``ptr`` as a pointer to ``vec`` (typed pointers: a bitcast; opaque: as it is)."""
    if getattr(ptr.type, "is_opaque", False):
        return ptr
    return builder.bitcast(ptr, vec.as_pointer())


def load_lines(context: Any, builder: Any, src: tuple[Any, Any], rows: tuple[Any, Any],
               cols: tuple[Any, Any], lane0: Any, word: Any) -> list[Any]:
    """IR: the 8 lines ``src[rows[lane0 + k], cols[lane0 + k] + word : ... + 8]`` as ``<8 x
    i64>`` vectors (each ``(type, value)`` pair as a codegen receives its arguments;
    ``lane0`` and ``word`` intp values)."""
    intp = context.get_value_type(types.intp)
    vec = ir.VectorType(ir.IntType(64), LANES)
    lines = []
    for k in range(LANES):
        lane = builder.add(lane0, ir.Constant(intp, k))
        row = load_index(context, builder, *rows, [lane])
        col = load_index(context, builder, *cols, [lane])
        ptr = array_pointer(context, builder, *src, [row, builder.add(col, word)])
        lines.append(builder.load(vector_pointer(builder, ptr, vec), align=8, typ=vec))
    return lines


def transpose_lines(builder: Any, lines: list[Any]) -> list[Any]:
    """IR: 8 ``<8 x i64>`` vectors, lane ``k`` of vector ``j`` -> lane ``j`` of vector ``k``."""
    for pairs, mask_a, mask_b in _STAGES:
        out = list(lines)
        for a, b in pairs:
            for dest, mask in ((a, mask_a), (b, mask_b)):
                m = ir.Constant(ir.VectorType(ir.IntType(32), LANES), list(mask))
                out[dest] = builder.shuffle_vector(lines[a], lines[b], m)
        lines = out
    return lines


def transpose_arrays_ok(src: Any, rows: Any, cols: Any) -> bool:
    """Whether numba types ``src`` (2-D int64 / uint64 words), ``rows`` and ``cols`` (1-D
    integers) are what :func:`load_lines` takes (an intrinsic's typing check)."""
    return (isinstance(src, types.Array) and src.ndim == 2 and src.dtype in _WORDS
            and all(isinstance(a, types.Array) and a.ndim == 1 and isinstance(a.dtype, types.Integer)
                    for a in (rows, cols)))  # fmt: skip
