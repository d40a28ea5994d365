"""RadixCache: the prefix cache (policy) over a token allocator, window-aware for SWA pools.

Keys are token ids, values are full-pool slot ids (int64). With ``page_size = P > 1``
keys are truncated to whole pages and nodes split only on page boundaries, so every
node owns whole pages (frees are page granular).

Window awareness (``SWAAllocator`` + ``sliding_window = W``): a node whose SWA slots
were freed is a **tombstone** (mapping 0, full KV kept). A match is usable up to a
point ``x`` only if the path ``[0, x)`` has no tombstone, or at least ``W`` resident
tokens follow the last tombstone (the window a continuation attends to)::

    path    [1 2 3 | 4 5 | 60 70]        W = 4
            tomb    live   live          match [1..5]       -> 0 (2 live < W)
                                         match [1..5,60,70] -> 7 (4 live >= W)

Ownership contract (what the scheduler does):

* ``match_prefix`` hands out tree-owned slots. Lock ``last_node`` (``inc_lock_ref``)
  before anything can evict; never free those slots.
* A request **finishes**: ``insert(ids, slots, req.swa_evicted_seqlen)`` with every
  token whose KV is written, then ``dec_lock_ref(req.last_node)``, then free
  ``slots[floor_page(len(ids)):]`` (the partial last page, which stays the caller's).
* A request is **retracted** without caching: ``dec_lock_ref(req.last_node)`` and
  free ``slots[prefix_len:]`` (its own slots; the matched prefix is the tree's).
* Per-request window eviction (``free_swa``) must stay at or past the matched prefix
  (``frontier >= prefix_len``): tree nodes are tombstoned only by :meth:`evict`.
* Chunked prefill needs no insert: the request keeps its own slots and its lock until
  it finishes (caching mid-prefill would free its duplicates under it).

Locks protect the whole path to the root, for full and SWA alike (a locked path is
never evicted nor tombstoned; SWA-locking only the last ``W`` tokens would free more
SWA and is not done). LRU ages: a touch stamps the path root → node with increasing
times, so ancestors look older than their descendants and SWA eviction tombstones the
prefix far from the window first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvcanary.memory.allocator import PagedAllocator
from kvcanary.memory.errors import raise_if_problems
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.utils import ceil_page, floor_page

_node_ids = itertools.count()


@dataclass(slots=True, eq=False)
class RadixNode:
    key: list[int]
    value: torch.Tensor  # full slots, one per key token
    parent: RadixNode | None = field(default=None, repr=False)
    children: dict[int | tuple[int, ...], RadixNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    tombstone: bool = False  # SWA slots freed (mapping 0); full slots still valid
    last_access: int = 0
    node_id: int = field(default_factory=lambda: next(_node_ids))


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # full slots of the usable prefix (tree-owned)
    last_node: RadixNode  # lock this; the root when nothing matched
    num_tokens: int


class CachedSpan(NamedTuple):
    node: RadixNode
    prefix_len: int  # tokens on the path before this node: slot i sits at position prefix_len + i
    slots: torch.Tensor


class _Freed:
    __slots__ = ("full", "swa", "full_slots", "swa_slots")

    def __init__(self) -> None:
        self.full = self.swa = 0
        self.full_slots: list[torch.Tensor] = []  # freed on both sides (mapping read at flush)
        self.swa_slots: list[torch.Tensor] = []  # SWA only (tombstoned nodes)


class RadixCache:
    def __init__(
        self,
        allocator: PagedAllocator | SWAAllocator,
        page_size: int,
        sliding_window: int | None = None,
    ):
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size={page_size}: must equal the allocator's page_size={allocator.page_size}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window}: must be >= 1 or None")
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._full_allocator: PagedAllocator = (
            allocator.full_attn_allocator if isinstance(allocator, SWAAllocator) else allocator
        )
        # None: plain cache (an SWAAllocator's SWA slots then simply follow the full ones).
        self.window: int | None = sliding_window if isinstance(allocator, SWAAllocator) else None
        self._clock = 0
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Empty the tree WITHOUT freeing: the caller clears the allocator too."""
        self.root = RadixNode(key=[], value=self._empty())
        self._evictable = self._protected = 0
        self._swa_evictable = self._swa_protected = 0
        self._num_tombstones = 0

    def free_all(self) -> None:
        """Free every slot the tree holds and empty it; no node may be locked."""
        if self._protected:
            raise ValueError(f"free_all: {self._protected} tokens are still locked")
        self.allocator.free(self.all_values())
        self.reset()

    def evictable_size(self) -> int:
        """Full tokens held by unlocked nodes (tombstones included)."""
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def swa_evictable_size(self) -> int:
        """SWA tokens ``evict(0, n)`` can free: unlocked non-tombstones (0 when not window-aware)."""
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        return self._swa_protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def num_tombstones(self) -> int:
        return self._num_tombstones

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor) -> MatchResult:
        """Longest usable cached prefix of ``token_ids`` (page-truncated, window-gated).

        Splits a node when the match ends inside it, so ``last_node`` covers exactly
        ``num_tokens``. Callers that need logits pass ``token_ids[:-1]``.
        """
        key = self._page_key(token_ids)
        path = self._walk(key)
        num_tokens = self._usable_len(path)
        node, pos, values = self.root, 0, []
        for child, n in path:
            if pos == num_tokens:
                break
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, pos = child, pos + n
        self._touch(node)
        return MatchResult(torch.cat(values) if values else self._empty(), node, num_tokens)

    def _walk(self, key: list[int]) -> list[tuple[RadixNode, int]]:
        """(node, tokens of it matched) along ``key``; read-only."""
        path: list[tuple[RadixNode, int]] = []
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common_len(key, pos, child.key)
            path.append((child, n))
            pos += n
            if n < len(child.key):
                break
            node = child
        return path

    def _usable_len(self, path: list[tuple[RadixNode, int]]) -> int:
        """Largest matched length whose window is resident (see the module diagram)."""
        best = pos = 0
        tomb_end: int | None = None
        for node, n in path:
            if node.tombstone and self.window is not None:
                tomb_end = pos + n
            pos += n
            if tomb_end is None or pos - tomb_end >= self.window:  # type: ignore[operator]
                best = pos
        return best

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        slots: torch.Tensor,
        swa_evicted_seqlen: int = 0,
    ) -> int:
        """Cache ``token_ids`` → ``slots``; returns how many leading tokens were already cached.

        Ownership: with ``L = floor_page(len(token_ids))`` the tree takes ``slots[:L]``.
        Each is kept, is the tree's own slot already (handed out by ``match_prefix``,
        recognised by identity), or is a duplicate that insert frees. ``slots[L:]``
        stay the caller's. Nothing is mutated when a ``ValueError`` is raised.

        ``swa_evicted_seqlen``: leading tokens whose SWA the caller already freed (rounded
        up to a page). Own slots from there on must still be mapped (else ``ValueError``);
        own slots before it become tombstones (any SWA left there is freed). A tombstone
        only trailing the insert would be a leaf, so its slots are freed instead.

        Tombstone recovery: where the tree has a tombstone and the caller's duplicate
        still has SWA, the tree keeps its full slots and takes the caller's SWA slots
        (mapping re-pointed), then frees the duplicates' full slots only.
        """
        key = self._page_key(token_ids)
        num_keep = len(key)
        if slots.numel() != len(token_ids):
            raise ValueError(f"insert: {slots.numel()} slots for {len(token_ids)} tokens")
        if not 0 <= swa_evicted_seqlen <= len(token_ids):
            raise ValueError(
                f"insert: swa_evicted_seqlen={swa_evicted_seqlen} not in [0, {len(token_ids)}]"
            )
        if self.window is None and swa_evicted_seqlen:
            raise ValueError("insert: swa_evicted_seqlen needs a window-aware cache")
        # A copy: the caller's tensor (often a req_to_token row) is reused after this.
        value = slots[:num_keep].to(self.device, torch.int64, copy=True)
        swa_start = min(ceil_page(swa_evicted_seqlen, self.page_size), num_keep)
        if self.window is not None:
            self._check_swa_resident(key, value, swa_start)

        freed = _Freed()
        node, pos = self.root, 0
        while pos < num_keep:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common_len(key, pos, child.key)
            if n < len(child.key):
                child = self._split(child, n)
            incoming = value[pos : pos + n]
            dup = incoming != child.value
            rec = max(pos, swa_start) - pos  # first offset the caller still has SWA for
            if self.window is not None and child.tombstone and rec < n and bool(dup[rec:].all()):
                if rec:
                    self._split(child, rec)  # the head stays a tombstone
                    freed.full_slots.append(incoming[:rec][dup[:rec]])
                self._recover(child, incoming[rec:], freed)
            else:
                freed.full_slots.append(incoming[dup])
            node, pos = child, pos + n
        num_cached = pos

        if pos < num_keep:
            live_start = max(pos, swa_start)
            if live_start == num_keep:
                freed.full_slots.append(value[pos:])
            else:
                if live_start > pos:
                    node = self._add_child(node, key[pos:live_start], value[pos:live_start], True)
                    freed.swa_slots.append(value[pos:live_start])
                node = self._add_child(node, key[live_start:], value[live_start:], False)
        self._flush(freed)
        self._touch(node)
        return num_cached

    def _check_swa_resident(self, key: list[int], value: torch.Tensor, swa_start: int) -> None:
        owned = torch.ones(len(key), dtype=torch.bool, device=self.device)
        path = self._walk(key)
        if path:
            tree = torch.cat([node.value[:n] for node, n in path])
            owned[: tree.numel()] = value[: tree.numel()] != tree
        owned[:swa_start] = False
        mapping = self.allocator.full_to_swa_index_mapping  # type: ignore[union-attr]
        if bool((mapping[value[owned]] <= 0).any()):
            raise ValueError(
                f"insert: own slots at or past swa_evicted_seqlen (page start {swa_start}) "
                "have no SWA slot; the caller freed more window than it reported"
            )

    def _recover(self, node: RadixNode, incoming: torch.Tensor, freed: _Freed) -> None:
        alloc: SWAAllocator = self.allocator  # type: ignore[assignment]
        swa = alloc.full_to_swa_index_mapping[incoming]
        alloc.set_full_to_swa_mapping(node.value, swa)
        alloc.set_full_to_swa_mapping(incoming, torch.zeros_like(swa))
        freed.full_slots.append(incoming)  # unmapped now: frees the full side only
        self._account(node, -1)
        node.tombstone = False
        self._account(node, +1)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: RadixNode) -> None:
        """Protect ``node`` and every ancestor from eviction and tombstoning."""
        if node is not self.root and node.parent is None:
            raise ValueError("inc_lock_ref: node was evicted (lock right after match_prefix)")
        for n in self._ancestors(node):
            self._account(n, -1)
            n.lock_ref += 1
            self._account(n, +1)

    def dec_lock_ref(self, node: RadixNode) -> None:
        chain = list(self._ancestors(node))
        if any(n.lock_ref <= 0 for n in chain):
            raise ValueError("dec_lock_ref: unbalanced (a node on the path is not locked)")
        for n in chain:
            self._account(n, -1)
            n.lock_ref -= 1
            self._account(n, +1)

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> tuple[int, int]:
        """Free at least the asked tokens where possible; returns ``(full, swa)`` freed.

        Full: LRU unlocked leaves, then parents that become unlocked leaves (tombstone
        parents go at once: leaves are never tombstones). SWA (window-aware only): LRU
        unlocked non-tombstones, internal ones tombstoned (full KV kept), leaves deleted.
        Deleting a live leaf counts on both sides. ``evict(0)`` is always safe.
        """
        freed = _Freed()
        if num_tokens > 0:
            heap = [self._entry(n) for n in self._iter_nodes() if not n.children and not n.lock_ref]
            heapq.heapify(heap)
            while freed.full < num_tokens and heap:
                leaf = heapq.heappop(heap)[2]
                parent = self._delete_leaf(leaf, freed)
                if parent is not self.root and not parent.children and not parent.lock_ref:
                    heapq.heappush(heap, self._entry(parent))
        if self.window is not None and swa_num_tokens > 0:
            heap = [
                self._entry(n) for n in self._iter_nodes() if not n.tombstone and not n.lock_ref
            ]
            heapq.heapify(heap)
            while freed.swa < swa_num_tokens and heap:
                node = heapq.heappop(heap)[2]
                if node.parent is None:  # deleted by a cascade
                    continue
                if node.children:
                    freed.swa_slots.append(node.value)
                    freed.swa += len(node.key)
                    self._account(node, -1)
                    node.tombstone = True
                    self._account(node, +1)
                else:
                    self._delete_leaf(node, freed)
        self._flush(freed)
        return freed.full, freed.swa

    def _delete_leaf(self, leaf: RadixNode, freed: _Freed) -> RadixNode:
        """Delete ``leaf`` and every tombstone ancestor left childless; returns the survivor."""
        node = leaf
        while True:
            parent = node.parent
            assert parent is not None
            freed.full_slots.append(node.value)
            freed.full += len(node.key)
            if not node.tombstone and self.window is not None:
                freed.swa += len(node.key)
            self._account(node, -1)
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            if parent is self.root or parent.children or not parent.tombstone:
                return parent
            node = parent

    def _flush(self, freed: _Freed) -> None:
        # One free per side; SWA-only frees first so the mapping they zero is not read twice.
        if freed.swa_slots:
            self.allocator.free_swa(torch.cat(freed.swa_slots))  # type: ignore[union-attr]
        if freed.full_slots:
            self.allocator.free(torch.cat(freed.full_slots))

    # ------------------------------------------------------------------ walk
    def _iter_nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def iter_cached(self) -> Iterator[CachedSpan]:
        """DFS (pre-order) over every cached node with the position of its first token."""
        stack = [(c, 0) for c in self.root.children.values()]
        while stack:
            node, prefix_len = stack.pop()
            yield CachedSpan(node, prefix_len, node.value)  # tree-owned: read only
            stack.extend((c, prefix_len + len(node.key)) for c in node.children.values())

    def all_values(self) -> torch.Tensor:
        """Every full slot the tree holds (tombstones included)."""
        values = [n.value for n in self._iter_nodes()]
        return torch.cat(values) if values else self._empty()

    # ------------------------------------------------------------------ helpers
    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _page_key(self, token_ids: Sequence[int] | torch.Tensor) -> list[int]:
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        return ids[: floor_page(len(ids), self.page_size)]

    def _child_key(self, key: list[int], start: int) -> int | tuple[int, ...]:
        return key[start] if self.page_size == 1 else tuple(key[start : start + self.page_size])

    def _common_len(self, key: list[int], start: int, node_key: list[int]) -> int:
        """Matching tokens of ``key[start:]`` and ``node_key``, whole pages only."""
        p, n, i = self.page_size, min(len(key) - start, len(node_key)), 0
        while i < n and key[start + i : start + i + p] == node_key[i : i + p]:
            i += p
        return i

    def _ancestors(self, node: RadixNode) -> Iterator[RadixNode]:
        while node is not self.root:
            yield node
            assert node.parent is not None
            node = node.parent

    def _touch(self, node: RadixNode) -> None:
        for n in reversed(list(self._ancestors(node))):
            self._clock += 1
            n.last_access = self._clock

    @staticmethod
    def _entry(node: RadixNode) -> tuple[int, int, RadixNode]:
        return node.last_access, node.node_id, node

    def _add_child(
        self, parent: RadixNode, key: list[int], value: torch.Tensor, tombstone: bool
    ) -> RadixNode:
        node = RadixNode(key=key, value=value, parent=parent, tombstone=tombstone)
        parent.children[self._child_key(key, 0)] = node
        self._account(node, +1)
        return node

    def _split(self, node: RadixNode, num_tokens: int) -> RadixNode:
        """Cut ``node`` after ``num_tokens``; returns the new head. ``node`` keeps the tail
        (and its identity, so locks taken on it stay balanced)."""
        parent = node.parent
        assert parent is not None
        self._account(node, -1)
        head = RadixNode(
            key=node.key[:num_tokens],
            value=node.value[:num_tokens],
            parent=parent,
            lock_ref=node.lock_ref,
            tombstone=node.tombstone,
            last_access=node.last_access,
        )
        parent.children[self._child_key(head.key, 0)] = head
        node.key, node.value, node.parent = node.key[num_tokens:], node.value[num_tokens:], head
        head.children[self._child_key(node.key, 0)] = node
        self._account(head, +1)
        self._account(node, +1)
        return head

    def _contribution(self, node: RadixNode) -> tuple[int, int, int, int, int]:
        """(evictable, protected, swa_evictable, swa_protected, tombstones) of one node."""
        n, locked = len(node.key), node.lock_ref > 0
        swa = n if self.window is not None and not node.tombstone else 0
        return (
            0 if locked else n,
            n if locked else 0,
            0 if locked else swa,
            swa if locked else 0,
            int(node.tombstone),
        )

    def _account(self, node: RadixNode, sign: int) -> None:
        ev, pr, sev, spr, tomb = self._contribution(node)
        self._evictable += sign * ev
        self._protected += sign * pr
        self._swa_evictable += sign * sev
        self._swa_protected += sign * spr
        self._num_tombstones += sign * tomb

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> bool:
        problems: list[str] = []
        totals = [0, 0, 0, 0, 0]
        p = self.page_size
        for node in self._iter_nodes():
            totals = [t + c for t, c in zip(totals, self._contribution(node), strict=True)]
            parent = node.parent
            if parent is None or parent.children.get(self._child_key(node.key, 0)) is not node:
                problems.append(f"node {node.node_id}: parent link broken")
            if not node.key or len(node.key) % p or node.value.numel() != len(node.key):
                problems.append(f"node {node.node_id}: key/value not whole non-empty pages")
            elif p > 1:
                pages = node.value.view(-1, p)
                offsets = torch.arange(p, device=pages.device)
                if bool((pages[:, 0] % p != 0).any()) or bool(
                    (pages != pages[:, :1] + offsets).any()
                ):
                    problems.append(f"node {node.node_id}: value is not whole allocator pages")
            if node.lock_ref < 0:
                problems.append(f"node {node.node_id}: lock_ref {node.lock_ref} < 0")
            if parent is not None and parent is not self.root and node.lock_ref > parent.lock_ref:
                problems.append(f"node {node.node_id}: locked more than its parent")
            if node.tombstone and not node.children:
                problems.append(f"node {node.node_id}: tombstone leaf")
        counted = (
            self._evictable,
            self._protected,
            self._swa_evictable,
            self._swa_protected,
            self._num_tombstones,
        )
        if tuple(totals) != counted:
            problems.append(f"counters {counted} != recount {tuple(totals)}")
        values = self.all_values()
        if int(torch.unique(values).numel()) != int(values.numel()):
            problems.append("a slot is held by two nodes")
        if values.numel() and not bool(self._full_allocator.page_allocated[values // p].all()):
            problems.append("the tree holds a free slot")
        if self.window is not None:
            mapping = self.allocator.full_to_swa_index_mapping  # type: ignore[union-attr]
            for node in self._iter_nodes():
                m = mapping[node.value]
                if node.tombstone and bool((m != 0).any()):
                    problems.append(f"tombstone node {node.node_id} still mapped")
                if not node.tombstone and bool((m <= 0).any()):
                    problems.append(f"live node {node.node_id} has unmapped slots")
        return raise_if_problems("RadixCache", problems)
