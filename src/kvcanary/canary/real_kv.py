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

import numpy as np
import torch

from kvcanary.canary.constants import (
    MAX_REAL_KV_SOURCES,
    REAL_KV_BYTE_ALIGNMENT,
    REAL_KV_PARTIAL_READ_BYTES,
    RealKvHashMode,
)
from kvcanary.canary.hashing import fold_real_kv_words_t, splitmix64_t

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
