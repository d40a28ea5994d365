"""Put a fixed upstream bug back, for the replay suites: the exact source lines of the fix,
replaced in the installed engine's function, for the duration of a ``with`` block.

    with revert_fix(scheduler.Scheduler._free_blocks, fixed="...", buggy="..."):
        ...

The function's source (``inspect.getsource`` of the installed file) must contain ``fixed``
exactly ``count`` times, or :class:`FixNotFound` is raised: a version drift fails loudly,
it never passes silently. The edited source is compiled in the function's own module
globals (zero-argument ``super()`` keeps working) and set on its owner (the class for a
method, the module for a function); ``also`` names further ``(owner, attribute)`` places that
hold the same function (``from x import f`` copies). Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap
import types
from collections.abc import Iterator, Sequence
from typing import Any


class FixNotFound(AssertionError):
    """The installed engine's source does not contain the fix's lines as expected."""


def _owner(func: Any) -> Any:
    module = sys.modules[func.__module__]
    owner: Any = module
    for part in func.__qualname__.split(".")[:-1]:
        if part == "<locals>":
            raise TypeError(f"{func.__qualname__}: a nested function cannot be replaced")
        owner = getattr(owner, part)
    return owner


def _strip_decorators(source: str) -> str:
    lines = source.splitlines(keepends=True)
    i = 0
    while lines[i].lstrip().startswith("@"):  # decorators (one line each in every target)
        i += 1
    return "".join(lines[i:])


def patched_function(func: Any, fixed: str, buggy: str, count: int = 1) -> types.FunctionType:
    """``func`` with ``fixed`` replaced by ``buggy`` in its source (module doc)."""
    source = textwrap.dedent(inspect.getsource(func))
    found = source.count(fixed)
    if found != count:
        where = f"{inspect.getsourcefile(func)}: {func.__qualname__}"
        raise FixNotFound(f"{where}: the fix's lines occur {found} times, expected {count}:\n"
                          f"{fixed}")  # fmt: skip
    body = _strip_decorators(source.replace(fixed, buggy))
    name = func.__name__
    filename = f"<revert-fix {func.__module__}.{func.__qualname__}>"
    namespace: dict[str, Any] = {}
    if "__class__" in func.__code__.co_freevars:  # zero-argument super()
        maker = "def __make(__class__):\n" + textwrap.indent(body, "    ") + f"    return {name}\n"
        exec(compile(maker, filename, "exec"), func.__globals__, namespace)
        new = namespace["__make"](_owner(func))
    else:
        exec(compile(body, filename, "exec"), func.__globals__, namespace)
        new = namespace[name]
    new.__qualname__ = func.__qualname__
    new.__module__ = func.__module__
    if func.__defaults__ is not None and new.__defaults__ is None:
        new.__defaults__ = func.__defaults__
    return new


@contextlib.contextmanager
def revert_fix(func: Any, *, fixed: str, buggy: str, count: int = 1,
               also: Sequence[tuple[Any, str]] = ()) -> Iterator[types.FunctionType]:  # fmt: skip
    """Within the block, ``func`` runs with ``fixed`` replaced by ``buggy`` (module doc)."""
    raw = inspect.unwrap(func)
    new = patched_function(raw, fixed, buggy, count)
    owner = _owner(raw)
    wrapped = owner.__dict__.get(raw.__name__) if isinstance(owner, type) else None
    if isinstance(wrapped, staticmethod):
        value: Any = staticmethod(new)
    elif isinstance(wrapped, classmethod):
        value = classmethod(new)
    else:
        value = new
    places = [(owner, raw.__name__), *also]
    saved = [(o, a, (o.__dict__ if isinstance(o, type) else vars(o)).get(a)) for o, a in places]
    try:
        for o, a in places:
            setattr(o, a, value if (o, a) == places[0] else new)
        yield new
    finally:
        for o, a, old in saved:
            setattr(o, a, old)
