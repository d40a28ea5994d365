"""The memory system's contracts, as protocols the concrete classes satisfy structurally.

::

    KVPool            storage, per layer, addressed by full-pool slot ids
      KVPairPool        ... with a K and a V buffer per layer        MHAKVPool, SWAKVPool
      WindowedKVPool    ... whose SWA side reads through the mapping SWAKVPool, DSV4KVPool
    Allocator         which slots are live (ids only, no storage)
      PageAllocator     ... over one pool's page table               PagedAllocator, TokenAllocator
      WindowedAllocator ... over a full + an SWA pool, mapped        SWAAllocator
    PrefixCache       shared prefixes over an allocator              RadixCache

Narrow with ``isinstance`` against these (``isinstance(alloc, WindowedAllocator)``) rather
than with ``hasattr``. Every one but :class:`WindowedKVPool` is ``runtime_checkable`` (on
Python 3.11 such a check reads every member, and that pool's mapping property raises
before an allocator registered one); a runtime check only sees that the members exist,
mypy checks their types. Each concrete module asserts, under ``TYPE_CHECKING``, that its
classes satisfy their contracts, so mypy fails where a class stops satisfying one.

Slot ids everywhere are *full-pool* slot ids ``[0, size + page_size)``. Page 0, slots
``[0, page_size)``, is the reserved sink: padded writes land there, nothing reads them,
no allocator hands it out or accepts it back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

import torch

if TYPE_CHECKING:
    import numpy as np

    from kvcanary.memory.radix_types import CachedSpan, MatchResult, RadixNode, SwaLock
    from kvcanary.memory.swa_mapping import SwaIndexMapping

# (data_ptrs, data_lens, item_lens): page ``p`` of buffer ``i`` starts at
# ``data_ptrs[i] + p * item_lens[i]``; ``item_lens[i]`` = bytes of one page of buffer ``i``.
BufInfos: TypeAlias = tuple[list[int], list[int], list[int]]
# Per-request lengths: a sequence of ints or a 1-D integer tensor (read on the CPU).
Lens: TypeAlias = Sequence[int] | torch.Tensor

# The host CPU. Host-only fast paths (numpy views, Python lists instead of torch ops on a
# few elements) compare a device with this exactly: "cpu:0" counts as another device, the
# stand-in accelerator of the device-mixing tests, and keeps the torch paths.
HOST = torch.device("cpu")


# ---------------------------------------------------------------------- pools
def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` with an accelerator's index filled in (``cuda`` -> ``cuda:0``, the current
    one): tensors made on ``cuda`` live on ``cuda:0``, and ``torch.device`` compares the
    index, so buffers checked against an index-less device never matched."""
    dev = torch.device(device)
    if dev.index is None and dev.type not in ("cpu", "meta"):
        return torch.empty(0, device=dev).device
    return dev


@runtime_checkable
class KVPool(Protocol):
    """Per-layer KV storage of one token pool (:class:`~kvcanary.memory.mha_pool.MHAKVPool`,
    :class:`~kvcanary.memory.swa_pool.SWAKVPool`, :class:`~kvcanary.memory.dsv4_pool.DSV4KVPool`).

    Invariants:

    * Storage only: a pool never decides which slots are live (that is the
      :class:`Allocator`'s business) and never frees or allocates.
    * Callers always speak full-pool slot ids; the sink page ``[0, page_size)`` exists in
      every buffer (an SWA side keeps its own sink page, which unmapped slots translate to).
    * Buffers are allocated once, in the constructor, and never reallocated, so the
      pointers of :meth:`get_contiguous_buf_infos` / :meth:`get_state_buf_infos` stay
      valid for the pool's life.
    * ``forward_epoch`` grows by exactly one per :meth:`begin_forward` (called at the start
      of every model forward / graph replay); per-forward caches are keyed on it.
    * :meth:`invalidate_loc_cache` is safe at any time and changes nothing but cost.
    * Per-slot sidecars (``register_slot_buffer``) are registered on the MHA (sub-)pools,
      not on composite pools; host copies (:mod:`~kvcanary.memory.host_pool`) carry them.
    """

    @property
    def size(self) -> int:
        """Full-pool token slots, the sink page excluded."""
        ...

    @property
    def page_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def forward_epoch(self) -> int: ...

    def begin_forward(self) -> None: ...

    def invalidate_loc_cache(self) -> None: ...

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s key buffer, rows indexed by the slot space that layer is
        stored in (full slots; SWA slots on the sliding layers of a windowed pool)."""
        ...

    def get_contiguous_buf_infos(self) -> BufInfos:
        """The full-slot-indexed transfer channel ("KV"): one item = one full page."""
        ...

    def get_state_buf_infos(self) -> BufInfos:
        """The SWA-slot-indexed transfer channel ("state"); empty lists when there is none."""
        ...


@runtime_checkable
class KVPairPool(KVPool, Protocol):
    """A pool with a K and a V buffer per layer (MHAKVPool, SWAKVPool).

    ``set_kv_buffer(layer, loc, k, v)`` writes row ``loc[i]`` of both buffers from ``k[i]``,
    ``v[i]`` (cast to the pool dtype); ``loc`` are full slots (an SWA layer writes at their
    translation, so an unmapped slot lands in the SWA sink). ``move_kv_cache`` copies rows
    ``src_loc`` to ``tgt_loc`` on every layer.
    """

    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None: ...

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(bytes of all K buffers, bytes of all V buffers)."""
        ...


