"""Slot allocators for one token pool (storage lives in the pool; these only hand out ids).

Page layout of a pool with ``page_size = P`` and ``num_pages = size // P``::

    slots  [0 .. P)            page 0: reserved write sink (padded tokens land here)
    slots  [P*k .. P*(k+1))    page k, k = 1 .. num_pages: handed out whole

A request's slots are page-aligned with its positions: position ``p`` sits at
offset ``p % P`` inside its page, so a partially filled last page is continued
in place (``last_loc + 1``) before new pages are taken.

``TokenAllocator`` is the ``P = 1`` case of :class:`PagedAllocator` (any count
may be allocated, the partial-page rule never fires).

Contracts: an allocation that cannot be satisfied returns ``None`` and mutates
nothing; ``free`` is page granular (freeing any slot frees its whole page) and
raises :class:`DoubleFreeError` on a page that is already free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcanary.memory.base import HOST, Lens, PageAllocator
from kvcanary.memory.errors import DoubleFreeError, raise_if_problems
from kvcanary.utils import unique_sorted


def _nonempty(pages: torch.Tensor) -> torch.Tensor:
    # Gather source for torch.where: when no page is taken every lane uses the other branch.
    return pages if pages.numel() else torch.zeros(1, dtype=torch.int64)


def _as_cpu_lens(lens: Lens) -> torch.Tensor:
    return torch.as_tensor(lens, dtype=torch.int64, device="cpu").reshape(-1)


class PagedAllocator:
    def __init__(self, size: int, page_size: int, device: torch.device | str = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: must be >= 1")
        if size < page_size:
            raise ValueError(f"pool size={size} tokens: must hold at least one page of {page_size}")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self._pending_free: list[torch.Tensor] = []  # queued inside a free group
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        # page_allocated[p]: page p is handed out (page 0 is never)
        self.page_allocated = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        # page_quarantined[p]: never handed out again (its KV was found corrupt)
        self.page_quarantined = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._free_group_depth = 0  # clear() ends any open free group
        self._pending_free = []

    def available_size(self) -> int:
        """Free token slots (whole free pages × page_size)."""
        return int(self.free_pages.numel()) * self.page_size

    def num_free_pages(self) -> int:
        return int(self.free_pages.numel())

    def _take_pages(self, num_pages: int) -> torch.Tensor:
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        if self.device == HOST:  # numpy's write on the flags' memory: ~1 us, torch's ~5
            self.page_allocated.numpy()[pages.numpy()] = True
        else:
            self.page_allocated[pages] = True
        return pages

    # ------------------------------------------------------------------ alloc
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` fresh slots (whole pages; must be page aligned when page_size > 1)."""
        if num_tokens % self.page_size:
            raise ValueError(
                f"alloc(num_tokens={num_tokens}): must be a multiple of page_size={self.page_size}"
            )
        num_pages = num_tokens // self.page_size
        if num_pages > self.num_free_pages():
            return None
        pages = self._take_pages(num_pages)
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def num_new_pages_extend(
        self, prefix_lens: Lens, seq_lens: Lens
    ) -> int:
        """Pages ``alloc_extend`` would take: Σ ceil(seq/P) − ceil(prefix/P)."""
        p = self.page_size
        if isinstance(prefix_lens, list) and isinstance(seq_lens, list):  # host lengths
            if len(prefix_lens) != len(seq_lens):
                raise ValueError(f"bad lengths prefix={prefix_lens} seq={seq_lens}")
            return sum((s + p - 1) // p - (q + p - 1) // p
                       for q, s in zip(prefix_lens, seq_lens, strict=True))  # fmt: skip
        pre, seq = _as_cpu_lens(prefix_lens), _as_cpu_lens(seq_lens)
        return int(((seq + p - 1) // p - (pre + p - 1) // p).sum())

    def num_new_pages_decode(self, seq_lens: Lens) -> int:
        """Pages ``alloc_decode`` would take: requests whose new token starts a page."""
        if isinstance(seq_lens, list):  # host lengths: count them where they are
            return sum((s - 1) % self.page_size == 0 for s in seq_lens)
        seq = _as_cpu_lens(seq_lens)
        return int(((seq - 1) % self.page_size == 0).sum())

    def alloc_extend(
        self,
        prefix_lens: Lens,
        seq_lens: Lens,
        last_locs: torch.Tensor,
    ) -> torch.Tensor | None:
        """Slots for positions ``[prefix_len, seq_len)`` of each request, flat in batch order.

        ``last_locs[i]`` is the slot of position ``prefix_len - 1`` (−1 when the prefix is
        empty); it continues a partially filled last page in place.
        """
        if (isinstance(prefix_lens, list) and isinstance(seq_lens, list)
                and self.device == HOST and last_locs.device == HOST):  # fmt: skip
            return self._alloc_extend_host(prefix_lens, seq_lens, last_locs)
        pre, seq = _as_cpu_lens(prefix_lens), _as_cpu_lens(seq_lens)
        if pre.numel() != seq.numel() or bool((seq < pre).any()) or bool((pre < 0).any()):
            raise ValueError(f"alloc_extend: bad lengths prefix={pre.tolist()} seq={seq.tolist()}")
        p = self.page_size
        new_pages_per_req = (seq + p - 1) // p - (pre + p - 1) // p
        num_new_pages = int(new_pages_per_req.sum())
        if num_new_pages > self.num_free_pages():
            return None
        last_locs = last_locs.to(device="cpu", dtype=torch.int64).reshape(-1)
        partial = pre % p != 0
        if bool(partial.any()) and bool(((last_locs[partial] + 1) % p != pre[partial] % p).any()):
            raise ValueError(
                "alloc_extend: last_locs do not continue the partial last page "
                f"(prefix_lens={pre.tolist()}, last_locs={last_locs.tolist()}, page_size={p})"
            )
        ext = seq - pre
        num_tokens = int(ext.sum())
        req = torch.repeat_interleave(torch.arange(pre.numel()), ext)
        starts = torch.cumsum(ext, 0) - ext
        pos = torch.arange(num_tokens) - starts[req] + pre[req]
        first_new_page = (pre + p - 1) // p
        in_partial = pos < first_new_page[req] * p
        page_base = torch.cumsum(new_pages_per_req, 0) - new_pages_per_req
        rank = (pos // p - first_new_page[req] + page_base[req]).clamp(min=0)
        pages = _nonempty(self._take_pages(num_new_pages).cpu())
        new_slots = pages[rank.clamp(max=pages.numel() - 1)] * p + pos % p
        out = torch.where(in_partial, last_locs[req] + (pos - pre[req] + 1), new_slots)
        return out.to(self.device)

    def _alloc_extend_host(self, prefix_lens: list[int], seq_lens: list[int],
                           last_locs: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        """:meth:`alloc_extend` of host lengths on a host pool, in Python: the same slots,
        pages taken and errors (the scheduler extends one request at a time; ~25 torch ops
        on tiny tensors cost ~100 us a call, twice per request on an SWA pool)."""
        p = self.page_size
        if len(prefix_lens) != len(seq_lens) or any(
            s < q or q < 0 for q, s in zip(prefix_lens, seq_lens, strict=True)
        ):
            raise ValueError(f"alloc_extend: bad lengths prefix={prefix_lens} seq={seq_lens}")
        new_pages = [(s + p - 1) // p - (q + p - 1) // p
                     for q, s in zip(prefix_lens, seq_lens, strict=True)]  # fmt: skip
        num_new_pages = sum(new_pages)
        if num_new_pages > self.num_free_pages():
            return None
        last = last_locs.reshape(-1).tolist()
        if len(last) != len(prefix_lens):
            raise ValueError(f"alloc_extend: {len(last)} last_locs for {len(prefix_lens)} requests")
        if any(q % p and (loc + 1) % p != q % p for q, loc in zip(prefix_lens, last, strict=True)):
            raise ValueError(
                "alloc_extend: last_locs do not continue the partial last page "
                f"(prefix_lens={prefix_lens}, last_locs={last}, page_size={p})"
            )
        pages = self._take_pages(num_new_pages).tolist() if num_new_pages else []
        out: list[int] = []
        taken = 0
        for q, s, loc, n in zip(prefix_lens, seq_lens, last, new_pages, strict=True):
            first = (q + p - 1) // p * p  # the first position on a page of its own
            if min(s, first) > q:  # the partial last page, continued in place
                out.extend(range(loc + 1, loc + 1 + min(s, first) - q))
            for k in range(n):
                base = pages[taken + k] * p
                out.extend(range(base, base + min(p, s - first - k * p)))
            taken += n
        return torch.from_numpy(np.array(out, dtype=np.int64))  # (torch.tensor: 4x slower)

    def alloc_decode(
        self, seq_lens: Lens, last_locs: torch.Tensor
    ) -> torch.Tensor | None:
        """One slot per request for position ``seq_len - 1`` (``seq_len`` counts the new token)."""
        if isinstance(seq_lens, list) and self.device == HOST and last_locs.device == HOST:
            return self._alloc_decode_host(seq_lens, last_locs)
        seq = _as_cpu_lens(seq_lens)
        starts_page = (seq - 1) % self.page_size == 0
        num_new_pages = int(starts_page.sum())
        if num_new_pages > self.num_free_pages():
            return None
        pages = _nonempty(self._take_pages(num_new_pages).cpu())
        rank = (torch.cumsum(starts_page.to(torch.int64), 0) - 1).clamp(0, pages.numel() - 1)
        last_locs = last_locs.to(device="cpu", dtype=torch.int64).reshape(-1)
        page_slots = pages[rank] * self.page_size
        return torch.where(starts_page, page_slots, last_locs + 1).to(self.device)

    def _alloc_decode_host(self, seq_lens: list[int], last_locs: torch.Tensor) -> torch.Tensor | None:
        """:meth:`alloc_decode` of host lengths on a host pool, in Python: the same slots and
        pages taken (a decode batch's few lengths; ~20 torch ops on tiny tensors cost ~50 us)."""
        p = self.page_size
        starts = [(s - 1) % p == 0 for s in seq_lens]
        num_new_pages = sum(starts)
        if num_new_pages > self.num_free_pages():
            return None
        last = last_locs.reshape(-1).tolist()
        pages = iter(self._take_pages(num_new_pages).tolist() if num_new_pages else ())
        out = [next(pages) * p if start else loc + 1 for start, loc in zip(starts, last, strict=True)]
        return torch.from_numpy(np.array(out, dtype=np.int64))

    # ------------------------------------------------------------------ free
    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding ``slots`` (page granular)."""
        if slots.numel() == 0:
            return
        if self._free_group_depth:
            self._pending_free.append(slots.reshape(-1).to(self.device))
            return
        if self.device == HOST and slots.device == HOST:
            self._free_host(slots)
            return
        slot_ids = slots.reshape(-1).to(self.device, torch.int64)
        pages: torch.Tensor = torch.unique(slot_ids // self.page_size)
        if bool((pages <= 0).any()) or bool((pages > self.num_pages).any()):
            raise ValueError(
                f"free: slots {slots.tolist()[:16]} fall outside pages [1, {self.num_pages}] "
                "(page 0 is the reserved sink)"
            )
        if not bool(self.page_allocated[pages].all()):
            bad = pages[~self.page_allocated[pages]]
            raise DoubleFreeError(f"free: pages {bad.tolist()[:16]} are already free")
        self.page_allocated[pages] = False
        self.free_pages = torch.cat([self.free_pages, pages[~self.page_quarantined[pages]]])

    def _free_host(self, slots: torch.Tensor) -> None:
        """:meth:`free` on a host pool, in numpy: the same pages freed in the same order and
        the same errors (a decode step frees the pages that left a window: ~8 torch ops on
        tiny tensors, ~5 us each, where these cost ~1 us)."""
        pages = unique_sorted(slots.reshape(-1).to(torch.int64).numpy() // self.page_size)
        if pages.size and (pages[0] <= 0 or pages[-1] > self.num_pages):  # (sorted)
            raise ValueError(
                f"free: slots {slots.tolist()[:16]} fall outside pages [1, {self.num_pages}] "
                "(page 0 is the reserved sink)"
            )
        allocated = self.page_allocated.numpy()
        if not allocated[pages].all():
            bad = pages[~allocated[pages]]
            raise DoubleFreeError(f"free: pages {bad.tolist()[:16]} are already free")
        allocated[pages] = False
        kept = pages[~self.page_quarantined.numpy()[pages]]
        self.free_pages = torch.cat([self.free_pages, torch.from_numpy(kept)])

    def host_page_flags(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(allocated, quarantined)`` page flags as numpy views, for a compiled free that
        does what :meth:`free` does (:mod:`.pages_nb`; then :meth:`append_free`); None where
        :meth:`free` would not free at once in numpy (a device pool, an open free group)."""
        if self.device != HOST or self._free_group_depth:
            return None
        return self.page_allocated.numpy(), self.page_quarantined.numpy()

    def append_free(self, pages: np.ndarray) -> None:
        """Append freed pages (already marked free, quarantined ones left out) to the free
        list, as :meth:`free` does last."""
        if pages.size:
            self.free_pages = torch.cat([self.free_pages, torch.from_numpy(pages)])

    def quarantine(self, slots: torch.Tensor) -> int:
        """Take the pages holding ``slots`` out of circulation for good: free ones leave the
        free list now, allocated ones when freed. Returns pages newly quarantined."""
        slot_ids = slots.reshape(-1).to(self.device, torch.int64)
        pages: torch.Tensor = torch.unique(slot_ids // self.page_size)
        pages = pages[(pages > 0) & (pages <= self.num_pages)]
        pages = pages[~self.page_quarantined[pages]]
        self.page_quarantined[pages] = True
        self.free_pages = self.free_pages[~self.page_quarantined[self.free_pages]]
        return int(pages.numel())

    def num_quarantined_pages(self) -> int:
        return int(self.page_quarantined.sum())

    def free_group_begin(self) -> None:
        """Queue frees until the matching :meth:`free_group_end` (one merged free, duplicates
        allowed). Groups nest: only the outermost end frees, so an inner group never drops
        what an outer one queued."""
        self._free_group_depth += 1

    def free_group_end(self) -> None:
        if not self._free_group_depth:
            raise ValueError("free_group_end: no open free group (unbalanced free_group_begin)")
        self._free_group_depth -= 1
        if self._free_group_depth == 0 and self._pending_free:
            pending, self._pending_free = self._pending_free, []
            self.free(torch.cat(pending))

    # ------------------------------------------------------------------ checks
    def num_used_pages(self) -> int:
        return int(self.page_allocated.sum())

    def check_integrity(self) -> bool:
        problems = []
        free = self.free_pages
        if int(torch.unique(free).numel()) != int(free.numel()):
            problems.append("duplicate pages in the free list")
        in_range = (free > 0) & (free <= self.num_pages)
        if not bool(in_range.all()):
            problems.append("free list holds reserved or out-of-range pages")
            free = free[in_range]  # indexing page_allocated with them would raise or wrap
        if bool(self.page_allocated[free].any()):
            problems.append("pages both free and allocated")
        if bool(self.page_allocated[0]):
            problems.append("reserved page 0 allocated")
        if bool(self.page_quarantined[free].any()):
            problems.append("quarantined pages in the free list")
        parked = int((self.page_quarantined & ~self.page_allocated).sum())
        if self.num_free_pages() + self.num_used_pages() + parked != self.num_pages:
            problems.append(
                f"free {self.num_free_pages()} + used {self.num_used_pages()} + quarantined "
                f"{parked} != total {self.num_pages}"
            )
        return raise_if_problems(type(self).__name__, problems)


class TokenAllocator(PagedAllocator):
    """Page size 1: every slot is its own page; slot 0 is the reserved sink."""

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        super().__init__(size, 1, device)


def make_allocator(size: int, page_size: int, device: torch.device | str = "cpu") -> PagedAllocator:
    return TokenAllocator(size, device) if page_size == 1 else PagedAllocator(size, page_size, device)


if TYPE_CHECKING:  # mypy: the contracts of kvcanary.memory.base hold
    _paged: type[PageAllocator] = PagedAllocator
    _token: type[PageAllocator] = TokenAllocator
