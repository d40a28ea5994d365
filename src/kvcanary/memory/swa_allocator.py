"""SWAAllocator: lockstep allocation in the full and sliding-window (SWA) pools.

The logical index space is the full pool's slot ids; ``full_to_swa_index_mapping``
(owned here, mutated in place, never reallocated) says where each full slot's
SWA-layer KV lives::

    mapping[f] = s > 0   full slot f's SWA KV is in SWA slot s (live)
    mapping[f] = 0       no SWA slot (never allocated, evicted from the window, freed,
                         or the reserved sink page)
    mapping[-1] = -1     sentinel: ``mapping[last_loc=-1]`` reads "no prefix"

Invariant: every live SWA slot is referenced by exactly one full slot. Every
mapping write goes through :class:`~kvcanary.memory.swa_mapping.SwaIndexMapping`, which
bumps ``version`` so translation caches keyed on it can never outlive a mutation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcanary.memory import pages_nb
from kvcanary.memory.allocator import PagedAllocator, _as_cpu_lens, make_allocator
from kvcanary.memory.base import HOST, Lens, WindowedAllocator, WindowedKVPool
from kvcanary.memory.errors import raise_if_problems
from kvcanary.memory.swa_mapping import SwaIndexMapping
from kvcanary.utils import unique_sorted

__all__ = ["SWAAllocator", "SwaIndexMapping"]


class SWAAllocator:
    """Wraps a full and an SWA allocator of the same kind (token or paged).

    All ``alloc*`` methods check both capacities before mutating anything and
    return ``None`` when either pool is short.
    """

    def __init__(
        self,
        full_size: int,
        swa_size: int,
        page_size: int,
        device: torch.device | str = "cpu",
        kvcache: WindowedKVPool | None = None,
    ):
        self.page_size = page_size
        self.device = torch.device(device)
        self.full_attn_allocator: PagedAllocator = make_allocator(full_size, page_size, device)
        self.swa_attn_allocator: PagedAllocator = make_allocator(swa_size, page_size, device)
        self.mapping = SwaIndexMapping(self.full_attn_allocator.size, page_size, self.device)
        self.full_to_swa_index_mapping = self.mapping.tensor
        if kvcache is not None:
            kvcache.register_mapping(self.mapping)

    # ----------------------------------------------------------------- sizes
    @property
    def size_full(self) -> int:
        return self.full_attn_allocator.size

    @property
    def size_swa(self) -> int:
        return self.swa_attn_allocator.size

    @property
    def size(self) -> int:
        return min(self.size_full, self.size_swa)

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        return (
            self.full_attn_allocator.num_free_pages() >= num_full_pages
            and self.swa_attn_allocator.num_free_pages() >= num_swa_pages
        )

    # ----------------------------------------------------------------- alloc
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Page size 1 only: ``num_tokens`` fresh slots in both pools, mapped."""
        if self.page_size != 1:
            raise ValueError(f"alloc(): only for page_size=1 (got {self.page_size}); use alloc_extend")
        if not self.new_pages_available(num_tokens, num_tokens):
            return None
        full = self.full_attn_allocator.alloc(num_tokens)
        swa = self.swa_attn_allocator.alloc(num_tokens)
        assert full is not None and swa is not None  # capacity checked above
        self.mapping.write(full, swa)
        return full

    def translate_last_locs(self, last_locs: torch.Tensor) -> torch.Tensor:
        """Full → SWA for ``last_loc`` arguments (−1 stays −1 through the sentinel)."""
        return self.mapping.translate(last_locs)

    def alloc_extend(
        self,
        prefix_lens: Lens,
        seq_lens: Lens,
        last_locs: torch.Tensor,
    ) -> torch.Tensor | None:
        """Positions ``[prefix_len, seq_len)`` in both pools with identical page arithmetic."""
        n = self.full_attn_allocator.num_new_pages_extend(prefix_lens, seq_lens)
        if not self.new_pages_available(n, n):
            return None
        swa_last = self.translate_last_locs(last_locs)
        p = self.page_size
        if isinstance(prefix_lens, list) and swa_last.device.type == "cpu":  # host lengths
            orphan = any(q % p != 0 and loc <= 0
                         for q, loc in zip(prefix_lens, swa_last.reshape(-1).tolist(), strict=True))  # fmt: skip
        else:
            partial = (_as_cpu_lens(prefix_lens) % p != 0).to(swa_last.device)
            orphan = bool((partial & (swa_last <= 0)).any())
        if orphan:
            raise ValueError(
                "alloc_extend: a request continues a partial page whose last slot has no SWA "
                f"slot (last_locs={last_locs.tolist()}, swa={swa_last.tolist()}); its window "
                "must not have been evicted"
            )
        full = self.full_attn_allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        swa = self.swa_attn_allocator.alloc_extend(prefix_lens, seq_lens, swa_last)
        assert full is not None and swa is not None  # capacity checked above
        self.mapping.write(full, swa)
        return full

    def alloc_decode(
        self, seq_lens: Lens, last_locs: torch.Tensor
    ) -> torch.Tensor | None:
        host_map = self.mapping.host_view
        full_alloc, swa_alloc = self.full_attn_allocator, self.swa_attn_allocator
        if (isinstance(seq_lens, list) and host_map is not None and last_locs.device == HOST
                and full_alloc.device == HOST and swa_alloc.device == HOST):  # fmt: skip
            # Host lengths on host pools: one compiled call (pages_nb), the same slots, pages,
            # flags and mapping; anything it will not do runs the path below.
            status, full_np, taken = pages_nb.alloc_decode(
                np.asarray(seq_lens, dtype=np.int64), last_locs.reshape(-1).to(torch.int64).numpy(),
                self.page_size, host_map, full_alloc.free_pages.numpy(),
                full_alloc.page_allocated.numpy(), swa_alloc.free_pages.numpy(),
                swa_alloc.page_allocated.numpy(),
            )  # fmt: skip
            if status == pages_nb.NO_ROOM:
                return None
            if status == pages_nb.FUSED:
                full_alloc.free_pages = full_alloc.free_pages[taken:]
                swa_alloc.free_pages = swa_alloc.free_pages[taken:]
                self.mapping.version += 1
                return torch.from_numpy(full_np)
        n = self.full_attn_allocator.num_new_pages_decode(seq_lens)
        if not self.new_pages_available(n, n):
            return None
        swa_last = self.translate_last_locs(last_locs)
        if isinstance(seq_lens, list) and swa_last.device.type == "cpu":  # host lengths
            p = self.page_size
            orphan = any((s - 1) % p != 0 and loc <= 0
                         for s, loc in zip(seq_lens, swa_last.tolist(), strict=True))  # fmt: skip
        else:
            seq = _as_cpu_lens(seq_lens)
            continues = ((seq - 1) % self.page_size != 0).to(swa_last.device)
            orphan = bool((continues & (swa_last <= 0)).any())
        if orphan:
            raise ValueError(
                "alloc_decode: a request's previous token has no SWA slot "
                f"(last_locs={last_locs.tolist()}, swa={swa_last.tolist()})"
            )
        full = self.full_attn_allocator.alloc_decode(seq_lens, last_locs)
        swa = self.swa_attn_allocator.alloc_decode(seq_lens, swa_last)
        assert full is not None and swa is not None  # capacity checked above
        self.mapping.write(full, swa)
        return full

    def alloc_extend_swa_tail(
        self, prefix_len: int, seq_len: int, last_loc: torch.Tensor | int, swa_tail_len: int
    ) -> torch.Tensor | None:
        """One request: full slots for ``[prefix_len, seq_len)``, SWA only for the last
        ``swa_tail_len`` of them, allocated as a fresh page-aligned sequence::

            positions  prefix_len ............................ seq_len
            full       [########################################)
            SWA                          [#####################)   swa_tail_len
            mapping    0 0 0 0 0 0 0 0 0 s s s s s s s s s s s s

        Non-tail mapping entries are zeroed explicitly: recycled full pages may carry a
        previous owner's mapping.
        """
        extend_len = seq_len - prefix_len
        if not 0 <= swa_tail_len <= extend_len:
            raise ValueError(
                f"alloc_extend_swa_tail: swa_tail_len={swa_tail_len} must be in [0, {extend_len}]"
            )
        if swa_tail_len and (seq_len - swa_tail_len) % self.page_size:
            raise ValueError(
                f"alloc_extend_swa_tail: tail start {seq_len - swa_tail_len} must be page aligned "
                f"(page_size={self.page_size})"
            )
        full_pages = self.full_attn_allocator.num_new_pages_extend([prefix_len], [seq_len])
        swa_pages = self.swa_attn_allocator.num_new_pages_extend([0], [swa_tail_len])
        if not self.new_pages_available(full_pages, swa_pages):
            return None
        last = torch.as_tensor([last_loc], dtype=torch.int64).reshape(1)
        full = self.full_attn_allocator.alloc_extend([prefix_len], [seq_len], last)
        assert full is not None
        head = full[: extend_len - swa_tail_len]
        if head.numel():
            self.mapping.write(head, 0)
        if swa_tail_len:
            no_prefix = torch.full((1,), -1, dtype=torch.int64)
            swa = self.swa_attn_allocator.alloc_extend([0], [swa_tail_len], no_prefix)
            assert swa is not None
            self.mapping.write(full[extend_len - swa_tail_len :], swa)
        return full

    # ----------------------------------------------------------------- free
    def _expand_to_pages(self, full_slots: torch.Tensor) -> torch.Tensor:
        p = self.page_size
        if p == 1:
            return full_slots.reshape(-1).to(torch.int64)
        pages: torch.Tensor = torch.unique(full_slots.reshape(-1).to(torch.int64) // p)
        return (pages[:, None] * p + torch.arange(p, device=pages.device)).reshape(-1)

    def free_swa(self, full_slots: torch.Tensor) -> None:
        """Free the SWA slots of the whole full pages holding ``full_slots`` and unmap them.

        Safe to repeat: already-unmapped entries are skipped (0 means nothing to free).
        """
        if full_slots.numel() == 0:
            return
        if self.device == HOST and full_slots.device == HOST:
            self._free_swa_host(full_slots.reshape(-1).to(torch.int64).numpy())
            return
        slots = self._expand_to_pages(full_slots.to(self.device))
        swa = self.mapping.translate(slots)
        live = swa > 0
        if bool(live.any()):
            self.swa_attn_allocator.free(swa[live])
            self.mapping.write(slots[live], 0)

    def _compiled_free_args(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int] | None:
        """(page size, mapping, SWA page flags allocated / quarantined, SWA pages): what
        :mod:`.pages_nb`'s calls take after the slots; None where the numpy path runs (page
        size 1, a device mapping or SWA pool, an open free group)."""
        host_map = self.mapping.host_view
        if self.page_size == 1 or host_map is None:
            return None
        flags = self.swa_attn_allocator.host_page_flags()
        if flags is None:
            return None
        return self.page_size, host_map, flags[0], flags[1], self.swa_attn_allocator.num_pages

    def _compiled_free_done(self, kept: np.ndarray, unmapped: bool) -> None:
        """After a compiled free (``FUSED``): its SWA pages onto the free list, the mapping's
        version bumped when it unmapped a slot (as ``free`` and ``write_host`` do)."""
        self.swa_attn_allocator.append_free(kept)
        if unmapped:
            self.mapping.version += 1

    def free_swa_rows(self, table: np.ndarray, spans: np.ndarray) -> int:
        """:meth:`free_swa` of the full slots ``table[row, a:b]`` of each ``(row, a, b)`` in
        ``spans`` (int64 ``[n, 3]``; ``table``: the host req->token table; the mapping must
        be on the host); returns how many of those slots were mapped before (a decode
        step's window eviction: one compiled call, :mod:`.pages_nb`, where it applies)."""
        if self.mapping.host_view is None:
            raise RuntimeError("free_swa_rows: the full->SWA mapping is not on the host")
        args = self._compiled_free_args()
        if args is not None and spans.ndim == 2 and spans.shape[1] == 3:
            status, kept, unmapped, num_mapped = pages_nb.free_swa_rows(table, spans, *args)
            if status == pages_nb.FUSED:
                self._compiled_free_done(kept, unmapped)
                return int(num_mapped)
        if spans.size == 0:
            return 0
        flat = np.concatenate([table[row, a:b] for row, a, b in spans.tolist()]).astype(np.int64)
        num_mapped = int((self.mapping.translate_host(flat) > 0).sum())
        self.free_swa(torch.from_numpy(flat))
        return num_mapped

    def _free_swa_host(self, full_slots: np.ndarray) -> None:
        """:meth:`free_swa` on a host pool: in one compiled call (:mod:`.pages_nb`, paged pools
        with a host mapping, no open free group), else in numpy (the same slots freed and
        unmapped, the same errors: a decode step evicts the pages that left the window)."""
        p = self.page_size
        args = self._compiled_free_args()
        if args is not None:
            status, kept, unmapped = pages_nb.free_swa_pages(full_slots, *args)
            if status == pages_nb.FUSED:
                self._compiled_free_done(kept, unmapped)
                return
        slots = full_slots if p == 1 else (unique_sorted(full_slots // p)[:, None] * p + np.arange(p)).reshape(-1)
        swa = self.mapping.translate_host(slots)
        live = swa > 0
        if live.any():
            self.swa_attn_allocator.free(torch.from_numpy(swa[live]))
            self.mapping.write_host(slots[live], 0)

    def free(self, full_slots: torch.Tensor) -> None:
        """Free full slots (page granular) and their SWA slots."""
        if full_slots.numel() == 0:
            return
        self.free_swa(full_slots)
        self.full_attn_allocator.free(full_slots)

    def free_group_begin(self) -> None:
        self.full_attn_allocator.free_group_begin()
        self.swa_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        self.full_attn_allocator.free_group_end()
        self.swa_attn_allocator.free_group_end()

    def set_full_to_swa_mapping(self, full_slots: torch.Tensor, swa_slots: torch.Tensor) -> None:
        self.mapping.write(full_slots, swa_slots)

    def quarantine(self, full_slots: torch.Tensor) -> int:
        """Never reallocate these full slots' pages (the SWA side: :meth:`quarantine_swa`)."""
        return self.full_attn_allocator.quarantine(full_slots)

    def quarantine_swa(self, swa_slots: torch.Tensor) -> int:
        return self.swa_attn_allocator.quarantine(swa_slots)

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.mapping.clear()

    # ----------------------------------------------------------------- checks
    def check_integrity(self) -> bool:
        self.full_attn_allocator.check_integrity()
        self.swa_attn_allocator.check_integrity()
        problems = []
        m = self.mapping.tensor
        p = self.page_size
        if int(m[-1]) != -1:
            problems.append("sentinel mapping[-1] is not -1")
        body = m[:-1]
        if bool((body < 0).any()):
            problems.append("negative mapping entries")
        if bool((body[:p] != 0).any()):
            problems.append("reserved full page 0 is mapped")
        full_slots = torch.nonzero(body > 0).reshape(-1)
        swa_slots = body[full_slots]
        in_range = swa_slots // p <= self.swa_attn_allocator.num_pages
        if not bool(in_range.all()):
            problems.append("mapping points past the end of the SWA pool")
            full_slots, swa_slots = full_slots[in_range], swa_slots[in_range]
        if int(torch.unique(swa_slots).numel()) != int(swa_slots.numel()):
            problems.append("mapping not injective: an SWA slot is referenced twice")
        if full_slots.numel():
            if not bool(self.full_attn_allocator.page_allocated[full_slots // p].all()):
                problems.append("a free full slot is still mapped")
            if not bool(self.swa_attn_allocator.page_allocated[swa_slots // p].all()):
                problems.append("a mapped SWA slot is free")
        mapped_pages: torch.Tensor = torch.unique(swa_slots // p)
        used_pages = self.swa_attn_allocator.num_used_pages()
        if int(mapped_pages.numel()) != used_pages:
            problems.append(
                f"SWA pages allocated ({used_pages}) != SWA pages referenced ({mapped_pages.numel()}): leak"
            )
        return raise_if_problems("SWAAllocator", problems)


if TYPE_CHECKING:  # mypy: the contracts of kvcanary.memory.base hold
    _swa: type[WindowedAllocator] = SWAAllocator