class WindowedKVPool(KVPool, Protocol):
    """A pool whose sliding-window storage is addressed through the allocator-owned
    full→SWA mapping (SWAKVPool, DSV4KVPool). Not ``runtime_checkable``: narrow with
    ``isinstance(pool, BaseSWAKVPool)``.

    Invariants:

    * The mapping is the allocator's :class:`~kvcanary.memory.swa_mapping.SwaIndexMapping`,
      adopted once by :meth:`register_mapping` (``SWAAllocator(..., kvcache=pool)``);
      before that ``full_to_swa_index_mapping`` raises ``RuntimeError`` and
      ``mapping_version`` is -1.
    * :meth:`translate_loc_from_full_to_swa` is ``mapping[loc]``: a live slot's SWA slot,
      0 (the SWA sink) for an unmapped one, -1 for -1. It is memoised for at most one
      forward: a hit needs the same view of ``loc``, an unmutated mapping (same
      ``mapping_version``) and the same ``forward_epoch``; ``translation_stats`` counts
      ``hits``, ``misses`` and ``gathers``.
    """

    @property
    def size_swa(self) -> int: ...

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor: ...

    @property
    def mapping_version(self) -> int: ...

    @property
    def translation_stats(self) -> dict[str, int]: ...

    def register_mapping(self, mapping: SwaIndexMapping) -> None: ...

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------- allocators
@runtime_checkable
class Allocator(Protocol):
    """Hands out full-pool slot ids for one pool (or a full + SWA pair); stores nothing.

    Invariants:

    * Page 0 (the sink) is never handed out nor taken back: freeing one of its slots
      raises ``ValueError``.
    * An allocation that cannot be satisfied returns ``None`` and mutates nothing, so a
      caller may evict and retry; malformed arguments raise ``ValueError``.
    * Slots are page-aligned with positions: position ``p`` sits at offset
      ``p % page_size`` of its page, and a partially filled last page is continued in
      place (``last_loc + 1``) before new pages are taken. ``last_locs[i] = -1`` means an
      empty prefix.
    * :meth:`alloc_extend` returns the slots of positions ``[prefix_len, seq_len)`` of
      each request, flat in batch order; :meth:`alloc_decode` one slot per request, for
      position ``seq_len - 1``; :meth:`alloc` ``num_tokens`` fresh slots (a multiple of
      ``page_size``; an SWA pair allows it only with ``page_size = 1``).
    * :meth:`free` is page granular (any slot frees its whole page) and raises
      :class:`~kvcanary.memory.errors.DoubleFreeError` on a page that is already free.
      Between :meth:`free_group_begin` and :meth:`free_group_end` frees are queued and
      merged (duplicates allowed); groups nest and only the outermost end frees.
    * :meth:`quarantine` takes the pages of ``slots`` out of circulation for good (free
      ones at once, allocated ones when freed) and returns how many were newly taken.
    * :meth:`clear` forgets every allocation (and ends any open free group).
    * :meth:`check_integrity` returns True or raises
      :class:`~kvcanary.memory.errors.IntegrityError` naming every broken invariant.
    """

    @property
    def size(self) -> int:
        """Token slots that can be live at once (the sink page excluded)."""
        ...

    @property
    def page_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def available_size(self) -> int:
        """Free token slots (whole free pages × page_size)."""
        ...

    def alloc(self, num_tokens: int) -> torch.Tensor | None: ...

    def alloc_extend(
        self, prefix_lens: Lens, seq_lens: Lens, last_locs: torch.Tensor
    ) -> torch.Tensor | None: ...

    def alloc_decode(self, seq_lens: Lens, last_locs: torch.Tensor) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor) -> None: ...

    def free_group_begin(self) -> None: ...

    def free_group_end(self) -> None: ...

    def quarantine(self, slots: torch.Tensor) -> int: ...

    def clear(self) -> None: ...

    def check_integrity(self) -> bool: ...


