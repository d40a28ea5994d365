"""KV pages on the wire: which pages a request's transfer covers, and moving them through
the pool's buf-infos.

Both sides compute a request's page lists with the same arithmetic, so the i-th page sent
is the i-th page received (in both pools position ``p`` sits at offset ``p % P`` of its
page, full and SWA alike)::

    positions   0 ...... prefix_len ............. window_start ............ fill_len
    KV channel           [==== full pages of [prefix_len, fill_len) =========)
    state (SWA)                                   [==== SWA pages ==========)
                window_start = floor_page(max(0, fill_len - W)), clipped to prefix_len

``prefix_len`` is what the decode side already holds (a prefix-cache hit; page aligned).

Data moves through the buf-infos ``(data_ptrs, data_lens, item_lens)`` of
``get_contiguous_buf_infos()`` (KV channel) and ``get_state_buf_infos()`` (state channel):
page ``p`` of entry ``i`` is the ``item_lens[i]`` bytes at ``data_ptrs[i] + p * item_lens[i]``.
Whatever is spliced into the buf-infos (the canary's record buffers) travels with the KV
without this module knowing about it.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import torch

from kvcanary.memory.mha_pool import BaseKVPool
from kvcanary.utils import floor_page

BufInfos = tuple[list[int], list[int], list[int]]


class TransferPages(NamedTuple):
    kv_page_ids: list[int]  # full sub-pool pages of [prefix_len, fill_len)
    state_page_ids: list[int]  # SWA sub-pool pages of [max(window_start, prefix_len), fill_len)


class PageLayoutError(RuntimeError):
    """A request's slots are not laid out as whole pages, or its window is not resident."""


def state_start(fill_len: int, prefix_len: int, window: int, page_size: int) -> int:
    """First position of the SWA window state a transfer carries (page aligned)."""
    return max(floor_page(max(0, fill_len - window), page_size), prefix_len)


def _pages_of(slots: torch.Tensor, page_size: int, what: str) -> list[int]:
    """Page ids of consecutive positions starting on a page boundary; every slot must sit
    in its page at ``position % page_size`` (a page-table bug would fail here, not ship)."""
    slots = slots.to(torch.int64)
    pages = slots[::page_size] // page_size
    expect = pages.repeat_interleave(page_size)[: slots.numel()] * page_size + (
        torch.arange(slots.numel(), device=slots.device) % page_size
    )
    if not torch.equal(slots, expect):
        raise PageLayoutError(f"{what}: slots are not page aligned with positions")
    return pages.tolist()


def request_pages(
    req_to_token_row: torch.Tensor,
    full_to_swa: torch.Tensor | None,
    prefix_len: int,
    fill_len: int,
    window: int | None,
    page_size: int,
) -> TransferPages:
    """The pages of one request's transfer (``full_to_swa`` None: no state channel)."""
    if prefix_len % page_size or not 0 <= prefix_len < fill_len:
        raise ValueError(
            f"request_pages: prefix_len={prefix_len} must be page aligned (page_size="
            f"{page_size}) and < fill_len={fill_len}"
        )
    row = req_to_token_row.to(torch.int64)
    kv = _pages_of(row[prefix_len:fill_len], page_size, "KV channel")
    if full_to_swa is None or window is None:
        return TransferPages(kv, [])
    start = state_start(fill_len, prefix_len, window, page_size)
    swa = full_to_swa[row[start:fill_len]]
    if bool((swa <= 0).any()):
        raise PageLayoutError(
            f"state channel: SWA window [{start}, {fill_len}) is not resident "
            f"({int((swa <= 0).sum())} positions unmapped)"
        )
    return TransferPages(kv, _pages_of(swa, page_size, "state channel"))


def _alias(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of live memory at ``ptr`` (what a transfer engine
    registers); the pool that owns the memory must outlive it."""
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
    if device.type == "cuda":

        class _Interface:
            __cuda_array_interface__ = {
                "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            }  # fmt: skip

        return torch.as_tensor(_Interface(), device=device)
    raise NotImplementedError(f"KV transfer from {device}: supported devices are cpu, cuda")


def buffer_views(infos: BufInfos, device: torch.device) -> list[torch.Tensor]:
    """One ``uint8 [num_pages, item_len]`` view per buf-info entry."""
    views = []
    for ptr, nbytes, item_len in zip(*infos, strict=True):
        if item_len <= 0 or nbytes % item_len:
            raise ValueError(f"buf-info entry of {nbytes} bytes is not whole pages of {item_len}")
        views.append(_alias(ptr, nbytes, device).view(nbytes // item_len, item_len))
    return views


class PageIO:
    """Gathers a request's pages into one flat payload and scatters a payload into pages,
    entry by entry in buf-info order (KV channel entries, then state channel entries)."""

    def __init__(self, pool: BaseKVPool):
        self.device = pool.device
        self.kv_views = buffer_views(pool.get_contiguous_buf_infos(), self.device)
        self.state_views = buffer_views(pool.get_state_buf_infos(), self.device)

    def layout(self) -> dict[str, Any]:
        """What both sides must agree on (exchanged in the handshake)."""
        return {
            "kv_item_lens": [v.shape[1] for v in self.kv_views],
            "state_item_lens": [v.shape[1] for v in self.state_views],
        }

    def nbytes(self, pages: TransferPages) -> int:
        return len(pages.kv_page_ids) * sum(v.shape[1] for v in self.kv_views) + len(
            pages.state_page_ids
        ) * sum(v.shape[1] for v in self.state_views)

    def _parts(self, pages: TransferPages) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kv = torch.as_tensor(pages.kv_page_ids, dtype=torch.int64, device=self.device)
        state = torch.as_tensor(pages.state_page_ids, dtype=torch.int64, device=self.device)
        return [(v, kv) for v in self.kv_views] + [(v, state) for v in self.state_views]

    def gather(self, pages: TransferPages) -> torch.Tensor:
        parts = [view[ids].reshape(-1) for view, ids in self._parts(pages) if ids.numel()]
        if not parts:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.cat(parts)

    def scatter(self, payload: torch.Tensor, pages: TransferPages, page_offset: int = 0) -> None:
        """Write ``payload`` into ``pages``; ``page_offset`` != 0 lands every page that many
        pages off (a fault hook: wraps within pages ``[1, num_pages)``, never page 0)."""
        if payload.numel() != self.nbytes(pages):
            raise ValueError(
                f"KV payload of {payload.numel()} bytes; the pages need {self.nbytes(pages)}"
            )
        payload = payload.to(self.device)
        offset = 0
        for view, ids in self._parts(pages):
            if page_offset:
                ids = (ids - 1 + page_offset) % (view.shape[0] - 1) + 1
            n = ids.numel() * view.shape[1]
            view[ids] = payload[offset : offset + n].view(ids.numel(), view.shape[1])
            offset += n
