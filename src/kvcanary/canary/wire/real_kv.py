"""Real-KV sources: where a slot's live KV bytes are, and their fingerprint (record field 3).

Addressing of slot ``s`` in a source (``tensor`` is a uint8 view of a live pool buffer)::

    row  = s // page_size
    cols = [(s % page_size) * num_bytes_per_token, ... + read_bytes)

    tensor[row]: | token 0 bytes | token 1 bytes | ... | token ps-1 bytes | (ignored tail) |
                   ^ read_bytes of each token are fingerprinted

A *strided* source (``element_stride != element_size``) holds a token's elements apart, as
a transposed ``[elements, tokens]`` tile does (vLLM's CPU K layout): token ``t`` starts at
byte ``t * num_bytes_per_token`` of its row, its element ``j`` at ``+ j * element_stride``::

    tensor[row]: | e0 t0 | e0 t1 | ... | e0 tps-1 | e1 t0 | e1 t1 | ... |   (element_size each)
                   ^ token 0: read_bytes // element_size elements, element_stride apart

Its fingerprint is the fold of those elements' bytes laid out contiguously (gathered and
packed little-endian into words), so a strided source and a contiguous copy of the gathered
bytes fingerprint alike.

A source must be a *view* of the live pool, never a copy, or the fingerprint checks stale bytes.
Row width, row stride and view offset are multiples of 16 bytes, so the bytes can be read as
little-endian int64 words (:attr:`RealKvSource.words`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvcanary.canary.wire.constants import (
    MAX_REAL_KV_SOURCES,
    REAL_KV_BYTE_ALIGNMENT,
    REAL_KV_PARTIAL_READ_BYTES,
    RealKvHashMode,
)
from kvcanary.canary.wire.hashing import (
    fold_real_kv_words_t,
    splitmix64_ir,
    splitmix64_nb,
    splitmix64_t,
)
from kvcanary.jit.prefetch import array_pointer
from kvcanary.jit.transpose import (
    LANES,
    load_lines,
    transpose_arrays_ok,
    transpose_lines,
    vector_pointer,
)

if sys.byteorder != "little":  # records and word folds are little-endian on the wire
    raise ImportError("kvcanary.canary requires a little-endian host")


@dataclass(frozen=True, slots=True)
class RealKvSource:
    """One live KV buffer folded into field 3 (module doc). Contiguous by default
    (``element_stride == element_size``): byte counts are positive multiples of 16, and a
    page's tokens fit its row. Strided: ``num_bytes_per_token`` (the token stride) and
    ``element_stride`` are multiples of ``element_size``, ``read_bytes`` a positive multiple
    of 16, and the last byte of the last slot of a row is inside the row."""

    tensor: torch.Tensor  # uint8 [num_rows, row_bytes], unit stride along dim 1
    page_size: int
    num_bytes_per_token: int  # the token stride
    read_bytes: int  # effective bytes per slot, see :func:`resolve_read_bytes`
    element_size: int = 8  # bytes of one element (1, 2, 4, 8)
    element_stride: int = 8  # bytes between a token's consecutive elements

    def __post_init__(self) -> None:
        t = self.tensor
        if t.dtype != torch.uint8 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(
                f"real-KV source must be a 2-D uint8 view with unit column stride, got "
                f"dtype={t.dtype} shape={tuple(t.shape)} stride={t.stride()}"
            )
        if self.page_size < 1:
            raise ValueError(f"real-KV source page_size={self.page_size}; allowed: >= 1")
        if self.element_size not in _ELEMENT_SIZES:
            raise ValueError(
                f"real-KV source element_size={self.element_size}; allowed: "
                f"{', '.join(map(str, _ELEMENT_SIZES))}"
            )
        aligned = [("read_bytes", self.read_bytes), ("row stride (bytes)", t.stride(0)),
                   ("row width (bytes)", t.shape[1])]  # fmt: skip
        if not self.strided:
            aligned.insert(0, ("num_bytes_per_token", self.num_bytes_per_token))
        for name, value in aligned:
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
        if self.strided:
            self._check_strided()
            return
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

    def _check_strided(self) -> None:
        es = self.element_size
        for name, value in (("num_bytes_per_token", self.num_bytes_per_token),
                            ("element_stride", self.element_stride)):  # fmt: skip
            if value <= 0 or value % es:
                raise ValueError(
                    f"strided real-KV source {name}={value}; allowed: positive multiples of "
                    f"element_size={es}"
                )
        end = self.slot_end_bytes
        if end > self.tensor.shape[1]:
            raise ValueError(
                f"strided real-KV source reads up to byte {end} of a row (the last slot's "
                f"last element); allowed: at most the row width {self.tensor.shape[1]}"
            )

    @property
    def strided(self) -> bool:
        """Whether a token's elements lie apart (else its read window is contiguous)."""
        return self.element_stride != self.element_size

    @property
    def slot_end_bytes(self) -> int:
        """One past the last byte of a row the last slot of the row reads (strided)."""
        num_elements = self.read_bytes // self.element_size
        return ((self.page_size - 1) * self.num_bytes_per_token
                + (num_elements - 1) * self.element_stride + self.element_size)  # fmt: skip

    def byte_offsets(self, slot: int) -> tuple[int, list[int]]:
        """``(row, columns)``: the bytes of ``slot``'s read window in fold order."""
        row, offset = divmod(slot, self.page_size)
        start = offset * self.num_bytes_per_token
        if not self.strided:
            return row, list(range(start, start + self.read_bytes))
        es = self.element_size
        return row, [start + j * self.element_stride + b
                     for j in range(self.read_bytes // es) for b in range(es)]  # fmt: skip

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[0] * self.page_size

    @property
    def words(self) -> torch.Tensor:
        """int64 ``[num_rows, row_bytes // 8]`` view of the same bytes (little-endian words)."""
        return self.tensor.view(torch.int64)


_ELEMENT_SIZES = (1, 2, 4, 8)


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
        if source.strided:
            words = _gathered_words_t(source, rows, slots - rows * source.page_size)
        else:
            first_word = (slots - rows * source.page_size) * (source.num_bytes_per_token // 8)
            cols = first_word[:, None] + torch.arange(source.read_bytes // 8, device=slots.device)
            words = source.words[rows[:, None], cols]
        acc = splitmix64_t(acc ^ fold_real_kv_words_t(words))
    return acc


def _gathered_words_t(source: RealKvSource, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[len(rows), read_bytes // 8]``: a strided source's read windows (token
    ``offsets`` of ``rows``), their elements gathered contiguously."""
    device, es = rows.device, source.element_size
    elements = torch.arange(source.read_bytes // es, device=device) * source.element_stride
    within = (elements[:, None] + torch.arange(es, device=device)).reshape(-1)
    cols = (offsets * source.num_bytes_per_token)[:, None] + within
    return source.tensor[rows[:, None], cols].view(torch.int64)


_NO_SOURCE = np.zeros((1, 2), dtype=np.int64)
NUM_META_COLUMNS = 5  # numba_source_args's meta

NumbaSourceArgs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]


def numba_source_args(sources: Sequence[RealKvSource]) -> NumbaSourceArgs:
    """``(words0, words1, words2, words3, meta, num_sources)`` for the numba kernels.

    Unused array slots hold a dummy; ``meta[i] = (page_size, num_bytes_per_token,
    read_words, element_size, element_stride)`` (bytes but ``read_words``; strided where the
    last two differ). The arrays share memory with the (CPU) source tensors.
    """
    check_sources(sources)
    arrays = [s.words.numpy() for s in sources]
    arrays += [_NO_SOURCE] * (MAX_REAL_KV_SOURCES - len(arrays))
    meta = np.zeros((MAX_REAL_KV_SOURCES, NUM_META_COLUMNS), dtype=np.int64)
    for i, s in enumerate(sources):
        meta[i] = (s.page_size, s.num_bytes_per_token, s.read_bytes // 8, s.element_size,
                   s.element_stride)  # fmt: skip
    return arrays[0], arrays[1], arrays[2], arrays[3], meta, len(sources)


# Read windows shorter than this many words (128 bytes: partial windows) are folded across
# all of a forward's slots at once, straight from the pool; longer ones through register
# transposes of 8 slots' lines, 4 groups of 8 slots side by side up to 1 KiB, 2 beyond
# (:func:`fold_windows_nb`).
_LINE_MIN_WORDS = 16
_FOUR_GROUPS_MAX_WORDS = 128


def _fold_lines_of(groups: int) -> Any:
    """The intrinsic ``fold_lines(words, rows, cols, word0, chunks, h)``: ``h[k] = fold of
    h[k] over words[rows[k], cols[k] + word0 : ... + 8 * chunks]`` for the ``8 * groups``
    lanes ``k`` (``h``: uint64). Per chunk, one 64-byte line of each lane, a vector load,
    each group's 8 lines transposed in registers (:mod:`kvcanary.jit.transpose`), then 8
    hash steps on each group's vector of 8 chains, the groups' steps interleaved (a chain is
    serial: more of them in flight hide the multiplies' latency). No bounds check (the
    caller's)."""

    def fold_lines(typingctx: Any, words: Any, rows: Any, cols: Any, word0: Any, chunks: Any,
                   h: Any) -> Any:  # fmt: skip
        if not (isinstance(h, types.Array) and h.ndim == 1 and h.dtype == types.uint64
                and isinstance(word0, types.Integer) and isinstance(chunks, types.Integer)
                and transpose_arrays_ok(words, rows, cols)):  # fmt: skip
            return None
        sig = types.void(words, rows, cols, word0, chunks, h)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wty, rty, cty, w0ty, nty, hty = signature.args
            words_v, rows_v, cols_v, w0, n, h_v = args
            intp = context.get_value_type(types.intp)
            vec = ir.VectorType(ir.IntType(64), LANES)
            w0 = context.cast(builder, w0, w0ty, types.intp)
            n = context.cast(builder, n, nty, types.intp)
            lane0 = [ir.Constant(intp, LANES * g) for g in range(groups)]
            h_ptrs = [vector_pointer(builder, array_pointer(context, builder, hty, h_v, [k]), vec)
                      for k in lane0]  # fmt: skip
            states = []
            for ptr in h_ptrs:
                states.append(cgutils.alloca_once(builder, vec))
                builder.store(builder.load(ptr, align=8, typ=vec), states[-1])
            with cgutils.for_range(builder, n) as loop:
                word = builder.add(w0, builder.mul(loop.index, ir.Constant(intp, LANES)))
                columns = [
                    transpose_lines(builder, load_lines(context, builder, (wty, words_v),
                                                        (rty, rows_v), (cty, cols_v), k, word))
                    for k in lane0
                ]  # fmt: skip
                xs = [builder.load(state, typ=vec) for state in states]
                for j in range(LANES):
                    xs = [splitmix64_ir(builder, builder.xor(x, c[j])) for x, c in zip(xs, columns, strict=True)]
                for x, state in zip(xs, states, strict=True):
                    builder.store(x, state)
            for ptr, state in zip(h_ptrs, states, strict=True):
                builder.store(builder.load(state, typ=vec), ptr, align=8)
            return context.get_dummy_value()

        return sig, codegen

    fold_lines.__name__ = fold_lines.__qualname__ = f"_fold_lines{groups}"
    return intrinsic(fold_lines)


_fold_lines2 = _fold_lines_of(2)
_fold_lines4 = _fold_lines_of(4)


@numba.njit(cache=True, inline="always")
def _log2(x):
    """log2 of a power of two."""
    k = 0
    while (1 << k) < x:
        k += 1
    return k


@numba.njit(cache=True, inline="always")
def _fold_into(acc, slots, h, b0, m):
    """``acc[b0 + i] = splitmix64(acc[b0 + i] ^ h[i])`` for ``i < m`` whose slot is >= 0."""
    for i in range(m):
        folded = np.int64(splitmix64_nb(np.uint64(acc[b0 + i]) ^ h[i]))
        acc[b0 + i] = folded if slots[b0 + i] >= 0 else acc[b0 + i]


@numba.njit(cache=True)
def _fold_source(acc, slots, words, meta_row):
    """``acc[i] = splitmix64(acc[i] ^ fold of slot i's read window)`` for slots >= 0
    (``meta_row``: the source's row of :func:`numba_source_args`'s meta)."""
    n = slots.shape[0]
    hi = np.int64(-1)
    for i in range(n):
        hi = max(hi, slots[i])
    page_size, token_bytes, read_words = meta_row[0], meta_row[1], meta_row[2]
    element_size, element_stride = meta_row[3], meta_row[4]
    _check_range(hi, words, page_size)
    if element_stride == element_size:
        h = fold_windows_nb(slots, words, page_size, token_bytes // 8, read_words)
    else:
        h = fold_strided_nb(slots, words, page_size, token_bytes, read_words, element_size,
                            element_stride)  # fmt: skip
    _fold_into(acc, slots, h, 0, n)


@numba.njit(cache=True)
def fold_strided_nb(slots, words, page_size, token_bytes, read_words, element_size,
                    element_stride):  # fmt: skip
    """uint64 ``[len(slots)]``: the fold of each slot's strided read window (module doc:
    ``read_words * 8 // element_size`` elements from byte ``(slot % page_size) *
    token_bytes`` of row ``slot // page_size``, ``element_stride`` apart), packed
    little-endian into words as if contiguous. A negative slot reads slot 0's; unchecked.

    Word by word across all the slots (like :func:`fold_windows_nb`'s short windows): each
    element is cut from the int64 word holding it (elements never straddle words: offsets
    are multiples of the element size, rows start on 16 bytes). A partial window of 4- or
    2-byte elements (two words) goes through :func:`_fold_strided_pair` instead."""
    n = slots.shape[0]
    h = np.zeros(n, dtype=np.uint64)
    rows = np.empty(n, dtype=np.int64)
    starts = np.empty(n, dtype=np.int64)
    if page_size & (page_size - 1) == 0:  # a shift and a mask: the loop vectorises
        shift, mask = _log2(page_size), page_size - 1
        for i in range(n):
            slot = max(slots[i], 0)
            rows[i] = slot >> shift
            starts[i] = (slot & mask) * token_bytes
    else:
        for i in range(n):
            slot = max(slots[i], 0)
            rows[i] = slot // page_size
            starts[i] = (slot % page_size) * token_bytes
    if read_words == 2 and (element_size == 4 or element_size == 2):
        return _fold_strided_pair(words, rows, starts, element_size, element_stride, h)
    per_word = 8 // element_size
    bits = np.uint64(8 * element_size)
    top = np.uint64(64) - bits
    word = np.empty(n, dtype=np.uint64)
    for w in range(read_words):
        for i in range(n):
            word[i] = 0
        for k in range(per_word):
            offset = (w * per_word + k) * element_stride
            place = np.uint64(k) * bits
            for i in range(n):
                b = starts[i] + offset
                x = np.uint64(words[rows[i], b >> 3])
                # the element's bits to the top (drops those above it), then down to `place`
                x = (x << (top - np.uint64((b & 7) * 8))) >> top
                word[i] |= x << place
        for i in range(n):
            h[i] = splitmix64_nb(h[i] ^ word[i])
    return h


@numba.njit(cache=True)
def _fold_strided_pair(words, rows, starts, element_size, element_stride, h):
    """:func:`fold_strided_nb` of two-word windows (``partial``) of 4- or 2-byte elements
    (4 or 8 elements a slot) into ``h``: the elements read through a view of that size
    (no shift and mask to cut them out), a slot's two words built in one pass, then hashed
    in a loop that vectorises. vLLM's CPU K layout (fp32, 32-slot pages), 2448 slots on
    AVX2: 27.7 -> 15.6 us warm, 39 -> 27 us cache-cold, against the word-by-word passes."""
    n = rows.shape[0]
    lo = np.empty(n, dtype=np.uint64)
    hi = np.empty(n, dtype=np.uint64)
    if element_size == 4:
        v32, q = words.view(np.uint32), element_stride >> 2
        for i in range(n):
            r, c = rows[i], starts[i] >> 2
            lo[i] = np.uint64(v32[r, c]) | (np.uint64(v32[r, c + q]) << np.uint64(32))
            hi[i] = np.uint64(v32[r, c + 2 * q]) | (np.uint64(v32[r, c + 3 * q]) << np.uint64(32))
    else:
        v16, q = words.view(np.uint16), element_stride >> 1
        for i in range(n):
            r, c = rows[i], starts[i] >> 1
            lo[i] = (np.uint64(v16[r, c]) | (np.uint64(v16[r, c + q]) << np.uint64(16))
                     | (np.uint64(v16[r, c + 2 * q]) << np.uint64(32))
                     | (np.uint64(v16[r, c + 3 * q]) << np.uint64(48)))  # fmt: skip
            hi[i] = (np.uint64(v16[r, c + 4 * q]) | (np.uint64(v16[r, c + 5 * q]) << np.uint64(16))
                     | (np.uint64(v16[r, c + 6 * q]) << np.uint64(32))
                     | (np.uint64(v16[r, c + 7 * q]) << np.uint64(48)))  # fmt: skip
    for i in range(n):
        h[i] = splitmix64_nb(splitmix64_nb(h[i] ^ lo[i]) ^ hi[i])
    return h


@numba.njit(cache=True)
def fold_windows_nb(slots, words, page_size, words_per_token, read_words):
    """uint64 ``[len(slots)]``: the fold of each slot's read window, ``words[slot //
    page_size, (slot % page_size) * words_per_token :][:read_words]`` (a negative slot reads
    slot 0's; unchecked: the caller keeps every slot inside ``words``).

    A slot's fold is a serial chain (one hash step per word), so the work vectorises across
    slots. Windows shorter than 128 bytes (every partial window) are folded by passes that
    gather two words of every slot straight from the pool and hash them in a loop across
    all the slots. Longer ones go through :func:`_fold_lines_of`'s intrinsics, 32 slots at
    a time up to 1 KiB, 16 beyond: per 64-byte line of each slot one vector load, each 8
    slots' lines transposed in registers, the groups' hash chains interleaved. One core,
    against those passes and (over 512 bytes) a word-major tile the rows were copied into
    element by element: 256-byte rows (tiny presets), 6000 random slots 1.4-1.6x faster,
    200 1.0-1.2x; 512-byte rows 2.2x / 1.3x; 4 KiB rows (qwen3-0.6b-shape), 3200 slots
    from DRAM 3.5 -> 12 GB/s, 32 slots in cache 7.2 -> 15 GB/s (the tile's copy, each store
    to another cache line, cost twice the hashing). Over 1 KiB two groups, not four: 32 lines
    4 KiB apart at a time share L1 sets. The words past the last whole line (windows are
    multiples of 16 bytes) go one at a time. ``read_words`` is even.
    """
    n = slots.shape[0]
    h = np.zeros(n, dtype=np.uint64)
    if read_words < _LINE_MIN_WORDS:
        lo_words = np.empty(n, dtype=np.uint64)
        hi_words = np.empty(n, dtype=np.uint64)
        for w in range(0, read_words, 2):
            if page_size == 1:  # the usual layout: no division
                for i in range(n):
                    row = max(slots[i], 0)
                    lo_words[i], hi_words[i] = words[row, w], words[row, w + 1]
            elif page_size & (page_size - 1) == 0:  # a shift and a mask: the loop vectorises
                shift, mask = _log2(page_size), page_size - 1
                for i in range(n):
                    slot = max(slots[i], 0)
                    row, col = slot >> shift, (slot & mask) * words_per_token + w
                    lo_words[i], hi_words[i] = words[row, col], words[row, col + 1]
            else:
                for i in range(n):
                    slot = max(slots[i], 0)
                    row, col = slot // page_size, (slot % page_size) * words_per_token + w
                    lo_words[i], hi_words[i] = words[row, col], words[row, col + 1]
            for i in range(n):
                h[i] = splitmix64_nb(splitmix64_nb(h[i] ^ lo_words[i]) ^ hi_words[i])
        return h
    four = read_words <= _FOUR_GROUPS_MAX_WORDS
    width = LANES * (4 if four else 2)
    rows = np.empty(width, dtype=np.int64)
    cols = np.empty(width, dtype=np.int64)
    lanes = np.empty(width, dtype=np.uint64)
    whole = read_words // LANES
    for b0 in range(0, n, width):
        m = min(width, n - b0)
        for i in range(width):  # lanes past the last slot repeat it (their folds unused)
            slot = max(slots[b0 + min(i, m - 1)], 0)
            rows[i], cols[i] = slot // page_size, (slot % page_size) * words_per_token
            lanes[i] = 0
        if four:
            _fold_lines4(words, rows, cols, 0, whole, lanes)
        else:
            _fold_lines2(words, rows, cols, 0, whole, lanes)
        for w in range(whole * LANES, read_words):
            for i in range(width):
                lanes[i] = splitmix64_nb(lanes[i] ^ np.uint64(words[rows[i], cols[i] + w]))
        for i in range(m):  # (a loop: a slice copy compiles numba's shape-mismatch error path)
            h[b0 + i] = lanes[i]
    return h


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


@numba.njit(cache=True)
def real_kv_hashes_nb(slots, words0, words1, words2, words3, meta, num_sources):
    """numba: field 3 for every slot (0 for negative slots), one pass per source (the
    arguments of :func:`numba_source_args`).

    Per-source passes keep array arguments out of the per-entry loop (a call per entry that
    passes arrays costs reference-count traffic that dominated the kernel).
    """
    acc = np.zeros(slots.shape[0], dtype=np.int64)
    if num_sources > 0:
        _fold_source(acc, slots, words0, meta[0])
    if num_sources > 1:
        _fold_source(acc, slots, words1, meta[1])
    if num_sources > 2:
        _fold_source(acc, slots, words2, meta[2])
    if num_sources > 3:
        _fold_source(acc, slots, words3, meta[3])
    return acc
