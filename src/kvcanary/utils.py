"""Small arithmetic helpers shared by the memory system, scheduler and canary."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def floor_page(num_tokens: int, page_size: int) -> int:
    """Largest multiple of ``page_size`` that is <= ``num_tokens``."""
    return (num_tokens // page_size) * page_size


def ceil_page(num_tokens: int, page_size: int) -> int:
    """Smallest multiple of ``page_size`` that is >= ``num_tokens``."""
    return cdiv(num_tokens, page_size) * page_size
