"""The contracts of kvcanary.memory.base, at run time.

mypy is the real conformance check (each concrete module assigns its classes to
``type[Protocol]`` under TYPE_CHECKING); these catch a member going missing at run time,
check the narrowing the code relies on, and hold a few invariants every allocator states.
They also pin the package's import shape: no import circle inside memory/, nothing
imported from kvcanary outside it but ``kvcanary.utils``, and no pool importing host_pool.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcanary.memory.allocator import PagedAllocator, TokenAllocator
from kvcanary.memory.base import (
    Allocator,
    KVPairPool,
    KVPool,
    PageAllocator,
    PrefixCache,
    WindowedAllocator,
)
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.errors import DoubleFreeError
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.radix_cache import RadixCache
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool

MEMORY = Path(__file__).resolve().parents[2] / "src" / "kvcanary" / "memory"


def swa_pair(page_size: int) -> tuple[SWAKVPool, SWAAllocator]:
    pool = SWAKVPool(32, 16, page_size, torch.float32, 1, 2, [1], [0])
    return pool, SWAAllocator(32, 16, page_size, kvcache=pool)


ALLOCATORS: dict[str, Callable[[], Allocator]] = {
    "token": lambda: TokenAllocator(16),
    "paged": lambda: PagedAllocator(32, 4),
    "swa-token": lambda: swa_pair(1)[1],
    "swa-paged": lambda: swa_pair(4)[1],
}


# ---------------------------------------------------------------- conformance
def test_allocators_narrow_by_protocol() -> None:
    for name, make in ALLOCATORS.items():
        alloc = make()
        assert isinstance(alloc, Allocator), name
        windowed = name.startswith("swa")
        assert isinstance(alloc, WindowedAllocator) == windowed, name
        assert isinstance(alloc, PageAllocator) == (not windowed), name
        if isinstance(alloc, WindowedAllocator):
            assert isinstance(alloc.full_attn_allocator, PageAllocator)
            assert isinstance(alloc.swa_attn_allocator, PageAllocator)


def test_pools_satisfy_their_protocols() -> None:
    mha = MHAKVPool(16, 4, torch.float32, 1, 2, 2)
    swa, _ = swa_pair(4)
    dsv4 = DSV4KVPool(16, 16, 4, [0, 4], 8, 4, torch.float32)
    for pool in (mha, swa, dsv4):
        assert isinstance(pool, KVPool), type(pool).__name__
    assert isinstance(mha, KVPairPool) and isinstance(swa, KVPairPool)
    assert not isinstance(dsv4, KVPairPool)  # latent KV: K only
    for pool in (mha, swa, dsv4):
        assert not hasattr(pool, "get_cpu_copy")  # host copies: kvcanary.memory.host_pool


def test_radix_cache_is_a_prefix_cache_and_window_follows_the_allocator() -> None:
    _, swa = swa_pair(4)
    assert isinstance(RadixCache(PagedAllocator(32, 4), 4), PrefixCache)
    assert RadixCache(swa, 4, sliding_window=8).window == 8
    assert RadixCache(swa, 4).window is None  # an SWA allocator without a window: plain
    assert RadixCache(PagedAllocator(32, 4), 4, sliding_window=8).window is None


# ---------------------------------------------------------------- invariants
@pytest.mark.parametrize("name", list(ALLOCATORS))
def test_allocator_invariants(name: str) -> None:
    alloc = ALLOCATORS[name]()
    p = alloc.page_size
    no_prefix = torch.full((1,), -1, dtype=torch.int64)
    taken = []
    while (out := alloc.alloc_extend([0], [p], no_prefix)) is not None:
        taken.append(out)
    slots = torch.cat(taken)
    assert alloc.available_size() == 0
    assert bool((slots >= p).all()), "the sink page was handed out"
    assert int(torch.unique(slots).numel()) == int(slots.numel())
    # A failed allocation mutates nothing.
    before = alloc.available_size()
    assert alloc.alloc_extend([0], [p], no_prefix) is None
    assert alloc.alloc_decode([1], no_prefix) is None
    assert alloc.available_size() == before
    assert alloc.check_integrity()
    alloc.free(taken[0])
    with pytest.raises(DoubleFreeError):
        alloc.free(taken[0])
    with pytest.raises(ValueError):
        alloc.free(torch.zeros(1, dtype=torch.int64))  # the sink
    assert alloc.check_integrity()
    if isinstance(alloc, WindowedAllocator):
        assert int(alloc.full_to_swa_index_mapping[-1]) == -1
        assert alloc.full_to_swa_index_mapping is alloc.mapping.tensor


# ---------------------------------------------------------------- import shape
def _imports(path: Path) -> set[str]:
    """Modules a file imports (``TYPE_CHECKING`` blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_memory_import_shape() -> None:
    files = {f"kvcanary.memory.{f.stem}": f for f in MEMORY.glob("*.py") if f.stem != "__init__"}
    graph = {}
    for mod, path in files.items():
        deps = {d for d in _imports(path) if d.startswith("kvcanary.")}
        outside = {d for d in deps if not d.startswith(("kvcanary.memory", "kvcanary.utils"))}
        assert not outside, f"{mod} imports {sorted(outside)} from outside memory/"
        graph[mod] = {d for d in deps if d in files and d != mod}
    for mod in ("mha_pool", "swa_pool", "dsv4_pool"):
        assert "kvcanary.memory.host_pool" not in graph[f"kvcanary.memory.{mod}"], mod

    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*stack, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
