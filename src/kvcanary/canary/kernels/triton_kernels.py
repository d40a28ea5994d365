"""Triton canary kernels: verify and write on CUDA (and on CPU tensors when the kernels were
imported under ``TRITON_INTERPRET=1``, which is how the tests run them).

Semantics are those of :mod:`kvcanary.canary.kernels.dispatch` (the contract), bit for bit, ring rows
in the same order: each launch is a fixed sequence of kernels with no host read in between,
and the ring is filled by a prefix sum, never by racing atomics::

    verify  V1  grid: entry blocks   fail bits + expected chain per entry; violations per block
            V1r grid: entry blocks   (reader_chain with check_token) the reader chain: each
                                     segment's tail after its origin, walked in order by the
                                     program holding the origin (:mod:`.torch_kernels`
                                     defines segments, origins and tails); its new
                                     violations added to their blocks' counts
            V2  one program          each block's first ring row; write_index; run counters
            V3  grid: entry blocks   the ring rows of blocks that have violations
    write   W0  one program          each request's first entry; token-range and seed checks
            W1  grid: requests       slot checks; real-KV fingerprints; last-writer marks
            W2  grid: requests       the chain of every request whose seed no token of this
                                     launch stores (nearly all): seed read, serial walk
            W3  one program          the other requests, in order (their seed is that store);
                                     each request's first ring row; write_index; run counters
            W4  grid: requests       ring rows; the stores (only a slot's last writer stores)

Why the last-writer marks: requests run in parallel, but the contract is sequential (a
later token's store to a slot wins; a request's seed is read after earlier requests'
stores). W1 ``atomic_max``-es each token's sequential key ``request * num_flat_tokens +
j`` into a per-device ``int64`` scratch over slots (all -1 between launches), so exactly
one token per slot stores in W4, and a seed whose slot holds a mark is one this launch
stores to (a remapped entry), which W3 resolves in request order.

Out-of-range indices (a slot outside the canary buffer or a real-KV source, a token range
outside the flat arrays) are never dereferenced: they set a per-device status word, every
state-changing kernel (V2, V3, W3, W4) does nothing while it is set, and the Python wrapper
reads it after the launch and raises ``IndexError``, leaving records, ring and counters as
they were. That read is a host sync on CUDA; inside CUDA-graph capture it is skipped and the
status stays set (later launches do nothing) until an eager launch reads and raises it.

64-bit hashing: int64 record fields are bitcast to ``uint64``, whose multiply wraps and whose
right shift is logical, so splitmix64 is the textbook one (:mod:`.hashing`). Integer scalar
arguments are not value-specialised (``do_not_specialize``): a batch of one or a count
divisible by 16 compiles no extra variant.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvcanary.canary.plan.types import VerifyPlan, WritePlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    MAX_REAL_KV_SOURCES,
    NUM_LAUNCH_TAGS,
    SPLITMIX64_MUL1,
    SPLITMIX64_MUL2,
    VIOLATION_ROW_FIELDS,
    FailReason,
)
from kvcanary.canary.wire.hashing import ANCHOR_HASH_I64
from kvcanary.canary.wire.real_kv import RealKvSource, check_sources
from kvcanary.canary.wire.records import as_int64_records

_MUL1 = tl.constexpr(SPLITMIX64_MUL1)
_MUL2 = tl.constexpr(SPLITMIX64_MUL2)
_ANCHOR = tl.constexpr(ANCHOR_HASH_I64)
_F_TOKEN = tl.constexpr(CANARY_FIELD_TOKEN)
_F_POSITION = tl.constexpr(CANARY_FIELD_POSITION)
_F_CHAIN = tl.constexpr(CANARY_FIELD_PREV_HASH)
_F_REAL = tl.constexpr(CANARY_FIELD_REAL_KV_HASH)
_ROW = tl.constexpr(VIOLATION_ROW_FIELDS)
_V_CHAIN = tl.constexpr(int(FailReason.VERIFY_CHAIN_HASH_MISMATCH))
_V_POSITION = tl.constexpr(int(FailReason.VERIFY_POSITION_MISMATCH))
_V_REAL = tl.constexpr(int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
_V_TOKEN = tl.constexpr(int(FailReason.VERIFY_TOKEN_MISMATCH))
# Bits that say a slot holds another history than the reader's (the reader chain).
_V_HISTORY = tl.constexpr(int(FailReason.VERIFY_CHAIN_HASH_MISMATCH
                              | FailReason.VERIFY_TOKEN_MISMATCH
                              | FailReason.VERIFY_POSITION_MISMATCH))
_W_TOKEN = tl.constexpr(int(FailReason.WRITE_TOKEN_MISMATCH))
_W_POSITION = tl.constexpr(int(FailReason.WRITE_POSITION_MISMATCH))
_W_INPUT = tl.constexpr(int(FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH))
# A write entry's scratch flags: its input-assert bits, plus this bit (no fail reason uses
# bit 0 in write rows) when the chain-position assert adds a second row.
_POSITION_ROW = tl.constexpr(1)
_META = tl.constexpr(7)  # per-source metadata columns (see _source_args)
# Status word bits (the wrapper raises on any).
ERR_INDEX, ERR_PLAN_TOTAL = 1, 2
_ERR_INDEX = tl.constexpr(ERR_INDEX)
_ERR_PLAN_TOTAL = tl.constexpr(ERR_PLAN_TOTAL)

_BLOCK = 256  # entries (verify) / tokens (write) per vector step
_SCAN_BLOCK = 1024  # rows of a one-program prefix sum per step


# ------------------------------------------------------------------ hashing (uint64 bits)


@triton.jit
def _splitmix64(x):
    """splitmix64's finaliser on uint64 (wrapping multiply, logical shifts)."""
    x = x ^ (x >> 30)
    x = x * _MUL1
    x = x ^ (x >> 27)
    x = x * _MUL2
    return x ^ (x >> 31)


