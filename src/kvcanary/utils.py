"""Small arithmetic helpers shared by the memory system, scheduler and canary."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def floor_page(num_tokens: int, page_size: int) -> int:
    """Largest multiple of ``page_size`` that is <= ``num_tokens``."""
    return (num_tokens // page_size) * page_size


def ceil_page(num_tokens: int, page_size: int) -> int:
    """Smallest multiple of ``page_size`` that is >= ``num_tokens``."""
    return cdiv(num_tokens, page_size) * page_size


def swa_tail_len(seq_len: int, window: int | None, page_size: int) -> int:
    """SWA slots a sequence of ``seq_len`` needs when only its window is resident.

    The window start is floored to a page so SWA pages start fresh::

        seq_len - window        window_start = floor_page(seq_len - window)
        ----------------|-------|--------------------------------| seq_len
                                [========== tail ================)

    ``window <= tail < window + page_size`` for long sequences; ``seq_len`` when it
    fits in the window (or there is no window).
    """
    if seq_len <= 0:
        return max(seq_len, 0)
    if window is None or window <= 0:
        return seq_len
    return seq_len - floor_page(max(0, seq_len - window), page_size)


def show(value: object) -> str:
    """``value`` as JSON writes it (``true``, ``null``, ``"text"``, ``[1, 2]``), the way
    every user-facing message prints values; ``str()`` for what JSON cannot hold."""
    import json

    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def unique_sorted(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` of a 1-D integer array (sorted, each value once) by a sort and
    a neighbour compare: numpy 2's hash-based ``unique`` costs ~16 us on a decode step's
    few dozen page ids, this ~7."""
    out = np.sort(values)
    if out.size < 2:
        return out
    keep = np.empty(out.shape, dtype=np.bool_)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]


def buf_infos(buffers: list[torch.Tensor], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """(data_ptrs, data_lens, item_lens) of ``buffers``, the layout of a pool's buf-infos:
    page ``p`` of buffer ``i`` starts at ``data_ptrs[i] + p * item_lens[i]``; ``item_lens`` =
    bytes of one page."""
    ptrs = [b.data_ptr() for b in buffers]
    lens = [b.nbytes for b in buffers]
    items = [b[0].nbytes * page_size for b in buffers]
    return ptrs, lens, items


def write_file_atomically(path: str | Path, data: bytes, flag: str = "--json") -> None:
    """Write ``data`` to ``path`` through a temp file + rename, so a reader never sees half
    a file; a missing directory is a ``ValueError`` naming ``flag``."""
    path = Path(path)
    if not path.parent.exists():
        raise ValueError(f"{flag} {show(str(path))}: directory {show(str(path.parent))} does not exist")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
