"""Calls from one compiled kernel into another that numba does not link: a call through the
callee's address, passed in at run time.

A compiled function that calls another one links the callee's whole LLVM module into its
own and runs LLVM's full optimisation and code generation over the result again
(``numba.core.codegen.CPUCodeLibrary.finalize``), transitively: a driver that calls a
dozen large kernels (the compiled decode forward, the canary's fused HEAD) recompiles every
one of them, each time, and caches a copy of each. Where a call is coarse (once a layer or a
group, not once a row) inlining buys nothing, and the link only costs compile time: a driver
calling ``rmsnorm._rms_rows`` three times compiled in 7.3 s linked, 0.36 s through its
address.

A :class:`Callee` is a kernel and one signature, declared where the driver is; the driver
takes its address (:meth:`Callee.address`, an ``int64``) as an argument and calls
``call(CALLEE_TYPE, address, (arg, ...))`` (``CALLEE_TYPE``: the callee's :attr:`Callee.type`
as a module global), numba's own call of a compiled function through that address. The
signature is checked on both sides: the driver does not type-check against a mismatched
type, and the address is that of the callee compiled for exactly its arguments. The
driver's cache holds no callee code, so an edited callee never reaches a stale driver.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import numpy as np
from numba.core import cgutils, types
from numba.core.typeconv import Conversion
from numba.experimental.function_type import _get_jit_address
from numba.extending import intrinsic


class Callee:
    """``kernel`` compiled for ``args`` (numba types), returning ``returns``; its address
    for a driver (module doc)."""

    def __init__(self, kernel: Any, returns: types.Type, *args: types.Type) -> None:
        self.kernel = kernel
        self.type = types.FunctionType(returns(*args))
        self._address = 0
        self._lock = threading.Lock()

    def address(self) -> int:
        """The kernel's entry address for this signature (compiled or loaded from the cache
        at the first call)."""
        if not self._address:
            with self._lock:
                if not self._address:
                    sig = self.type.signature
                    self.kernel.compile(sig.args)
                    self._address = _get_jit_address(self.kernel, sig)
        return self._address

    def __repr__(self) -> str:
        return f"Callee({self.kernel.py_func.__qualname__}, {self.type.signature})"


def addresses(*callees: Callee) -> np.ndarray:
    """The callees' addresses (:meth:`Callee.address`) as the int64 array a driver takes."""
    return np.array([c.address() for c in callees], dtype=np.int64)


@intrinsic
def _call(typingctx: Any, fn_type: Any, address: Any, args: Any) -> Any:
    """``callee(*args)`` for the callee of type ``fn_type`` (a :attr:`Callee.type`) at
    ``address`` (:meth:`Callee.address`), inside a compiled driver: numba's own call of a
    compiled function (its calling convention, its error status propagated), through the
    address. ``args``: a tuple, each converted to the declared type (a safe conversion
    only, as a typed call: an array of another layout or dtype fails to type)."""
    fty = fn_type.instance_type
    if (not isinstance(fty, types.FunctionType) or not isinstance(address, types.Integer)
            or not isinstance(args, types.BaseTuple)):  # fmt: skip
        return None
    declared = fty.signature
    arg_types: tuple[Any, ...] = tuple(cast(Any, args))
    if len(arg_types) != len(declared.args):
        return None
    for got, want in zip(arg_types, declared.args, strict=True):
        score = typingctx.can_convert(types.unliteral(got), want)
        if score is None or score > Conversion.safe:
            return None

    def codegen(context: Any, builder: Any, signature: Any, llargs: Any) -> Any:
        values = [context.cast(builder, builder.extract_value(llargs[2], i), got, want)
                  for i, (got, want) in enumerate(zip(arg_types, declared.args, strict=True))]  # fmt: skip
        fnty = context.call_conv.get_function_type(declared.return_type, declared.args)
        ptr = builder.inttoptr(llargs[1], fnty.as_pointer())
        status, res = context.call_conv.call_function(builder, ptr, declared.return_type,
                                                      declared.args, values)  # fmt: skip
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return res

    return declared.return_type(fn_type, address, args), codegen


call: Any = _call  # (the intrinsic's typing context argument confuses mypy)