@runtime_checkable
class PageAllocator(Allocator, Protocol):
    """An allocator over one pool's page table (PagedAllocator; TokenAllocator is
    ``page_size = 1``).

    Invariants: pages are ``[1, num_pages]``; ``page_allocated[0]`` is always False;
    the free list holds no page twice and no quarantined page; free + allocated +
    quarantined-but-not-allocated pages = ``num_pages``. ``num_new_pages_extend`` /
    ``num_new_pages_decode`` say, without allocating, how many pages the matching
    ``alloc_*`` call would take.
    """

    @property
    def num_pages(self) -> int: ...

    @property
    def page_allocated(self) -> torch.Tensor:
        """bool ``[num_pages + 1]``: page ``p`` is handed out."""
        ...

    @property
    def page_quarantined(self) -> torch.Tensor:
        """bool ``[num_pages + 1]``: page ``p`` is never handed out again."""
        ...

    def num_free_pages(self) -> int: ...

    def num_used_pages(self) -> int: ...

    def num_quarantined_pages(self) -> int: ...

    def num_new_pages_extend(self, prefix_lens: Lens, seq_lens: Lens) -> int: ...

    def num_new_pages_decode(self, seq_lens: Lens) -> int: ...


@runtime_checkable
class WindowedAllocator(Allocator, Protocol):
    """Lockstep allocation in a full and a sliding-window (SWA) pool (SWAAllocator). The
    ids it hands out and takes back are full slots; the SWA side is reached through
    ``mapping`` (see :mod:`~kvcanary.memory.swa_mapping`).

    Invariants:

    * ``full_to_swa_index_mapping`` is ``mapping.tensor``: ``size_full + page_size + 1``
      entries, the last one the sentinel -1, mutated in place only, never reallocated;
      every write bumps ``mapping.version``.
    * Every live SWA slot is referenced by exactly one full slot; the full sink page and
      every free full slot map to 0.
    * Every ``alloc*`` checks both pools' capacity before mutating anything and returns
      ``None`` when either is short. :meth:`alloc_extend_swa_tail` maps only the last
      ``swa_tail_len`` new slots (zeroing the rest: recycled pages may carry a previous
      owner's mapping).
    * :meth:`free` frees the full slots' pages and their SWA slots; :meth:`free_swa`
      frees only the SWA slots of whole full pages and unmaps them, and is safe to repeat.
    * :meth:`quarantine` quarantines full pages only; :meth:`quarantine_swa` takes SWA
      slot ids.
    * ``available_size()`` is the smaller of :meth:`full_available_size` and
      :meth:`swa_available_size`; ``size`` the smaller of ``size_full`` and ``size_swa``.
    """

    @property
    def mapping(self) -> SwaIndexMapping: ...

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor: ...

    @property
    def full_attn_allocator(self) -> PageAllocator: ...

    @property
    def swa_attn_allocator(self) -> PageAllocator: ...

    @property
    def size_full(self) -> int: ...

    @property
    def size_swa(self) -> int: ...

    def full_available_size(self) -> int: ...

    def swa_available_size(self) -> int: ...

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool: ...

    def translate_last_locs(self, last_locs: torch.Tensor) -> torch.Tensor:
        """Full → SWA for ``last_loc`` arguments (-1 stays -1 through the sentinel)."""
        ...

    def alloc_extend_swa_tail(
        self, prefix_len: int, seq_len: int, last_loc: torch.Tensor | int, swa_tail_len: int
    ) -> torch.Tensor | None: ...

    def free_swa(self, full_slots: torch.Tensor) -> None: ...

    def free_swa_rows(self, table: np.ndarray, spans: np.ndarray) -> int:
        """:meth:`free_swa` of the full slots ``table[row, a:b]`` of each ``(row, a, b)`` in
        ``spans`` (int64 ``[n, 3]``; ``table``: a host req->token table, the mapping on the
        host); returns how many of those slots were mapped before."""
        ...

    def set_full_to_swa_mapping(
        self, full_slots: torch.Tensor, swa_slots: torch.Tensor
    ) -> None: ...

    def quarantine_swa(self, swa_slots: torch.Tensor) -> int: ...


