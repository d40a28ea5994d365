"""Canary hashes in three bit-identical flavours: Python ints, torch int64, numba uint64
(and :func:`splitmix64_ir`, the numba one as LLVM IR on vectors, for intrinsics).

Definitions (unsigned 64-bit arithmetic; stored in records and rings as signed int64)::

    splitmix64(x)       finaliser only: x ^= x>>30; x *= M1; x ^= x>>27; x *= M2; x ^= x>>31
    chain_hash(h, t, p) splitmix64(splitmix64(splitmix64(h) ^ t) ^ p)     ("mix3", order matters)
    ANCHOR_HASH         splitmix64(CANARY_CHAIN_ANCHOR) = 0xde7fae23a9a1b716
    real-KV fold        h = 0; for each little-endian 8-byte word w: h = splitmix64(h ^ w)
    real_kv_hash        acc = 0; for each source's fold f: acc = splitmix64(acc ^ f)

A slot's ``prev_hash`` is ``ANCHOR_HASH`` for a request's first token, else
``chain_hash(prev.prev_hash, prev.token, prev.position)`` of its predecessor slot. Note
splitmix64(0) == chain_hash(0, 0, 0) == 0: a never-written (all-zero) record hashes to 0.

Torch has no uint64 multiply, but two's-complement add/mul/xor produce the same bits as
unsigned ones, so int64 tensors carry the exact u64 bit patterns; only right shifts need
care (:func:`_lsr` masks off the sign extension).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir

from kvcanary.canary.wire.constants import CANARY_CHAIN_ANCHOR, SPLITMIX64_MUL1, SPLITMIX64_MUL2

MASK64 = (1 << 64) - 1


def to_u64(x: int) -> int:
    """The unsigned 64-bit value with the bits of ``x`` (two's complement)."""
    return x & MASK64


def to_i64(x: int) -> int:
    """The signed int64 with the bits of ``x``: the form stored in records and rings."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


# ---------------------------------------------------------------- scalar (Python ints, u64 out)


def splitmix64(x: int) -> int:
    x &= MASK64
    x ^= x >> 30
    x = (x * SPLITMIX64_MUL1) & MASK64
    x ^= x >> 27
    x = (x * SPLITMIX64_MUL2) & MASK64
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    h = splitmix64(a)
    h = splitmix64(h ^ (b & MASK64))
    return splitmix64(h ^ (c & MASK64))


def chain_hash(prev_hash: int, token: int, position: int) -> int:
    """The ``prev_hash`` the successor of a slot holding (prev_hash, token, position) stores."""
    return mix3(prev_hash, token, position)


ANCHOR_HASH = splitmix64(CANARY_CHAIN_ANCHOR)
ANCHOR_HASH_I64 = to_i64(ANCHOR_HASH)


def fold_real_kv_bytes(data: bytes) -> int:
    """Fold one source's read window (a multiple of 8 bytes) into a u64."""
    if len(data) % 8:
        raise ValueError(f"real-KV read window must be a multiple of 8 bytes, got {len(data)}")
    h = 0
    for i in range(0, len(data), 8):
        h = splitmix64(h ^ int.from_bytes(data[i : i + 8], "little"))
    return h


def combine_real_kv_folds(folds: Iterable[int]) -> int:
    """Field 3 from the per-source folds (0 for no sources)."""
    acc = 0
    for f in folds:
        acc = splitmix64(acc ^ (f & MASK64))
    return acc


# ---------------------------------------------------------------- torch (int64 tensors, any device)

_MUL1_I64 = to_i64(SPLITMIX64_MUL1)
_MUL2_I64 = to_i64(SPLITMIX64_MUL2)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _lsr(x, 30)
    x = x * _MUL1_I64
    x = x ^ _lsr(x, 27)
    x = x * _MUL2_I64
    return x ^ _lsr(x, 31)


def chain_hash_t(
    prev_hash: torch.Tensor, token: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """Elementwise :func:`chain_hash` on int64 tensors (broadcasting)."""
    h = splitmix64_t(prev_hash)
    h = splitmix64_t(h ^ token)
    return splitmix64_t(h ^ position)


def fold_real_kv_words_t(words: torch.Tensor) -> torch.Tensor:
    """Fold int64 ``[num_entries, num_words]`` little-endian words row-wise into ``[num_entries]``."""
    h = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
    for w in range(words.shape[1]):
        h = splitmix64_t(h ^ words[:, w])
    return h


# ---------------------------------------------------------------- numba (uint64, CPU kernels)

_NB_MUL1 = np.uint64(SPLITMIX64_MUL1)
_NB_MUL2 = np.uint64(SPLITMIX64_MUL2)
ANCHOR_HASH_NB = np.uint64(ANCHOR_HASH)


def splitmix64_ir(builder: Any, x: Any) -> Any:
    """:func:`splitmix64_nb` as LLVM IR on an ``<n x i64>`` vector ``x`` (for numba
    intrinsics: :func:`kvcanary.canary.wire.real_kv._fold_lines_of`)."""
    n = x.type.count

    def splat(value: int) -> ir.Constant:
        return ir.Constant(x.type, [ir.Constant(ir.IntType(64), to_i64(value))] * n)

    x = builder.xor(x, builder.lshr(x, splat(30)))
    x = builder.mul(x, splat(SPLITMIX64_MUL1))
    x = builder.xor(x, builder.lshr(x, splat(27)))
    x = builder.mul(x, splat(SPLITMIX64_MUL2))
    return builder.xor(x, builder.lshr(x, splat(31)))


@numba.njit(cache=True, inline="always")
def splitmix64_nb(x: np.uint64) -> np.uint64:
    x = x ^ (x >> np.uint64(30))
    x = x * _NB_MUL1
    x = x ^ (x >> np.uint64(27))
    x = x * _NB_MUL2
    return x ^ (x >> np.uint64(31))


@numba.njit(cache=True, inline="always")
def chain_hash_nb(prev_hash: np.int64, token: np.int64, position: np.int64) -> np.uint64:
    """:func:`chain_hash` of three int64 record fields (reinterpreted as uint64)."""
    h = splitmix64_nb(np.uint64(prev_hash))
    h = splitmix64_nb(h ^ np.uint64(token))
    return splitmix64_nb(h ^ np.uint64(position))


@numba.njit(cache=True, inline="always")
def fold_real_kv_nb(words: np.ndarray, row: int, first_word: int, num_words: int) -> np.uint64:
    """Fold ``words[row, first_word:first_word + num_words]`` (int64 little-endian words)."""
    h = np.uint64(0)
    for w in range(num_words):
        h = splitmix64_nb(h ^ np.uint64(words[row, first_word + w]))
    return h
