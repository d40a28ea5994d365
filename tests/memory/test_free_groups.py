"""Free groups nest: only the outermost ``free_group_end`` frees, so an inner group never
drops (leaks) what an outer one queued. Plain and SWA allocators, page 1/2/4."""

from __future__ import annotations

import pytest
import torch

from kvcanary.memory.allocator import PagedAllocator, make_allocator
from kvcanary.memory.swa_allocator import SWAAllocator


def make(kind: str, page_size: int) -> PagedAllocator | SWAAllocator:
    return SWAAllocator(32, 16, page_size) if kind == "swa" else make_allocator(32, page_size)


def sizes(a: PagedAllocator | SWAAllocator) -> tuple[int, ...]:
    if isinstance(a, SWAAllocator):
        return a.full_available_size(), a.swa_available_size()
    return (a.available_size(),)


def alloc_seq(a: PagedAllocator | SWAAllocator, num_tokens: int) -> torch.Tensor:
    slots = a.alloc_extend([0], [num_tokens], torch.tensor([-1]))
    assert slots is not None
    return slots


CASES = [(k, p) for k in ("plain", "swa") for p in (1, 2, 4)]


@pytest.mark.parametrize(("kind", "page_size"), CASES)
def test_nested_groups_flush_once_at_the_outermost_end(kind: str, page_size: int) -> None:
    a = make(kind, page_size)
    empty = sizes(a)
    outer, inner, after = alloc_seq(a, 4), alloc_seq(a, 4), alloc_seq(a, 4)
    held = sizes(a)
    a.free_group_begin()
    a.free(outer)  # queued before the inner group opens: must survive it
    a.free_group_begin()
    a.free(inner)
    a.free(inner[:1])  # the same page again: merged, not a double free
    a.free_group_end()
    assert sizes(a)[0] == held[0]  # the inner end flushes nothing
    a.free(after)
    a.free_group_end()
    assert sizes(a) == empty
    assert a.check_integrity()


@pytest.mark.parametrize("kind", ["plain", "swa"])
def test_unbalanced_end_raises_and_clear_closes_groups(kind: str) -> None:
    a = make(kind, 2)
    with pytest.raises(ValueError):
        a.free_group_end()
    a.free_group_begin()
    a.free_group_begin()
    a.clear()  # ends every open group: the next free is immediate
    empty = sizes(a)
    a.free(alloc_seq(a, 4))
    assert sizes(a) == empty
    with pytest.raises(ValueError):
        a.free_group_end()
    assert a.check_integrity()
