"""Software prefetch for numba kernels: ``prefetch(a, i, j, k)`` asks the CPU to start
loading the cache line that holds ``a[i, j, k]`` (a 3-D array, any layout), and returns at
once.

For kernels whose reads jump: a decode step's attention reads each key's K and V rows
through a slot table, a few hundred bytes a key from pages scattered over the pool, and the
hardware prefetcher, which follows sequential streams, cannot guess the next page. Asking for
a key's rows a few keys before they are read overlaps the DRAM trips that would otherwise run
one after the other (:func:`kvcanary.engine.attention_cpu._attend`: a tiny-swa decode layer
at batch 64 in the engine, whose K/V come from memory every step, ~20 % faster).

The address is computed from the array's strides without a bounds check: a prefetch never
faults, and one past the array is only a wasted hint (``llvm.prefetch``: read, keep in all
cache levels, data cache).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx: Any, a: Any, i: Any, j: Any, k: Any) -> Any:
    """Hint: ``a[i, j, k]``'s cache line will be read soon (``a`` 3-D, indices integers)."""
    if not (isinstance(a, types.Array) and a.ndim == 3
            and all(isinstance(x, types.Integer) for x in (i, j, k))):  # fmt: skip
        return None
    sig = types.void(a, i, j, k)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index = [context.cast(builder, v, t, types.intp)
                 for v, t in zip(args[1:], signature.args[1:], strict=True)]  # fmt: skip
        ptr = cgutils.get_item_pointer2(
            context, builder, array.data, cgutils.unpack_tuple(builder, array.shape),
            cgutils.unpack_tuple(builder, array.strides), signature.args[0].layout, index,
            wraparound=False, boundscheck=False,
        )  # fmt: skip
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
