"""Errors raised by the memory system."""

from __future__ import annotations


class MemoryPoolError(RuntimeError):
    """Base class for memory-system errors."""


class PoolExhaustedError(MemoryPoolError):
    """A pool has no room for the request (the caller may evict or retract and retry)."""


class DoubleFreeError(MemoryPoolError):
    """A slot/page/row was freed while already free: a bookkeeping bug in the caller."""


class IntegrityError(MemoryPoolError):
    """``check_integrity()`` found a broken invariant; the message lists every problem."""


def raise_if_problems(owner: str, problems: list[str]) -> bool:
    """Raise :class:`IntegrityError` naming ``owner`` and every problem, else return True."""
    if problems:
        raise IntegrityError(f"{owner}: " + "; ".join(problems))
    return True
