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

Locks. A lock full-locks the whole path root → node (never evicted) but SWA-locks
only its last ``W`` tokens rounded out to a page (never tombstoned): all a continuation
reads through SWA. The rest of the path may be tombstoned while the request runs::

    W = 3, P = 2      0         4         8       12 = end
    path             [0 1 2 3 | 4 5 6 7 8 9 10 11]      one node [4, 12) ...
    after the lock   [0 1 2 3 | 4 5 6 7 | 8 9 10 11]    ... split at floor_page(end - W)
    full lock        [#############################)
    SWA lock                             [#########)    stops early at a tombstone

``inc_lock_ref`` returns a :class:`SwaLock` token (positions on the path, which node
splits never move) that ``dec_lock_ref`` / ``dec_swa_lock_only`` need to release exactly
what was taken. Without a window the SWA lock is the whole path (nothing is tombstoned).

Scheduler contract (``node, lock``: the request's locked node and its token):

* **admit**: ``m = match_prefix(ids[:seq_len - 1])``; ``lock = inc_lock_ref(m.last_node)``
  before anything can evict. ``m.device_indices`` are tree-owned: never free them.
* **after prefill** (running, optional): ``m2 = cache_unfinished(ids[:kv_len], slots,
  swa_evicted_seqlen)``; if ``m2``: re-point ``req_to_token[:m2.num_tokens]``,
  ``lock2 = inc_lock_ref(m2.last_node)``, then ``dec_lock_ref(node, lock)``; from now on
  ``node, lock, prefix_len = m2.last_node, lock2, m2.num_tokens``.
* **window passed** (``kv_len - W >= prefix_len``: no later token reads a tree-owned
  position through SWA): ``lock = dec_swa_lock_only(node, lock)`` (idempotent).
* **finish**: ``insert(ids[:kv_len], slots, swa_evicted_seqlen)``, THEN
  ``dec_lock_ref(node, lock)`` (unlocking first could free a tombstoned prefix that
  insert then reads), then free ``slots[floor_page(kv_len):]`` (the caller's partial page).
* **retract** without caching: ``dec_lock_ref(node, lock)``, free ``slots[prefix_len:]``.
* Per-request window eviction (``free_swa``) must stay at or past the matched prefix
  (``frontier >= prefix_len``): tree nodes are tombstoned only by :meth:`evict`.

Tree invariants: ``full lock_ref >= swa_lock_ref >= 0``; a tombstone is never SWA-locked;
a tombstone leaf exists only while full-locked (a request's node after
``dec_swa_lock_only``) and is deleted when its last lock goes. LRU ages: a touch stamps
the path root → node with increasing times, so ancestors look older than their
descendants and SWA eviction tombstones the prefix far from the window first.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from kvcanary.memory.base import Allocator, PageAllocator, PrefixCache, WindowedAllocator
from kvcanary.memory.errors import raise_if_problems
from kvcanary.memory.radix_types import CachedSpan, MatchResult, RadixNode, SwaLock
from kvcanary.utils import ceil_page, floor_page

__all__ = ["CachedSpan", "MatchResult", "RadixCache", "RadixNode", "SwaLock"]


class _Freed:
    __slots__ = ("full", "swa", "full_slots", "swa_slots")

    def __init__(self) -> None:
        self.full = self.swa = 0
        self.full_slots: list[torch.Tensor] = []  # freed on both sides (mapping read at flush)
        self.swa_slots: list[torch.Tensor] = []  # SWA only (tombstoned nodes)


class RadixCache:
    def __init__(
        self,
        allocator: PageAllocator | WindowedAllocator,
        page_size: int,
        sliding_window: int | None = None,
    ):
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size={page_size}: must equal the allocator's page_size={allocator.page_size}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window}: must be >= 1 or None")
        self.allocator: Allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        # Window-aware (_swa_allocator set) only for a windowed allocator with a window;
        # otherwise a plain cache (an SWA allocator's SWA slots then follow the full ones).
        self._swa_allocator: WindowedAllocator | None = None
        if isinstance(allocator, WindowedAllocator):
            self._full_allocator: PageAllocator = allocator.full_attn_allocator
            if sliding_window is not None:
                self._swa_allocator = allocator
        else:
            self._full_allocator = allocator
        self.window: int | None = sliding_window if self._swa_allocator is not None else None
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
        """Full tokens held by locked nodes (never evicted)."""
        return self._protected

    def swa_evictable_size(self) -> int:
        """SWA tokens ``evict(0, n)`` can free: live nodes not SWA-locked (0 without a window)."""
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        """SWA tokens under SWA locks (never tombstoned): about one window per lock."""
        return self._swa_protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def num_tombstones(self) -> int:
        return self._num_tombstones

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor) -> MatchResult:
        """Longest usable cached prefix of ``token_ids`` (page-truncated, window-gated).

        Splits a node when the match ends inside it, so ``last_node`` covers exactly
        ``num_tokens``. Callers that need logits pass ``token_ids[:-1]`` (truncating the
        result instead could land where the window is not resident).
        """
        path = self._walk(self._page_key(token_ids))
        return self._take(path, self._usable_len(path))

    def _take(self, path: list[tuple[RadixNode, int]], num_tokens: int) -> MatchResult:
        """The first ``num_tokens`` of ``path`` (a node boundary or the path's end), touched."""
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
        window = self.window
        if window is None:  # nothing is tombstoned: all of it
            return sum(n for _, n in path)
        best = pos = 0
        tomb_end: int | None = None
        for node, n in path:
            if node.tombstone:
                tomb_end = pos + n
            pos += n
            if tomb_end is None or pos - tomb_end >= window:
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
            rec = self._recoverable_from(child, dup, max(pos, swa_start) - pos)
            if rec < n:
                if rec:
                    self._split(child, rec)  # the head stays a tombstone
                self._recover(child, incoming[rec:], freed)
            freed.full_slots.append(incoming[:rec][dup[:rec]])
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

    def cache_unfinished(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        slots: torch.Tensor,
        swa_evicted_seqlen: int = 0,
    ) -> MatchResult | None:
        """Cache a *running* request's computed whole pages; returns the prefix it adopts.

        The request then re-points ``req_to_token[:n] = result.device_indices``
        (``n = result.num_tokens = floor_page(len(token_ids))``; its duplicates there were
        freed), takes ``new_lock = inc_lock_ref(result.last_node)``, then releases
        ``dec_lock_ref(old_node, old_lock)`` (``last_node`` is ``old_node`` or a descendant:
        both tokens are positions on one path, so the pair stays exact whatever the new
        lock splits), and counts ``[0, n)`` as tree-owned from now on (window eviction
        skips it). ``slots[n:]`` stay its own. Not window-gated (the request holds its
        window); ``last_node`` is never a tombstone. ``None`` (nothing cached, nothing
        freed): the last whole page has no SWA slot or lies before ``swa_evicted_seqlen``.
        """
        num_keep = floor_page(len(token_ids), self.page_size)
        if num_keep == 0:
            return None
        ids, slots = token_ids[:num_keep], slots[:num_keep]
        if self._swa_allocator is not None:
            # The last page must become a live node: it needs SWA, and a tail left as
            # tombstones would be freed by insert under the running request.
            last_page = slots[num_keep - self.page_size :].to(self.device, torch.int64)
            mapping = self._swa_allocator.full_to_swa_index_mapping
            if ceil_page(swa_evicted_seqlen, self.page_size) >= num_keep or bool(
                (mapping[last_page] <= 0).any()
            ):
                return None
        self.insert(ids, slots, min(swa_evicted_seqlen, num_keep))
        return self._take(self._walk(self._page_key(ids)), num_keep)

    def _recoverable_from(self, node: RadixNode, dup: torch.Tensor, swa_offset: int) -> int:
        """Offset in tombstone ``node`` from which the caller's duplicates (all with SWA,
        i.e. at or past ``swa_offset``) run to its end; ``len(node.key)`` when none."""
        n = len(node.key)
        if self.window is None or not node.tombstone or swa_offset >= n:
            return n
        kept = torch.nonzero(~dup).reshape(-1)  # the tree's own slots (the caller's prefix)
        return max(swa_offset, int(kept[-1]) + 1 if kept.numel() else 0)

    def _check_swa_resident(self, key: list[int], value: torch.Tensor, swa_start: int) -> None:
        owned = torch.ones(len(key), dtype=torch.bool, device=self.device)
        path = self._walk(key)
        if path:
            tree = torch.cat([node.value[:n] for node, n in path])
            owned[: tree.numel()] = value[: tree.numel()] != tree
        owned[:swa_start] = False
        mapping = self._swa().full_to_swa_index_mapping
        if bool((mapping[value[owned]] <= 0).any()):
            raise ValueError(
                f"insert: own slots at or past swa_evicted_seqlen (page start {swa_start}) "
                "have no SWA slot; the caller freed more window than it reported"
            )

    def _recover(self, node: RadixNode, incoming: torch.Tensor, freed: _Freed) -> None:
        alloc = self._swa()
        swa = alloc.full_to_swa_index_mapping[incoming]
        alloc.set_full_to_swa_mapping(node.value, swa)
        alloc.set_full_to_swa_mapping(incoming, torch.zeros_like(swa))
        freed.full_slots.append(incoming)  # unmapped now: frees the full side only
        self._account(node, -1)
        node.tombstone = False
        self._account(node, +1)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: RadixNode) -> SwaLock:
        """Full-lock ``node`` and every ancestor; SWA-lock from ``node`` upward until
        ``[floor_page(path_len - W), path_len)`` is covered (splitting the node that
        straddles that start) or a tombstone is met. Keep the token for the release."""
        if node is not self.root and node.parent is None:
            raise ValueError("inc_lock_ref: node was evicted (lock right after match_prefix)")
        path_len = self._path_len(node)
        swa_target = 0
        if self.window is not None:
            swa_target = floor_page(max(0, path_len - self.window), self.page_size)
        swa_start = path_len
        for n, start in self._starts(node, path_len):
            if swa_start <= swa_target or n.tombstone:
                break
            if start < swa_target:
                self._split(n, swa_target - start)  # n keeps the tail [swa_target, swa_start)
                swa_start = swa_target
                break
            swa_start = start
        lock = SwaLock(path_len, swa_start)
        self._add_locks(node, lock, +1, full=True)
        return lock

    def dec_lock_ref(self, node: RadixNode, lock: SwaLock) -> None:
        """Release what ``inc_lock_ref(node)`` returned as ``lock`` (or what is left of it
        after :meth:`dec_swa_lock_only`). ``ValueError`` (nothing changed) if unbalanced."""
        self._check_held(node, lock)
        self._add_locks(node, lock, -1, full=True)
        if node.tombstone and not node.children and not node.lock_ref:
            freed = _Freed()  # a tombstone leaf outlives only its locks
            self._delete_leaf(node, freed)
            self._flush(freed)

    def dec_swa_lock_only(self, node: RadixNode, lock: SwaLock) -> SwaLock:
        """Release the SWA part of ``lock`` (the request no longer reads the tree's SWA);
        returns the token for the later :meth:`dec_lock_ref`. Idempotent."""
        self._check_held(node, lock)
        self._add_locks(node, lock, -1, full=False)
        return SwaLock(lock.path_len, lock.path_len)

    def _starts(self, node: RadixNode, path_len: int) -> Iterator[tuple[RadixNode, int]]:
        """(ancestor, position of its first token) from ``node`` up to the root."""
        for n in self._ancestors(node):
            path_len -= len(n.key)
            yield n, path_len

    def _add_locks(self, node: RadixNode, lock: SwaLock, delta: int, full: bool) -> None:
        for n, start in self._starts(node, lock.path_len):
            self._account(n, -1)
            n.lock_ref += delta if full else 0
            n.swa_lock_ref += delta if start >= lock.swa_start else 0
            self._account(n, +1)

    def _check_held(self, node: RadixNode, lock: SwaLock) -> None:
        """``ValueError`` unless ``lock`` can be a lock still held on ``node``."""
        path_len = self._path_len(node)
        if lock.path_len != path_len:
            raise ValueError(f"release: {lock} is not a lock on a path of {path_len} tokens")
        bounds = {path_len}
        for n, start in self._starts(node, path_len):
            bounds.add(start)
            if n.lock_ref <= 0 or (start >= lock.swa_start and n.swa_lock_ref <= 0):
                raise ValueError(f"release: unbalanced, node {n.node_id} is not locked ({lock})")
        if lock.swa_start not in bounds:
            raise ValueError(f"release: {lock} does not start its SWA lock on a node boundary")

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> tuple[int, int]:
        """Free at least the asked tokens where possible; returns ``(full, swa)`` freed.

        Full: LRU unlocked leaves, then parents that become unlocked leaves (unlocked
        tombstone parents go at once). SWA (window-aware only): LRU live nodes that are not
        SWA-locked; unlocked leaves are deleted (counted on both sides), the rest tombstoned
        with their full KV kept (internal nodes, and a locked leaf whose request released
        its SWA lock). ``evict(0)`` is always safe.
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
                self._entry(n) for n in self._iter_nodes() if not n.tombstone and not n.swa_lock_ref
            ]
            heapq.heapify(heap)
            while freed.swa < swa_num_tokens and heap:
                node = heapq.heappop(heap)[2]
                if node.parent is None:  # deleted by a cascade
                    continue
                if node.children or node.lock_ref:
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
        """Delete ``leaf`` and every unlocked tombstone ancestor left childless; returns the
        survivor."""
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
            if parent is self.root or parent.children or not parent.tombstone or parent.lock_ref:
                return parent
            node = parent

    def invalidate(self, slots: torch.Tensor) -> int:
        """Drop every unlocked node holding any of ``slots`` together with its subtree (KV
        computed on top of a corrupt prefix is suspect too), freeing their slots; returns the
        tokens dropped. Locked subtrees are left alone: their holders reference the slots and
        are aborted first by the caller."""
        bad = slots.reshape(-1).to(self.device, torch.int64)
        if bad.numel() == 0:
            return 0
        targets = [
            n for n in self._iter_nodes()
            if n is not self.root and bool(torch.isin(n.value, bad).any())
        ]  # fmt: skip
        freed, dropped = _Freed(), 0
        for top in targets:
            if top.parent is None:  # already dropped with an ancestor
                continue
            subtree, stack = [], [top]
            while stack:
                node = stack.pop()
                subtree.append(node)
                stack.extend(node.children.values())
            if any(n.lock_ref for n in subtree):
                continue
            for node in reversed(subtree):  # descendants first: each is a leaf when deleted
                if node.parent is not None:
                    dropped += len(node.key)
                    self._delete_leaf(node, freed)
        self._flush(freed)
        return dropped

    def _flush(self, freed: _Freed) -> None:
        # One free per side; SWA-only frees first so the mapping they zero is not read twice.
        if freed.swa_slots:
            self._swa().free_swa(torch.cat(freed.swa_slots))
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
    def _swa(self) -> WindowedAllocator:
        """The windowed allocator: only window-aware paths (``window`` set) get here."""
        if self._swa_allocator is None:
            raise RuntimeError("RadixCache: an SWA-only path ran on a cache without a window")
        return self._swa_allocator

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _page_key(self, token_ids: Sequence[int] | torch.Tensor) -> list[int]:
        ids: list[int] = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        return ids[: floor_page(len(ids), self.page_size)]

    def _child_key(self, key: list[int], start: int) -> int | tuple[int, ...]:
        return key[start] if self.page_size == 1 else tuple(key[start : start + self.page_size])

    def _common_len(self, key: list[int], start: int, node_key: list[int]) -> int:
        """Matching tokens of ``key[start:]`` and ``node_key``, whole pages only."""
        p, n, i = self.page_size, min(len(key) - start, len(node_key)), 0
        while i < n and key[start + i : start + i + p] == node_key[i : i + p]:
            i += p
        return i

    def _path_len(self, node: RadixNode) -> int:
        return sum(len(n.key) for n in self._ancestors(node))

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
        (its identity and path end, so locks taken on it stay valid); both halves keep
        its locks (a lock covers whole nodes of its path)."""
        parent = node.parent
        assert parent is not None
        self._account(node, -1)
        head = RadixNode(
            key=node.key[:num_tokens],
            value=node.value[:num_tokens],
            parent=parent,
            lock_ref=node.lock_ref,
            swa_lock_ref=node.swa_lock_ref,
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
        n, locked, swa_locked = len(node.key), node.lock_ref > 0, node.swa_lock_ref > 0
        swa = n if self.window is not None and not node.tombstone else 0
        return (
            0 if locked else n,
            n if locked else 0,
            0 if swa_locked else swa,
            swa if swa_locked else 0,
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
            if not node.lock_ref >= node.swa_lock_ref >= 0:
                problems.append(
                    f"node {node.node_id}: not lock_ref {node.lock_ref} >= "
                    f"swa_lock_ref {node.swa_lock_ref} >= 0"
                )
            if parent is not None and parent is not self.root and node.lock_ref > parent.lock_ref:
                problems.append(f"node {node.node_id}: locked more than its parent")
            if node.tombstone and node.swa_lock_ref:
                problems.append(f"node {node.node_id}: SWA-locked tombstone")
            if node.tombstone and not node.children and not node.lock_ref:
                problems.append(f"node {node.node_id}: unlocked tombstone leaf")
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
        if self._swa_allocator is not None:
            mapping = self._swa_allocator.full_to_swa_index_mapping
            for node in self._iter_nodes():
                m = mapping[node.value]
                if node.tombstone and bool((m != 0).any()):
                    problems.append(f"tombstone node {node.node_id} still mapped")
                if not node.tombstone and bool((m <= 0).any()):
                    problems.append(f"live node {node.node_id} has unmapped slots")
        return raise_if_problems("RadixCache", problems)


if TYPE_CHECKING:  # mypy: the contracts of kvcanary.memory.base hold
    _radix: type[PrefixCache] = RadixCache