@triton.jit
def _chain_hash(prev_hash, token, position):
    """:func:`.hashing.chain_hash` of int64 fields; int64 bits out."""
    h = _splitmix64(prev_hash.to(tl.uint64, bitcast=True))
    h = _splitmix64(h ^ token.to(tl.uint64, bitcast=True))
    return _splitmix64(h ^ position.to(tl.uint64, bitcast=True)).to(tl.int64, bitcast=True)


@triton.jit
def _fold_source(acc, bad, slots, ok, words, meta, i: tl.constexpr):
    """``acc = splitmix64(acc ^ fold of the slot's read window)`` where ``ok``; ``bad`` marks
    ``ok`` slots past the source's rows (never read). A strided source's elements are cut
    from the words holding them and packed into words as if contiguous (:mod:`.real_kv`)."""
    page_size = tl.load(meta + i * _META + 0)
    token_bytes = tl.load(meta + i * _META + 1)
    read_words = tl.load(meta + i * _META + 2)
    row_stride = tl.load(meta + i * _META + 3)
    num_rows = tl.load(meta + i * _META + 4)
    element_size = tl.load(meta + i * _META + 5)
    element_stride = tl.load(meta + i * _META + 6)
    rows = slots // page_size
    out = ok & (rows >= num_rows)
    live = ok & (rows < num_rows)
    row0 = rows * row_stride
    start = (slots - rows * page_size) * token_bytes
    h = tl.zeros_like(acc)
    if element_stride == element_size:
        first = row0 + start // 8
        for w in range(0, read_words):
            word = tl.load(words + first + w, mask=live, other=0)
            h = _splitmix64(h ^ word.to(tl.uint64, bitcast=True))
    else:
        per_word = 8 // element_size
        top = (64 - 8 * element_size).to(tl.uint64)
        for w in range(0, read_words):
            packed = tl.zeros_like(acc)
            for k in range(0, per_word):
                b = start + (w * per_word + k) * element_stride
                x = tl.load(words + row0 + b // 8, mask=live, other=0).to(tl.uint64, bitcast=True)
                x = (x << (top - ((b % 8) * 8).to(tl.uint64))) >> top
                packed = packed | (x << (k * 8 * element_size).to(tl.uint64))
            h = _splitmix64(h ^ packed)
    return tl.where(live, _splitmix64(acc ^ h), acc), bad | out


@triton.jit
def _real_kv_hash(slots, ok, w0, w1, w2, w3, meta, NUM_SOURCES: tl.constexpr):
    """Field 3 of each ``ok`` slot (int64; 0 without sources) and which slots fell outside
    a source."""
    acc = tl.zeros(slots.shape, tl.uint64)
    bad = slots != slots  # all False
    safe = tl.where(ok, slots, 0)
    if NUM_SOURCES > 0:
        acc, bad = _fold_source(acc, bad, safe, ok, w0, meta, 0)
    if NUM_SOURCES > 1:
        acc, bad = _fold_source(acc, bad, safe, ok, w1, meta, 1)
    if NUM_SOURCES > 2:
        acc, bad = _fold_source(acc, bad, safe, ok, w2, meta, 2)
    if NUM_SOURCES > 3:
        acc, bad = _fold_source(acc, bad, safe, ok, w3, meta, 3)
    return acc.to(tl.int64, bitcast=True), bad


@triton.jit
def _flag_error(status, num_bad, code: tl.constexpr):
    if num_bad > 0:
        tl.atomic_or(status, code)


@triton.jit
def _scan_ring_offsets(counts, n, base, ring_index, BLOCK: tl.constexpr):
    """``base[i] = write_index + sum(counts[:i])``; ``write_index += sum(counts)``."""
    carry = tl.load(ring_index)
    for b0 in range(0, n, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        m = offs < n
        c = tl.load(counts + offs, mask=m, other=0)
        tl.store(base + offs, carry + tl.cumsum(c, 0) - c, mask=m)
        carry += tl.sum(c, 0)
    tl.store(ring_index, carry)


@triton.jit
def _bump_counters(runs, processed, tag, num_processed, HAS_COUNTERS: tl.constexpr):
    if HAS_COUNTERS:
        tl.store(runs + tag, tl.load(runs + tag) + 1)
        tl.store(processed + tag, tl.load(processed + tag) + num_processed)


# ------------------------------------------------------------------ verify


@triton.jit(do_not_specialize=["n", "rec_stride", "num_slots"])
def _verify_entries(
    slots_ptr, prev_ptr, positions_ptr, tokens_ptr, n, rec, rec_stride, num_slots,
    w0, w1, w2, w3, meta, bits_ptr, chain_ptr, counts_ptr, status,
    CHECK_TOKEN: tl.constexpr, NUM_SOURCES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """V1: fail bits and expected chain of each entry; violations per block."""
    n = tl.cast(n, tl.int64)
    b = tl.program_id(0).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    slot = tl.load(slots_ptr + offs, mask=m, other=0)
    prev = tl.load(prev_ptr + offs, mask=m, other=0)
    live = m & (slot != 0)
    bad = live & ((slot < 0) | (slot >= num_slots) | ((prev > 0) & (prev >= num_slots)))
    ok = live & ~bad
    cur = rec + tl.where(ok, slot, 0) * rec_stride
    token = tl.load(cur + _F_TOKEN, mask=ok, other=0)
    position = tl.load(cur + _F_POSITION, mask=ok, other=0)
    stored_chain = tl.load(cur + _F_CHAIN, mask=ok, other=0)
    stored_real = tl.load(cur + _F_REAL, mask=ok, other=0)
    has_prev = ok & (prev > 0)
    pre = rec + tl.where(has_prev, prev, 0) * rec_stride
    prev_hash = _chain_hash(
        tl.load(pre + _F_CHAIN, mask=has_prev, other=0),
        tl.load(pre + _F_TOKEN, mask=has_prev, other=0),
        tl.load(pre + _F_POSITION, mask=has_prev, other=0),
    )
    expected_chain = tl.where(prev == 0, stored_chain, tl.where(prev < 0, _ANCHOR, prev_hash))
    if CHECK_TOKEN:
        expected_token = tl.load(tokens_ptr + offs, mask=m, other=-1)
    else:
        expected_token = tl.full(slot.shape, -1, tl.int64)
    expected_real, bad_source = _real_kv_hash(slot, ok, w0, w1, w2, w3, meta, NUM_SOURCES)
    bits = tl.where((prev != 0) & (stored_chain != expected_chain), _V_CHAIN, 0).to(tl.int64)
    bits |= tl.where((expected_token != -1) & (token != expected_token), _V_TOKEN, 0)
    bits |= tl.where(position != tl.load(positions_ptr + offs, mask=m, other=0), _V_POSITION, 0)
    bits |= tl.where(stored_real != expected_real, _V_REAL, 0)
    bits = tl.where(ok, bits, 0)
    tl.store(bits_ptr + offs, bits, mask=m)
    tl.store(chain_ptr + offs, expected_chain, mask=m)
    tl.store(counts_ptr + b, tl.sum((bits != 0).to(tl.int64), 0))
    _flag_error(status, tl.sum((bad | bad_source).to(tl.int32), 0), _ERR_INDEX)


@triton.jit
def _segment_starts(slots_ptr, prev_ptr, tokens_ptr, i, n):
    """Whether entry ``i`` (scalar or block) starts a reader-chain segment: it is not linked
    to the entry before it (``prev_slot > 0`` is that entry's slot), or that entry's token
    is not checked."""
    inner = (i > 0) & (i < n)
    at = tl.where(inner, i, 1)
    slot = tl.load(slots_ptr + at, mask=inner, other=0)
    prev = tl.load(prev_ptr + at, mask=inner, other=0)
    before = tl.load(slots_ptr + at - 1, mask=inner, other=0)
    before_token = tl.load(tokens_ptr + at - 1, mask=inner, other=-1)
    return ~(inner & (slot != 0) & (prev > 0) & (prev == before) & (before_token != -1))


@triton.jit
def _fails_checked(bits_ptr, tokens_ptr, i, m):
    """Whether entry ``i`` (where ``m``) has a checked token and fails a history check."""
    token = tl.load(tokens_ptr + i, mask=m, other=-1)
    bits = tl.load(bits_ptr + i, mask=m, other=0)
    return m & (token != -1) & ((bits & _V_HISTORY) != 0)


@triton.jit
def _is_origin(o, slots_ptr, prev_ptr, tokens_ptr, bits_ptr, n, BLOCK: tl.constexpr):
    """Whether no entry before failing checked entry ``o`` in its segment fails a history
    check with a checked token (a scan back, a block at a time, to the segment's start).
    Another origin's walk may add bits meanwhile, but only after that origin in its own
    segment, where the answer is False either way."""
    found = tl.zeros([], tl.int32)
    done = _segment_starts(slots_ptr, prev_ptr, tokens_ptr, o, n).to(tl.int32)
    hi = o
    while done == 0:
        lo = tl.maximum(hi - BLOCK, 0)
        offs = lo + tl.arange(0, BLOCK)
        m = offs < hi
        # entries up to the last one whose successor starts a segment are not in o's
        cut = m & _segment_starts(slots_ptr, prev_ptr, tokens_ptr, offs + 1, n)
        last_cut = tl.max(tl.where(cut, offs, -1), 0)
        inside = m & (offs > last_cut)
        found = tl.sum(_fails_checked(bits_ptr, tokens_ptr, offs, inside).to(tl.int32), 0)
        done = ((found > 0) | (last_cut >= 0) | (lo == 0)).to(tl.int32)
        hi = lo
    return found == 0


@triton.jit(do_not_specialize=["n", "rec_stride"])
def _verify_reader_chains(
    slots_ptr, prev_ptr, positions_ptr, tokens_ptr, n, rec, rec_stride, bits_ptr, chain_ptr,
    counts_ptr, status, BLOCK: tl.constexpr,
):  # fmt: skip
    """V1r: the reader chain over the tails of the segments whose origin is in this block:
    each tail entry whose stored chain is not the reader's (and that passed the stored
    chain check) fails ``verify_chain_hash`` with the reader's chain as its expected chain."""
    n = tl.cast(n, tl.int64)
    b = tl.program_id(0).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    candidates = _fails_checked(bits_ptr, tokens_ptr, offs, offs < n)
    if (tl.load(status) == 0) & (tl.sum(candidates.to(tl.int32), 0) > 0):
        for k in range(0, BLOCK):
            o = b * BLOCK + k
            # (nested: Triton has no short-circuit `and`, and the scan back is only for these)
            if _fails_checked(bits_ptr, tokens_ptr, o, o < n):  # noqa: SIM102
                if _is_origin(o, slots_ptr, prev_ptr, tokens_ptr, bits_ptr, n, BLOCK):
                    # the origin's expected chain is the reader's before it (by induction)
                    reader = _chain_hash(tl.load(chain_ptr + o), tl.load(tokens_ptr + o),
                                         tl.load(positions_ptr + o))  # fmt: skip
                    j = o + 1
                    go = ~_segment_starts(slots_ptr, prev_ptr, tokens_ptr, j, n)
                    while go:
                        stored = tl.load(rec + tl.load(slots_ptr + j) * rec_stride + _F_CHAIN)
                        bits = tl.load(bits_ptr + j)
                        fire = ((bits & _V_CHAIN) == 0) & (stored != reader)
                        tl.store(bits_ptr + j, bits | _V_CHAIN, mask=fire)
                        tl.store(chain_ptr + j, reader, mask=fire)
                        tl.atomic_add(counts_ptr + j // BLOCK, 1, mask=fire & (bits == 0))
                        reader = _chain_hash(reader, tl.load(tokens_ptr + j),
                                             tl.load(positions_ptr + j))  # fmt: skip
                        j += 1
                        go = ~_segment_starts(slots_ptr, prev_ptr, tokens_ptr, j, n)


@triton.jit(do_not_specialize=["num_blocks", "tag", "num_entries"])
def _verify_offsets(
    counts, num_blocks, base, ring_index, status, runs, processed, tag, num_entries,
    HAS_COUNTERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """V2: each block's first ring row; write_index; run counters."""
    if tl.load(status) == 0:
        _scan_ring_offsets(counts, tl.cast(num_blocks, tl.int64), base, ring_index, BLOCK)
        _bump_counters(runs, processed, tag, tl.cast(num_entries, tl.int64), HAS_COUNTERS)


@triton.jit(do_not_specialize=["n", "rec_stride", "capacity", "tag"])
def _verify_rows(
    slots_ptr, tokens_ptr, n, rec, rec_stride, bits_ptr, chain_ptr, counts, base, status,
    ring, capacity, tag, CHECK_TOKEN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """V3: ring rows of a block's violating entries, in entry order."""
    n = tl.cast(n, tl.int64)
    b = tl.program_id(0).to(tl.int64)
    if (tl.load(status) == 0) & (tl.load(counts + b) > 0):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        bits = tl.load(bits_ptr + offs, mask=m, other=0)
        flag = (bits != 0).to(tl.int64)
        seq = tl.load(base + b) + tl.cumsum(flag, 0) - flag
        keep = (flag != 0) & (seq < capacity)
        slot = tl.load(slots_ptr + offs, mask=keep, other=0)
        cur = rec + slot * rec_stride
        if CHECK_TOKEN:
            expected_token = tl.load(tokens_ptr + offs, mask=keep, other=-1)
        else:
            expected_token = tl.full(slot.shape, -1, tl.int64)
        row = ring + seq * _ROW
        tl.store(row + 0, tl.full(slot.shape, 0, tl.int64) + tag, mask=keep)
        tl.store(row + 1, slot, mask=keep)
        tl.store(row + 2, tl.load(cur + _F_POSITION, mask=keep, other=0), mask=keep)
        tl.store(row + 3, tl.load(cur + _F_TOKEN, mask=keep, other=0), mask=keep)
        tl.store(row + 4, expected_token, mask=keep)
        tl.store(row + 5, tl.load(cur + _F_CHAIN, mask=keep, other=0), mask=keep)
        tl.store(row + 6, tl.load(chain_ptr + offs, mask=keep, other=0), mask=keep)
        tl.store(row + 7, bits, mask=keep)


# ------------------------------------------------------------------ write


@triton.jit(do_not_specialize=["bs", "num_flat", "num_slots", "entry_capacity"])
def _write_requests(
    seeds, starts, counts, bs, num_flat, num_slots, first_entry, entry_capacity, status,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """W0: each request's first entry (exclusive prefix sum of its token count); the checks
    of token ranges and seeds."""
    bs = tl.cast(bs, tl.int64)
    num_flat = tl.cast(num_flat, tl.int64)
    carry = tl.zeros([], tl.int64)
    num_bad = tl.zeros([], tl.int32)
    for r0 in range(0, bs, BLOCK):
        offs = r0 + tl.arange(0, BLOCK)
        m = offs < bs
        count = tl.load(counts + offs, mask=m, other=0)
        count = tl.where(count > 0, count, 0)
        start = tl.load(starts + offs, mask=m, other=0)
        seed = tl.load(seeds + offs, mask=m, other=-1)
        bad = (count > 0) & ((start < 0) | (start + count > num_flat))
        bad |= seed >= num_slots
        tl.store(first_entry + offs, carry + tl.cumsum(count, 0) - count, mask=m)
        carry += tl.sum(count, 0)
        num_bad += tl.sum(bad.to(tl.int32), 0)
    _flag_error(status, num_bad, _ERR_INDEX)
    _flag_error(status, (carry > entry_capacity).to(tl.int32), _ERR_PLAN_TOTAL)


@triton.jit
def _token_range(r, starts, counts, first_entry, num_flat, num_entries):
    """(first flat token, token count, first entry) of request ``r``; count 0 for a range
    W0 flagged (outside the flat arrays or the entry scratch)."""
    count = tl.load(counts + r)
    start = tl.load(starts + r)
    first = tl.load(first_entry + r)
    valid = (count > 0) & (start >= 0) & (start + count <= num_flat)
    valid &= first + count <= num_entries
    return start, tl.where(valid, count, 0), first


@triton.jit(do_not_specialize=["num_flat", "num_entries", "num_slots"])
def _write_marks(
    slots_ptr, starts, counts, first_entry, num_flat, num_entries, num_slots, last, real_ptr,
    active_ptr, status, w0, w1, w2, w3, meta, NUM_SOURCES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """W1: slot checks, real-KV fingerprints, last-writer marks of request ``r``."""
    r = tl.program_id(0).to(tl.int64)
    num_flat = tl.cast(num_flat, tl.int64)
    start, count, first = _token_range(r, starts, counts, first_entry, num_flat, num_entries)
    num_active = tl.zeros([], tl.int64)
    num_bad = tl.zeros([], tl.int32)
    for j0 in range(0, count, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < count
        slot = tl.load(slots_ptr + start + j, mask=m, other=-1)
        active = m & (slot >= 0)
        ok = active & (slot < num_slots)
        real, bad_source = _real_kv_hash(slot, ok, w0, w1, w2, w3, meta, NUM_SOURCES)
        tl.store(real_ptr + first + j, real, mask=m)
        tl.atomic_max(last + tl.where(ok, slot, 0), r * num_flat + j, mask=ok)
        num_active += tl.sum(active.to(tl.int64), 0)
        num_bad += tl.sum(((active & ~ok) | bad_source).to(tl.int32), 0)
    tl.store(active_ptr + r, num_active)
    _flag_error(status, num_bad, _ERR_INDEX)


@triton.jit
def _walk_chain(
    r, start, count, first, running, prev_position, armed, slots_ptr, ids_ptr, positions_ptr,
    expected_ids, expected_positions, chain_ptr, aux_ptr, flags_ptr, rows_ptr,
    CHECK_INPUTS: tl.constexpr,
):  # fmt: skip
    """Request ``r``'s tokens in order from its seed's chain hash and position: each active
    entry's running hash and assert flags (scratch), and the request's ring-row count."""
    num_rows = tl.zeros([], tl.int64)
    for j in range(0, count):
        t = start + j
        slot = tl.load(slots_ptr + t)
        flags = tl.zeros([], tl.int64)
        if slot >= 0:
            token = tl.load(ids_ptr + t)
            position = tl.load(positions_ptr + t)
            if CHECK_INPUTS:
                flags |= tl.where(token != tl.load(expected_ids + t), _W_TOKEN, 0)
                flags |= tl.where(position != tl.load(expected_positions + t), _W_POSITION, 0)
            tl.store(aux_ptr + first + j, prev_position + 1)
            if armed:
                flags |= tl.where(position != prev_position + 1, _POSITION_ROW, 0)
                prev_position = position
            tl.store(chain_ptr + first + j, running)
            running = _chain_hash(running, token, position)
        tl.store(flags_ptr + first + j, flags)
        num_rows += ((flags & _W_INPUT) != 0).to(tl.int64) + (flags & _POSITION_ROW)
    tl.store(rows_ptr + r, num_rows)


@triton.jit
def _seed_state(seed, rec, rec_stride):
    """(chain hash, position) a request starts from: the anchor, or its seed's record."""
    has_seed = seed >= 0
    cur = rec + tl.where(has_seed, seed, 0) * rec_stride
    token = tl.load(cur + _F_TOKEN, mask=has_seed, other=0)
    position = tl.load(cur + _F_POSITION, mask=has_seed, other=0)
    chain = tl.load(cur + _F_CHAIN, mask=has_seed, other=0)
    return tl.where(has_seed, _chain_hash(chain, token, position), _ANCHOR), position


@triton.jit(
    do_not_specialize=["num_flat", "num_entries", "num_slots", "rec_stride", "position_assert"]
)
def _write_chains(
    seeds, starts, counts, first_entry, num_flat, num_entries, num_slots, last, rec, rec_stride,
    slots_ptr, ids_ptr, positions_ptr, expected_ids, expected_positions, position_assert,
    chain_ptr, aux_ptr, flags_ptr, rows_ptr, CHECK_INPUTS: tl.constexpr,
):  # fmt: skip
    """W2: request ``r``'s chain, unless this launch stores to its seed (W3 does it then)."""
    r = tl.program_id(0).to(tl.int64)
    start, count, first = _token_range(r, starts, counts, first_entry,
                                       tl.cast(num_flat, tl.int64), num_entries)
    seed = tl.load(seeds + r)
    seed_ok = seed < num_slots
    marked = tl.load(last + tl.where((seed >= 0) & seed_ok, seed, 0), mask=seed >= 0, other=-1)
    if seed_ok & (marked < 0):
        running, prev_position = _seed_state(seed, rec, rec_stride)
        _walk_chain(
            r, start, count, first, running, prev_position, (position_assert != 0) & (seed >= 0),
            slots_ptr, ids_ptr, positions_ptr, expected_ids, expected_positions, chain_ptr,
            aux_ptr, flags_ptr, rows_ptr, CHECK_INPUTS,
        )  # fmt: skip


@triton.jit
def _last_store_before(r, seed, starts, counts, first_entry, num_flat, num_entries, slots_ptr,
                       BLOCK: tl.constexpr):
    """(request, j) of the last token of requests ``< r`` storing to ``seed``; (-1, -1)."""
    found_r = tl.full([], -1, tl.int64)
    found_j = tl.full([], -1, tl.int64)
    for i in range(0, r):
        rr = r - 1 - i
        if found_r < 0:
            start, count, _ = _token_range(rr, starts, counts, first_entry, num_flat,
                                           num_entries)
            for j0 in range(0, count, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                slot = tl.load(slots_ptr + start + j, mask=j < count, other=-1)
                best = tl.max(tl.where(slot == seed, j, -1), 0)
                found_j = tl.maximum(found_j, best)
            found_r = tl.where(found_j >= 0, rr, found_r)
    return found_r, found_j


@triton.jit(
    do_not_specialize=["bs", "num_flat", "num_entries", "rec_stride", "position_assert", "tag"]
)
def _write_serial(
    seeds, starts, counts, first_entry, bs, num_flat, num_entries, last, rec, rec_stride,
    slots_ptr, ids_ptr, positions_ptr, expected_ids, expected_positions, position_assert,
    chain_ptr, aux_ptr, flags_ptr, rows_ptr, base, active_ptr, ring_index, status, runs,
    processed, tag, CHECK_INPUTS: tl.constexpr, HAS_COUNTERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """W3: requests whose seed this launch stores to, in request order (the seed is the last
    such store before the request); then ring offsets and run counters."""
    bs = tl.cast(bs, tl.int64)
    num_flat = tl.cast(num_flat, tl.int64)
    if tl.load(status) == 0:
        for r0 in range(0, bs, BLOCK):
            offs = r0 + tl.arange(0, BLOCK)
            seed = tl.load(seeds + offs, mask=offs < bs, other=-1)
            marked = tl.load(last + tl.where(seed >= 0, seed, 0), mask=seed >= 0, other=-1)
            if tl.max(marked, 0) >= 0:  # rare: a remapped entry
                for k in range(0, BLOCK):
                    r = r0 + k
                    if r < bs:
                        seed_r = tl.load(seeds + r)
                        mark = tl.load(last + tl.where(seed_r >= 0, seed_r, 0), mask=seed_r >= 0,
                                       other=-1)  # fmt: skip
                        if mark >= 0:
                            dep_r = mark // num_flat
                            dep_j = mark % num_flat
                            if dep_r >= r:  # the last store is not before r: look for one
                                dep_r, dep_j = _last_store_before(
                                    r, seed_r, starts, counts, first_entry, num_flat,
                                    num_entries, slots_ptr, BLOCK,
                                )
                            running, prev_position = _seed_state(seed_r, rec, rec_stride)
                            if dep_r >= 0:
                                t = tl.load(starts + dep_r) + dep_j
                                prev_position = tl.load(positions_ptr + t)
                                running = _chain_hash(
                                    tl.load(chain_ptr + tl.load(first_entry + dep_r) + dep_j),
                                    tl.load(ids_ptr + t), prev_position,
                                )  # fmt: skip
                            start, count, first = _token_range(r, starts, counts, first_entry,
                                                               num_flat, num_entries)
                            _walk_chain(
                                r, start, count, first, running,
                                prev_position, (position_assert != 0) & (seed_r >= 0),
                                slots_ptr, ids_ptr, positions_ptr, expected_ids,
                                expected_positions, chain_ptr, aux_ptr, flags_ptr, rows_ptr,
                                CHECK_INPUTS,
                            )  # fmt: skip
                            tl.debug_barrier()  # a later request may seed from these stores
        _scan_ring_offsets(rows_ptr, bs, base, ring_index, BLOCK)
        num_written = tl.zeros([], tl.int64)
        for r0 in range(0, bs, BLOCK):
            offs = r0 + tl.arange(0, BLOCK)
            num_written += tl.sum(tl.load(active_ptr + offs, mask=offs < bs, other=0), 0)
        _bump_counters(runs, processed, tag, num_written, HAS_COUNTERS)


@triton.jit(
    do_not_specialize=["num_flat", "num_entries", "num_slots", "rec_stride", "capacity", "tag"]
)
def _write_rows_and_store(
    starts, counts, first_entry, num_flat, num_entries, num_slots, last, rec, rec_stride,
    slots_ptr, ids_ptr, positions_ptr, expected_ids, expected_positions, chain_ptr, aux_ptr,
    flags_ptr, real_ptr, rows_ptr, base, status, ring, capacity, tag, BLOCK: tl.constexpr,
):  # fmt: skip
    """W4: request ``r``'s ring rows (input row, then position row, per token), and the
    records of the tokens that are their slot's last writer (which clear the mark)."""
    r = tl.program_id(0).to(tl.int64)
    num_flat = tl.cast(num_flat, tl.int64)
    start, count, first = _token_range(r, starts, counts, first_entry, num_flat, num_entries)
    healthy = tl.load(status) == 0
    seq0 = tl.load(base + r, mask=healthy, other=0)
    for j0 in range(0, count, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < count
        t = start + j
        slot = tl.load(slots_ptr + t, mask=m, other=-1)
        ok = m & (slot >= 0) & (slot < num_slots)
        safe_slot = tl.where(ok, slot, 0)
        if healthy:
            token = tl.load(ids_ptr + t, mask=ok, other=0)
            position = tl.load(positions_ptr + t, mask=ok, other=0)
            chain = tl.load(chain_ptr + first + j, mask=ok, other=0)
            flags = tl.load(flags_ptr + first + j, mask=m, other=0)
            input_bits = flags & _W_INPUT
            has_input = (input_bits != 0).to(tl.int64)
            has_position = flags & _POSITION_ROW
            num_rows = has_input + has_position
            if tl.sum(num_rows, 0) > 0:
                seq = seq0 + tl.cumsum(num_rows, 0) - num_rows
                keep = (has_input != 0) & (seq < capacity)
                row = ring + seq * _ROW
                tl.store(row + 0, tl.zeros_like(slot) + tag, mask=keep)
                tl.store(row + 1, slot, mask=keep)
                tl.store(row + 2, position, mask=keep)
                tl.store(row + 3, token, mask=keep)
                tl.store(row + 4, tl.load(expected_ids + t, mask=keep, other=0), mask=keep)
                tl.store(row + 5, chain, mask=keep)
                tl.store(row + 6, tl.load(expected_positions + t, mask=keep, other=0), mask=keep)
                tl.store(row + 7, input_bits, mask=keep)
                seq += has_input
                keep = (has_position != 0) & (seq < capacity)
                row = ring + seq * _ROW
                tl.store(row + 0, tl.zeros_like(slot) + tag, mask=keep)
                tl.store(row + 1, slot, mask=keep)
                tl.store(row + 2, position, mask=keep)
                tl.store(row + 3, token, mask=keep)
                tl.store(row + 4, token, mask=keep)
                tl.store(row + 5, chain, mask=keep)
                tl.store(row + 6, tl.load(aux_ptr + first + j, mask=keep, other=0), mask=keep)
                tl.store(row + 7, tl.zeros_like(slot) + _W_POSITION, mask=keep)
                seq0 += tl.sum(num_rows, 0)
            win = ok & (tl.load(last + safe_slot, mask=ok, other=-1) == r * num_flat + j)
            dst = rec + safe_slot * rec_stride
            tl.store(dst + _F_TOKEN, token, mask=win)
            tl.store(dst + _F_POSITION, position, mask=win)
            tl.store(dst + _F_CHAIN, chain, mask=win)
            tl.store(dst + _F_REAL, tl.load(real_ptr + first + j, mask=win, other=0), mask=win)
            tl.store(last + safe_slot, tl.full(slot.shape, -1, tl.int64), mask=win)
        else:  # nothing is stored after an error; clear every mark
            tl.store(last + safe_slot, tl.full(slot.shape, -1, tl.int64), mask=ok)


# ------------------------------------------------------------------ launches


def is_interpreted() -> bool:
    """Whether these kernels were imported under ``TRITON_INTERPRET=1`` (run on CPU tensors)."""
    return isinstance(_verify_entries, InterpretedFunction)


class _DeviceState:
    """Per-device scratch that outlives a launch: the status word and the last-writer marks
    (int64 over slots, all -1 between launches; grown for the largest canary buffer)."""

    def __init__(self, device: torch.device) -> None:
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        self.last = torch.full((0,), -1, dtype=torch.int64, device=device)

    def marks(self, num_slots: int) -> torch.Tensor:
        if self.last.shape[0] < num_slots:
            self.last = torch.full((num_slots,), -1, dtype=torch.int64, device=self.status.device)
        return self.last


_states: dict[torch.device, _DeviceState] = {}


def _state(device: torch.device) -> _DeviceState:
    state = _states.get(device)
    if state is None:
        state = _states[device] = _DeviceState(device)
    return state


def _check_device(records: torch.Tensor) -> None:
    if records.device.type != "cuda" and not is_interpreted():
        raise ValueError(
            f"triton canary kernels need CUDA tensors, got device {records.device} (CPU tensors "
            f"run only when kvcanary.canary.kernels.triton_kernels is imported under TRITON_INTERPRET=1)"
        )


def _raise_on_error(state: _DeviceState) -> None:
    """Raise what the kernels flagged (a host read; skipped while a CUDA graph captures)."""
    status = state.status
    if status.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    code = int(status.item())
    if not code:
        return
    status.zero_()
    if code & ERR_PLAN_TOTAL:
        raise ValueError("kv-canary: write plan's num_tokens sum exceeds its total_num_tokens")
    raise IndexError("kv-canary: plan slot or token range out of range (canary buffer, real-KV "
                     "source or flat token arrays)")  # fmt: skip


_MAX_CACHED = 64
_source_cache: dict[int, tuple[Sequence[RealKvSource], tuple[torch.Tensor, ...]]] = {}


def _source_args(
    sources: Sequence[RealKvSource], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """``(words0, words1, words2, words3, meta)``: unused word slots repeat ``meta``; meta
    row i = (page_size, bytes per token, read_words, row stride in words, rows, element
    size, element stride; strided where the last two differ). Memoised
    on the identity of ``sources`` (kept alive by the entry): a canary's source tuples live
    as long as it does, and building ``meta`` is a host-to-device copy."""
    hit = _source_cache.get(id(sources))
    if hit is not None and hit[0] is sources:
        return hit[1]
    check_sources(sources)
    meta = torch.tensor(
        [[s.page_size, s.num_bytes_per_token, s.read_bytes // 8, s.words.stride(0),
          s.words.shape[0], s.element_size, s.element_stride] for s in sources]
        or [[1, 0, 0, 0, 0, 8, 8]],
        dtype=torch.int64,
    ).to(device)  # fmt: skip
    words = [s.words for s in sources]
    for w in words:
        if w.device != device:
            raise ValueError(f"real-KV source on {w.device}, canary buffer on {device}")
    words += [meta] * (MAX_REAL_KV_SOURCES - len(words))
    if len(_source_cache) >= _MAX_CACHED:
        del _source_cache[next(iter(_source_cache))]
    _source_cache[id(sources)] = (sources, (*words, meta))
    return (*words, meta)


def _counter_args(counters: RunCounters | None, ring: ViolationRing) -> tuple[torch.Tensor, ...]:
    if counters is None:
        return ring.write_index, ring.write_index  # never touched (HAS_COUNTERS=False)
    return counters.kernel_runs, counters.slots_processed


def _check_tag(launch_tag: int) -> None:
    if not 0 <= launch_tag < NUM_LAUNCH_TAGS:
        raise IndexError(f"kv-canary: launch tag {launch_tag} out of range of the run counters")


def verify(
    records: torch.Tensor,
    plan: VerifyPlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    check_token: bool = False,
    counters: RunCounters | None = None,
    reader_chain: bool = False,
) -> None:
    _check_device(records)
    tag = int(launch_tag)
    _check_tag(tag)
    n = plan.num_entries if plan.enabled else 0
    if not n:
        if counters is not None:
            counters.add(tag, 0)
        return
    rec = as_int64_records(records)
    device = rec.device
    state = _state(device)
    num_blocks = triton.cdiv(n, _BLOCK)
    bits = torch.empty(n, dtype=torch.int64, device=device)
    chain = torch.empty_like(bits)
    counts = torch.empty(num_blocks, dtype=torch.int64, device=device)
    base = torch.empty_like(counts)
    sources = _source_args(real_kv_sources, device)
    slots, prev = plan.slots.contiguous(), plan.prev_slots.contiguous()
    positions, tokens = plan.positions.contiguous(), plan.expected_tokens.contiguous()
    _verify_entries[(num_blocks,)](
        slots, prev, positions, tokens, n, rec,
        rec.stride(0), rec.shape[0], *sources, bits, chain, counts, state.status,
        CHECK_TOKEN=bool(check_token), NUM_SOURCES=len(real_kv_sources), BLOCK=_BLOCK,
    )  # fmt: skip
    if reader_chain and check_token:  # (every token unchecked: the stored chain is the reader's)
        _verify_reader_chains[(num_blocks,)](
            slots, prev, positions, tokens, n, rec, rec.stride(0), bits, chain, counts,
            state.status, BLOCK=_BLOCK,
        )  # fmt: skip
    _verify_offsets[(1,)](
        counts, num_blocks, base, ring.write_index, state.status,
        *_counter_args(counters, ring), tag, n, HAS_COUNTERS=counters is not None,
        BLOCK=_SCAN_BLOCK,
    )  # fmt: skip
    _verify_rows[(num_blocks,)](
        slots, tokens, n, rec, rec.stride(0), bits, chain, counts, base, state.status,
        ring.rows, ring.capacity, tag, CHECK_TOKEN=bool(check_token), BLOCK=_BLOCK,
    )  # fmt: skip
    _raise_on_error(state)


def write(
    records: torch.Tensor,
    plan: WritePlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    chain_position_assert: bool = False,
    counters: RunCounters | None = None,
) -> None:
    _check_device(records)
    tag = int(launch_tag)
    _check_tag(tag)
    if not (plan.max_num_tokens and plan.total_num_tokens and plan.seed_slots.shape[0]):
        if counters is not None:
            counters.add(tag, 0)
        return
    rec = as_int64_records(records)
    device = rec.device
    state = _state(device)
    bs, num_flat, num_slots = plan.seed_slots.shape[0], plan.token_ids.shape[0], rec.shape[0]
    num_entries = plan.total_num_tokens
    last = state.marks(num_slots)
    # Per request: first entry, active tokens, ring rows (W3 fills those W2 skips), first row.
    first_entry, active, base = (torch.empty(bs, dtype=torch.int64, device=device)
                                 for _ in range(3))  # fmt: skip
    num_rows = torch.zeros(bs, dtype=torch.int64, device=device)
    # Per entry (request-major): real-KV fingerprint, running hash, prev position + 1, flags.
    real, chain, aux, flags = (torch.empty(num_entries, dtype=torch.int64, device=device)
                               for _ in range(4))  # fmt: skip
    seeds, starts, counts = (plan.seed_slots.contiguous(), plan.token_starts.contiguous(),
                             plan.num_tokens.contiguous())  # fmt: skip
    slots, ids, positions = (plan.slots.contiguous(), plan.token_ids.contiguous(),
                             plan.positions.contiguous())  # fmt: skip
    expected_ids, expected_positions = plan.expected_token_ids, plan.expected_positions
    check_inputs = expected_ids is not None and expected_positions is not None
    if expected_ids is None or expected_positions is None:  # typed dummies, never read
        expected_ids, expected_positions = ids, positions
    expected_ids, expected_positions = expected_ids.contiguous(), expected_positions.contiguous()
    sources = _source_args(real_kv_sources, device)
    status, stride = state.status, rec.stride(0)
    _write_requests[(1,)](seeds, starts, counts, bs, num_flat, num_slots, first_entry,
                          num_entries, status, BLOCK=_SCAN_BLOCK)  # fmt: skip
    _write_marks[(bs,)](
        slots, starts, counts, first_entry, num_flat, num_entries, num_slots, last, real, active,
        status,
        *sources, NUM_SOURCES=len(real_kv_sources), BLOCK=_BLOCK,
    )  # fmt: skip
    _write_chains[(bs,)](
        seeds, starts, counts, first_entry, num_flat, num_entries, num_slots, last, rec, stride,
        slots, ids, positions, expected_ids, expected_positions, int(chain_position_assert),
        chain, aux, flags, num_rows, CHECK_INPUTS=check_inputs,
    )  # fmt: skip
    _write_serial[(1,)](
        seeds, starts, counts, first_entry, bs, num_flat, num_entries, last, rec, stride, slots,
        ids, positions, expected_ids, expected_positions, int(chain_position_assert), chain, aux,
        flags, num_rows, base, active, ring.write_index, status, *_counter_args(counters, ring),
        tag, CHECK_INPUTS=check_inputs, HAS_COUNTERS=counters is not None, BLOCK=_BLOCK,
    )  # fmt: skip
    _write_rows_and_store[(bs,)](
        starts, counts, first_entry, num_flat, num_entries, num_slots, last, rec, stride, slots,
        ids, positions, expected_ids, expected_positions, chain, aux, flags, real, num_rows, base,
        status, ring.rows, ring.capacity, tag, BLOCK=_BLOCK,
    )  # fmt: skip
    _raise_on_error(state)
