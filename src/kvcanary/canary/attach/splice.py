"""Buf-info splicing: transfers that move KV by buf-infos move the canary records too.

A pool's ``get_contiguous_buf_infos()`` / ``get_state_buf_infos()`` return
``(data_ptrs, data_lens, item_lens)``, one entry per buffer, where page ``p`` of buffer
``i`` starts at ``data_ptrs[i] + p * item_lens[i]``. After attaching, every run of KV
entries that belongs to a canary group is wrapped by the group's HEAD and TAIL record
buffers of that half, as if they were two extra layers (``item_len = 32 * page_size``, so
page ``p`` of the records travels with page ``p`` of the KV)::

    MHA      [k_head, K0 .. Kn-1, k_tail, v_head, V0 .. Vn-1, v_tail]
    K only   [k_head, K0 .. Kn-1, k_tail]
    entries after the last segment (e.g. DSV4 compress states) pass through unchanged

This is SGLang's layout; a consumer that iterates the entries needs no change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from kvcanary.utils import buf_infos

BufInfos = tuple[list[int], list[int], list[int]]


class Segment(NamedTuple):
    """``num_entries`` consecutive KV entries wrapped by ``head`` / ``tail`` (None: as is)."""

    num_entries: int
    head: torch.Tensor | None
    tail: torch.Tensor | None
    page_size: int


def splice_buf_infos(infos: BufInfos, segments: Sequence[Segment]) -> BufInfos:
    ptrs, lens, items = infos
    need = sum(s.num_entries for s in segments)
    if need > len(ptrs):
        raise ValueError(
            f"kv-canary: buf-info splice expects at least {need} entries, the pool returned "
            f"{len(ptrs)} (pool layout changed after attaching?)"
        )
    out: BufInfos = ([], [], [])
    pos = 0
    for seg in segments:
        wrap = seg.head is not None and seg.tail is not None
        if wrap:
            _extend(out, buf_infos([seg.head], seg.page_size))  # type: ignore[list-item]
        _extend(out, (ptrs[pos : pos + seg.num_entries], lens[pos : pos + seg.num_entries],
                      items[pos : pos + seg.num_entries]))  # fmt: skip
        if wrap:
            _extend(out, buf_infos([seg.tail], seg.page_size))  # type: ignore[list-item]
        pos += seg.num_entries
    _extend(out, (ptrs[pos:], lens[pos:], items[pos:]))
    return out


def _extend(out: BufInfos, part: BufInfos) -> None:
    for acc, values in zip(out, part, strict=True):
        acc.extend(values)


def patch_buf_infos(pool: Any, method_name: str, segments: Sequence[Segment]) -> None:
    """Replace ``pool.<method_name>`` (on the instance) by its spliced version."""
    original: Callable[[], BufInfos] = getattr(pool, method_name)
    if getattr(original, "__kv_canary_spliced__", False):
        raise RuntimeError(f"kv-canary: {type(pool).__name__}.{method_name} is already spliced")

    def spliced() -> BufInfos:
        return splice_buf_infos(original(), segments)

    spliced.__kv_canary_spliced__ = True  # type: ignore[attr-defined]
    spliced.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(pool, method_name, spliced)
