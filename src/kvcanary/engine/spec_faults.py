"""SpecFaultSite: the engine's side of the canary's speculative-decoding fault injection.

The canary's perturber (``kvcanary.canary.perturb``) sees the forward batch, the req->token
table and its own pool; the speculative faults also need what only the engine knows. This
object hands exactly that over (structurally it is ``kvcanary.canary.perturb``'s
``SpecFaultHost``; the engine never imports the canary)::

    rejected_drafts()            (req_pool_idx, position) per request whose last verify step
                                 rejected a draft and kept the bonus position's slot, which
                                 still holds the first rejected draft's KV (the scheduler's
                                 ``spec_rejections``)
    free_slot()                  a slot of a free page of the target's full pool (0: none)
    draft_slots()                slots the draft model's allocator holds for its requests
    give_cached_page(row, pos)   a buggy rollback freed a page the prefix cache still holds
                                 and the allocator handed it out as ``row``'s page starting
                                 at ``pos``: ``row`` is remapped onto it, its own page goes
                                 back to the free list; returns the slot map and a repair

:meth:`Engine.spec_fault_site` builds one when speculative decoding is on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvcanary.engine.scheduler import Scheduler


class SpecFaultSite:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    @property
    def has_draft_pool(self) -> bool:
        """Whether a draft model with its own pools proposes (method ``draft``)."""
        return getattr(self.scheduler.proposer, "runner", None) is not None

    def rejected_drafts(self) -> list[tuple[int, int]]:
        return list(self.scheduler.spec_rejections)

    def free_slot(self) -> int:
        """The first slot of the highest-numbered free (unallocated, not quarantined) page
        of the target's full pool, 0 when none is."""
        kv = self.scheduler.kv
        pages = kv._full_pages
        free = torch.nonzero(~pages.page_allocated[1:] & ~pages.page_quarantined[1:]).reshape(-1)
        return (int(free[-1]) + 1) * kv.spec.page_size if free.numel() else 0

    def draft_slots(self) -> list[int]:
        """Every slot the draft model's allocator holds for its requests' KV (method
        ``draft``; else [])."""
        proposer: Any = self.scheduler.proposer
        if getattr(proposer, "runner", None) is None:
            return []
        out: list[int] = []
        for d in proposer.reqs.values():
            if d.req_pool_idx and d.kv_len:
                out += proposer.kv.slots(d).tolist()
        return out

    def give_cached_page(self, row: int, position: int,
                         choose: Callable[[list[int]], int]) -> tuple[dict[int, int], Callable[[], None]] | None:  # fmt: skip
        """Hand a page of an unlocked prefix-cache node (picked by ``choose`` among their
        page numbers) to request row ``row`` as its page starting at ``position`` (page
        aligned; that page fresh: allocated for this forward's writes), as the allocator would
        after a rollback freed the page while the tree still held it: ``row``'s entries of
        that page point into it, its own page goes back to the free list. Returns
        ``{old slot: new slot}`` (the forward's out_cache_loc must follow) and a repair to
        run once the damage has been read: the tree's node gets a fresh page in place of the
        handed one and is invalidated (dropped with its subtree, its slots freed), so the
        allocator, the rows and the tree agree again. None when nothing qualifies (no prefix
        cache, an SWA pool, ``position`` not page aligned, no unlocked cached page)."""
        kv = self.scheduler.kv
        cache, page = kv.prefix_cache, kv.spec.page_size
        if cache is None or kv.spec.windowed or position % page:
            return None
        nodes: dict[int, Any] = {}
        for node, _, value in cache.iter_cached():
            if node.lock_ref == 0 and value.numel():
                for p in torch.unique(value.long() // page).tolist():
                    nodes[int(p)] = node
        if not nodes:
            return None
        cached_page = choose(sorted(nodes))
        node = nodes[cached_page]
        table = kv.req_to_token
        own = int(table[row, position]) // page
        if own <= 0 or own == cached_page:
            return None
        span = table[row, position : position + page].long()
        mapped = int(((span // page) == own).sum())  # positions of the fresh page mapped so far
        remap = {own * page + k: cached_page * page + k for k in range(mapped)}
        table[row, position : position + mapped] = torch.tensor(list(remap.values()), dtype=table.dtype)
        kv.allocator.free(torch.tensor([own * page], dtype=torch.int64))

        def repair() -> None:
            fresh = kv.allocator.alloc(page)
            if fresh is None:
                return
            value = node.value
            in_page = (value.long() // page) == cached_page
            value[in_page] = (fresh.to(value.device, value.dtype)[0] + (value[in_page] % page))
            cache.invalidate(fresh)

        return remap, repair
