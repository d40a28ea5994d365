"""Real-KV sources: where a slot's live KV bytes are, and their fingerprint (record field 3).

Addressing of slot ``s`` in a source (``tensor`` is a uint8 view of a live pool buffer)::

    row  = s // page_size
    cols = [(s % page_size) * num_bytes_per_token, ... + read_bytes)

    tensor[row]: | token 0 bytes | token 1 bytes | ... | token ps-1 bytes | (ignored tail) |
                   ^ read_bytes of each token are fingerprinted

A source must be a *view* of the live pool, never a copy, or the fingerprint checks stale bytes.
Row width, row stride and view offset are multiples of 16 bytes, so the bytes can be read as
little-endian int64 words (:attr:`RealKvSource.words`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch

from kvcanary.canary.constants import (
    MAX_REAL_KV_SOURCES,
    REAL_KV_BYTE_ALIGNMENT,
    REAL_KV_PARTIAL_READ_BYTES,
    RealKvHashMode,
)
from kvcanary.canary.hashing import fold_real_kv_words_t, splitmix64_nb, splitmix64_t

if sys.byteorder != "little":  # records and word folds are little-endian on the wire
    raise ImportError("kvcanary.canary requires a little-endian host")


@dataclass(frozen=True, slots=True)
class RealKvSource:
    """One live KV buffer folded into field 3. Byte counts are positive multiples of 16."""

    tensor: torch.Tensor  # uint8 [num_rows, row_bytes], unit stride along dim 1
    page_size: int
    num_bytes_per_token: int
    read_bytes: int  # effective bytes per slot, see :func:`resolve_read_bytes`

    def __post_init__(self) -> None:
        t = self.tensor
        if t.dtype != torch.uint8 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(
                f"real-KV source must be a 2-D uint8 view with unit column stride, got "
                f"dtype={t.dtype} shape={tuple(t.shape)} stride={t.stride()}"
            )
        if self.page_size < 1:
            raise ValueError(f"real-KV source page_size={self.page_size}; allowed: >= 1")
        for name, value in (
            ("num_bytes_per_token", self.num_bytes_per_token),
            ("read_bytes", self.read_bytes),
            ("row stride (bytes)", t.stride(0)),
            ("row width (bytes)", t.shape[1]),
        ):
            if value <= 0 or value % REAL_KV_BYTE_ALIGNMENT:
                raise ValueError(
                    f"real-KV source {name}={value}; allowed: positive multiples of "
                    f"{REAL_KV_BYTE_ALIGNMENT}"
                )
        if t.storage_offset() % REAL_KV_BYTE_ALIGNMENT:
            raise ValueError(
                f"real-KV source view starts at byte {t.storage_offset()} of its storage; "
                f"allowed: multiples of {REAL_KV_BYTE_ALIGNMENT}"
            )
        if self.read_bytes > self.num_bytes_per_token:
            raise ValueError(
                f"real-KV source read_bytes={self.read_bytes} exceeds "
                f"num_bytes_per_token={self.num_bytes_per_token}"
            )
        if t.shape[1] < self.page_size * self.num_bytes_per_token:
            raise ValueError(
                f"real-KV source rows hold {t.shape[1]} bytes < page_size*num_bytes_per_token="
                f"{self.page_size * self.num_bytes_per_token}"
            )

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[0] * self.page_size

    @property
    def words(self) -> torch.Tensor:
        """int64 ``[num_rows, row_bytes // 8]`` view of the same bytes (little-endian words)."""
        return self.tensor.view(torch.int64)


def resolve_read_bytes(mode: RealKvHashMode, num_bytes_per_token: int) -> int:
    """Bytes per slot fingerprinted under ``mode`` (0 = no source should be built)."""
    if mode == RealKvHashMode.NONE:
        return 0
    if mode == RealKvHashMode.PARTIAL:
        return min(REAL_KV_PARTIAL_READ_BYTES, num_bytes_per_token)
    return num_bytes_per_token


def check_sources(sources: Sequence[RealKvSource]) -> None:
    if len(sources) > MAX_REAL_KV_SOURCES:
        raise ValueError(f"{len(sources)} real-KV sources; allowed: at most {MAX_REAL_KV_SOURCES}")


def real_kv_hashes_t(sources: Sequence[RealKvSource], slots: torch.Tensor) -> torch.Tensor:
    """int64 ``[len(slots)]``: field 3 for each slot (zeros with no sources). Slots must be >= 0."""
    check_sources(sources)
    acc = torch.zeros(slots.shape[0], dtype=torch.int64, device=slots.device)
    for source in sources:
        rows = torch.div(slots, source.page_size, rounding_mode="floor")
        first_word = (slots - rows * source.page_size) * (source.num_bytes_per_token // 8)
        cols = first_word[:, None] + torch.arange(source.read_bytes // 8, device=slots.device)
        acc = splitmix64_t(acc ^ fold_real_kv_words_t(source.words[rows[:, None], cols]))
    return acc


_NO_SOURCE = np.zeros((1, 2), dtype=np.int64)

NumbaSourceArgs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]


def numba_source_args(sources: Sequence[RealKvSource]) -> NumbaSourceArgs:
    """``(words0, words1, words2, words3, meta, num_sources)`` for the numba kernels.

    Unused array slots hold a dummy; ``meta[i] = (page_size, words_per_token, read_words)``.
    The arrays share memory with the (CPU) source tensors.
    """
    check_sources(sources)
    arrays = [s.words.numpy() for s in sources]
    arrays += [_NO_SOURCE] * (MAX_REAL_KV_SOURCES - len(arrays))
    meta = np.zeros((MAX_REAL_KV_SOURCES, 3), dtype=np.int64)
    for i, s in enumerate(sources):
        meta[i] = (s.page_size, s.num_bytes_per_token // 8, s.read_bytes // 8)
    return arrays[0], arrays[1], arrays[2], arrays[3], meta, len(sources)


# Read windows of at most this many words (512 bytes) are gathered straight from the pool;
# longer ones go through a tile of at most 64 slots / 16384 words (128 KiB: in L2).
_DIRECT_WORDS = 64
_TILE_SLOTS, _TILE_WORDS = 64, 16384


@numba.njit(cache=True, inline="always")
def _fold_into(acc, slots, h, b0, m):
    """``acc[b0 + i] = splitmix64(acc[b0 + i] ^ h[i])`` for ``i < m`` whose slot is >= 0."""
    for i in range(m):
        folded = np.int64(splitmix64_nb(np.uint64(acc[b0 + i]) ^ h[i]))
        acc[b0 + i] = folded if slots[b0 + i] >= 0 else acc[b0 + i]


@numba.njit(cache=True)
def _fold_source(acc, slots, words, page_size, words_per_token, read_words):
    """``acc[i] = splitmix64(acc[i] ^ fold of slot i's read window)`` for slots >= 0.

    Word-pair-major: each pass hashes two words of every slot in a loop that vectorises
    across slots (a slot's fold is a serial chain; 10x faster than slot by slot). Windows
    longer than 512 bytes go per block of slots, copied slot by slot (contiguous runs the
    prefetcher follows) into a word-major tile ``[read_words, block]``, so a pass reads each
    word of the block's slots as one contiguous vector (on the qwen3-0.6b-shape preset's 4 KiB
    K rows a batch-32 decode TAIL (real-data all) took 3.1 ms instead of 8.2 ms with a
    slot-major tile; word-major and 32-slot blocks: 32 slots of 4 KiB, warm, 35 -> 15 us,
    3.7 -> 8.6 GB/s: the slot-major tile's strided lanes did not vectorise). Up to 512 bytes
    (tiny models, and every partial window) the tile measured no faster in the engine (7 us
    slower at batch 8), so those gather two words of every slot per pass straight from the
    pool. ``read_words`` is even (read windows are multiples of 16 bytes).
    """
    n = slots.shape[0]
    hi = np.int64(-1)
    for i in range(n):
        hi = max(hi, slots[i])
    _check_range(hi, words, page_size)
    if read_words <= _DIRECT_WORDS:
        lo_words = np.empty(n, dtype=np.uint64)
        hi_words = np.empty(n, dtype=np.uint64)
        h = np.zeros(n, dtype=np.uint64)
        for w in range(0, read_words, 2):
            if page_size == 1:  # the usual layout: no division
                for i in range(n):
                    row = max(slots[i], 0)
                    lo_words[i], hi_words[i] = words[row, w], words[row, w + 1]
            else:
                for i in range(n):
                    slot = max(slots[i], 0)
                    row, col = slot // page_size, (slot % page_size) * words_per_token + w
                    lo_words[i], hi_words[i] = words[row, col], words[row, col + 1]
            for i in range(n):
                h[i] = splitmix64_nb(splitmix64_nb(h[i] ^ lo_words[i]) ^ hi_words[i])
        _fold_into(acc, slots, h, 0, n)
        return
    block = min(_TILE_SLOTS, max(4, _TILE_WORDS // read_words))
    tile = np.empty((read_words, block), dtype=np.uint64)
    h = np.empty(block, dtype=np.uint64)
    for b0 in range(0, n, block):
        m = min(block, n - b0)
        for i in range(m):
            slot = max(slots[b0 + i], 0)
            row, col = slot // page_size, (slot % page_size) * words_per_token
            for w in range(read_words):
                tile[w, i] = words[row, col + w]
            h[i] = 0
        for w in range(0, read_words, 2):
            lo, hi_w = tile[w], tile[w + 1]
            for i in range(m):
                h[i] = splitmix64_nb(splitmix64_nb(h[i] ^ lo[i]) ^ hi_w[i])
        _fold_into(acc, slots, h, b0, m)


@numba.njit(cache=True, inline="always")
def _check_range(hi, words, page_size):
    if hi >= 0 and hi // page_size >= words.shape[0]:
        raise IndexError("kv-canary: slot out of range of a real-KV source")


@numba.njit(cache=True, inline="always")
def check_source_ranges(hi, words0, words1, words2, words3, meta, num_sources):
    """Raise :func:`real_kv_hashes_nb`'s error when slot ``hi`` (the largest to fold) is
    outside a source, before any work (for callers that fold on several threads)."""
    if num_sources > 0:
        _check_range(hi, words0, meta[0, 0])
    if num_sources > 1:
        _check_range(hi, words1, meta[1, 0])
    if num_sources > 2:
        _check_range(hi, words2, meta[2, 0])
    if num_sources > 3:
        _check_range(hi, words3, meta[3, 0])


@numba.njit(cache=True, inline="always")
def real_kv_hashes_nb(slots, words0, words1, words2, words3, meta, num_sources):
    """numba: field 3 for every slot (0 for negative slots), one pass per source (the
    arguments of :func:`numba_source_args`).

    Per-source passes keep array arguments out of the per-entry loop (a call per entry that
    passes arrays costs reference-count traffic that dominated the kernel).
    """
    acc = np.zeros(slots.shape[0], dtype=np.int64)
    if num_sources > 0:
        _fold_source(acc, slots, words0, meta[0, 0], meta[0, 1], meta[0, 2])
    if num_sources > 1:
        _fold_source(acc, slots, words1, meta[1, 0], meta[1, 1], meta[1, 2])
    if num_sources > 2:
        _fold_source(acc, slots, words2, meta[2, 0], meta[2, 1], meta[2, 2])
    if num_sources > 3:
        _fold_source(acc, slots, words3, meta[3, 0], meta[3, 1], meta[3, 2])
    return acc