# ---------------------------------------------------------------------- prefix cache
@runtime_checkable
class PrefixCache(Protocol):
    """Shared prefixes over an allocator (RadixCache): token ids → full slots.

    Invariants (the scheduler contract in :mod:`~kvcanary.memory.radix_cache` has the
    call order):

    * Keys are truncated to whole pages and every node owns whole allocator pages; the
      tree owns the slots it holds: what :meth:`match_prefix` returns must never be freed
      by the caller.
    * :meth:`insert` takes ``slots[:floor_page(len)]`` (keeping them, recognising its own,
      or freeing duplicates) and leaves the rest to the caller; it returns how many
      leading tokens were already cached. A ``ValueError`` from it mutates nothing.
    * A locked node is never evicted; an SWA-locked node is never tombstoned; per node
      ``lock_ref >= swa_lock_ref >= 0``. :meth:`inc_lock_ref` returns the
      :class:`~kvcanary.memory.radix_types.SwaLock` that :meth:`dec_lock_ref` /
      :meth:`dec_swa_lock_only` need; an unbalanced release raises ``ValueError`` and
      changes nothing.
    * :meth:`match_prefix` is window-gated when the cache has a window (``window`` not
      None): a usable prefix has no tombstone within the last ``window`` tokens.
    * :meth:`evict` frees at least what was asked where possible and returns
      ``(full, swa)`` tokens freed; ``evict(0)`` is always safe. :meth:`invalidate` drops
      unlocked subtrees holding any of ``slots`` (locked ones are left alone).
    * ``evictable_size() + protected_size() == total_size()``; :meth:`check_integrity`
      returns True or raises :class:`~kvcanary.memory.errors.IntegrityError`.
    """

    @property
    def page_size(self) -> int: ...

    @property
    def window(self) -> int | None: ...

    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor) -> MatchResult: ...

    def insert(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        slots: torch.Tensor,
        swa_evicted_seqlen: int = 0,
    ) -> int: ...

    def cache_unfinished(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        slots: torch.Tensor,
        swa_evicted_seqlen: int = 0,
    ) -> MatchResult | None: ...

    def inc_lock_ref(self, node: RadixNode) -> SwaLock: ...

    def dec_lock_ref(self, node: RadixNode, lock: SwaLock) -> None: ...

    def dec_swa_lock_only(self, node: RadixNode, lock: SwaLock) -> SwaLock: ...

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> tuple[int, int]: ...

    def invalidate(self, slots: torch.Tensor) -> int: ...

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...

    def swa_evictable_size(self) -> int: ...

    def swa_protected_size(self) -> int: ...

    def total_size(self) -> int: ...

    def num_tombstones(self) -> int: ...

    def all_values(self) -> torch.Tensor:
        """Every full slot the tree holds (tombstones included)."""
        ...

    def iter_cached(self) -> Iterator[CachedSpan]: ...

    def reset(self) -> None:
        """Empty the tree WITHOUT freeing (the caller clears the allocator too)."""
        ...

    def free_all(self) -> None:
        """Free every slot the tree holds and empty it; no node may be locked."""
        ...

    def check_integrity(self) -> bool: ...
