"""Software prefetch for numba kernels: ``prefetch(a, i)`` / ``prefetch(a, (i, j, ...))``
asks the CPU to start loading the cache line that holds ``a[i, 0, ...]`` /
``a[i, j, ..., 0, ...]`` (any array, any layout; missing trailing indices are 0), and
returns at once.

For kernels whose reads jump: a decode step's attention reads each key's K and V rows
through a slot table, a few hundred bytes a key from pages scattered over the pool, and the
hardware prefetcher, which follows sequential streams, cannot guess the next page. Asking for
a key's rows a few keys before they are read overlaps the DRAM trips that would otherwise run
one after the other (:func:`kvcanary.ops.cpu.attention._attend`: a tiny-swa decode layer
at batch 64 in the engine, whose K/V come from memory every step, ~20 % faster).

The address is computed from the array's strides without a bounds check: a prefetch never
faults, and one past the array is only a wasted hint (``llvm.prefetch``: read, keep in all
cache levels, data cache).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


def array_pointer(context: Any, builder: Any, aty: Any, value: Any, idx: list[Any]) -> Any:
    """IR: the address of element ``idx`` (intp values, one per dimension) of array
    ``value`` of numba type ``aty``, from its strides, no bounds check (for intrinsics'
    codegen: this module's, :mod:`kvcanary.jit.transpose`'s and
    :mod:`kvcanary.jit.simd`'s)."""
    array = context.make_array(aty)(context, builder, value)
    return cgutils.get_item_pointer2(
        context, builder, array.data, cgutils.unpack_tuple(builder, array.shape),
        cgutils.unpack_tuple(builder, array.strides), aty.layout, idx,
        wraparound=False, boundscheck=False,
    )  # fmt: skip


def load_index(context: Any, builder: Any, aty: Any, value: Any, idx: list[Any]) -> Any:
    """IR: element ``idx`` of integer array ``value`` (numba type ``aty``) as an intp (a
    slot or row number an intrinsic reads from a table), no bounds check."""
    item = builder.load(array_pointer(context, builder, aty, value, idx))
    return context.cast(builder, item, aty.dtype, types.intp)


@intrinsic
def _prefetch(typingctx: Any, a: Any, index: Any) -> Any:
    """Hint: the cache line of ``a[index]`` (an integer, or a tuple of at most ``a.ndim``
    integers; the rest 0) will be read soon."""
    if not isinstance(a, types.Array):
        return None
    if isinstance(index, types.Integer):
        count = 1
    elif isinstance(index, types.BaseTuple) and all(
        isinstance(t, types.Integer) for t in getattr(index, "types", ())  # (untyped in numba)
    ):
        count = len(index)
    else:
        return None
    if not 1 <= count <= a.ndim:
        return None
    sig = types.void(a, index)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aty, ity = signature.args
        if count == 1 and isinstance(ity, types.Integer):
            values, kinds = [args[1]], [ity]
        else:
            values, kinds = cgutils.unpack_tuple(builder, args[1], count), list(ity)
        idx = [context.cast(builder, v, t, types.intp) for v, t in zip(values, kinds, strict=True)]
        idx += [context.get_constant(types.intp, 0)] * (aty.ndim - count)
        ptr = array_pointer(context, builder, aty, args[0], idx)
        i32 = ir.IntType(32)
        name = "llvm.prefetch.p0"  # (opaque pointers: LLVM >= 15, llvmlite >= 0.45)
        if not getattr(ptr.type, "is_opaque", False):  # typed pointers: the i8* overload
            ptr, name = builder.bitcast(ptr, ir.IntType(8).as_pointer()), "llvm.prefetch.p0i8"
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]), name
        )
        # (address, 0: read, 3: keep in every cache level, 1: data)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# The intrinsic as its callers see it (``prefetch(a, index)`` inside a jitted function; the
# decorator's own type has the typing context as a first parameter).
prefetch = cast(Callable[[Any, Any], None], _prefetch)
