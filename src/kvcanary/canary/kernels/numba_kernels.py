"""CPU canary kernels (numba): verify and write, one compiled pass over the plan each.

A prefill's hash chain is sequential per request, so the CPU path walks it in compiled code
rather than a Python loop. Semantics are those of :mod:`kvcanary.canary.kernels.dispatch` (the
contract), bit for bit equal to the torch path and the test-only Python reference.
All tensors must be on the CPU; numba sees them through shared-memory numpy views.

Plans are materialised (:mod:`.plan`) or row plans (:mod:`.row_plan`, the per-forward
path). A row plan's verify first checks every row with a branch-free pass that vectorises,
and computes the exact fail bits (and ring rows, in entry order) only for the rows that may
violate; the real-KV fold gathers words across slots so that it vectorises too. From
:data:`SPLIT_MIN_WORK` on, a row plan's fingerprints and fast checks are split among torch's
threads (:func:`_split_rows`, one ``prange`` region; the cores are idle between forwards,
and here one libgomp runs both numba's and torch's threads); the ring rows are then recorded
on one thread, in entry order, so every result is the serial path's. Run counters are
bumped inside the kernels (one Python call less per launch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import numba
import numpy as np
import torch
from numba.core import types
from numba.extending import intrinsic

from kvcanary.canary.plan.types import HostWritePlan, RowVerifyPlan, VerifyPlan, WritePlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import NUM_LAUNCH_TAGS, FailReason
from kvcanary.canary.wire.hashing import ANCHOR_HASH_I64, chain_hash_nb
from kvcanary.canary.wire.real_kv import (
    RealKvSource,
    check_source_ranges,
    numba_source_args,
    real_kv_hashes_nb,
)
from kvcanary.canary.wire.records import as_int64_records
from kvcanary.jit.calls import Callee
from kvcanary.jit.parallel import parallel_lock, parallel_threads
from kvcanary.jit.prefetch import prefetch

_CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
_POSITION = int(FailReason.VERIFY_POSITION_MISMATCH)
_REAL_KV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_TOKEN = int(FailReason.VERIFY_TOKEN_MISMATCH)
_WRITE_TOKEN = int(FailReason.WRITE_TOKEN_MISMATCH)
_WRITE_POSITION = int(FailReason.WRITE_POSITION_MISMATCH)
_ANCHOR = np.int64(ANCHOR_HASH_I64)
_HISTORY = _CHAIN | _TOKEN | _POSITION  # bits that say a slot holds another history


def _pointer_of(element: Any) -> Any:
    """The intrinsic taking an int64 address to ``element*`` (for :func:`numba.carray`)."""
    pointer = types.CPointer(element)

    def typed_ptr(typingctx: Any, addr: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(pointer))

        return pointer(types.int64), codegen

    typed_ptr.__name__ = typed_ptr.__qualname__ = f"{element}_ptr"
    return intrinsic(typed_ptr)


i64_ptr = _pointer_of(types.int64)  # an int64 address as int64*
i32_ptr = _pointer_of(types.int32)  # ... as int32*


def entry_point(dispatcher: Any, *sample_args: Any) -> Callable[..., Any]:
    """The compiled function of ``dispatcher`` (an ``njit`` function) for the numba types of
    ``sample_args``, compiled (or loaded from the cache) now. Calling it skips the
    dispatcher's typing of every argument and its overload lookup: ~2.3 us less a call right
    after a model's forward, when that code is out of the caches (4.0 vs 6.3 us measured,
    five arguments). Only for call sites whose argument types cannot change (the same
    arrays, Python scalars): a wrong type is not caught, an array is read by the layout
    compiled for. Anything but a dispatcher (a profiler's wrapper) is returned as it is."""
    if not isinstance(dispatcher, numba.core.registry.CPUDispatcher):
        return cast(Callable[..., Any], dispatcher)
    return dispatcher.compile(tuple(numba.typeof(a) for a in sample_args))


@numba.njit(cache=True)
def _record(ring, ring_index, tag, slot, position, token, expected_token, chain, aux, bits):
    seq = ring_index[0]
    ring_index[0] = seq + 1
    if seq < ring.shape[0]:
        ring[seq, 0] = tag
        ring[seq, 1] = slot
        ring[seq, 2] = position
        ring[seq, 3] = token
        ring[seq, 4] = expected_token
        ring[seq, 5] = chain
        ring[seq, 6] = aux
        ring[seq, 7] = bits


@numba.njit(cache=True)
def _check_tag(tag, runs):
    if tag < 0 or tag >= runs.shape[0]:
        raise IndexError("kv-canary: launch tag out of range of the run counters")


@numba.njit(cache=True, inline="always")
def _count(runs, processed, tag, num_entries):
    """Per-tag run counters (:class:`.ring.RunCounters`, or dummies)."""
    runs[tag] += 1
    processed[tag] += num_entries


@numba.njit(cache=True)
def _check_slot(slot, num_slots):
    if slot < 0 or slot >= num_slots:
        raise IndexError("kv-canary: plan slot out of range of the canary buffer")


@numba.njit(cache=True, inline="always")
def _entry_bits(rec, slot, prev, position, expected_token, expected_real):
    """``(fail bits, expected chain)`` of one verify entry (slot != 0, both slots in range)."""
    stored_chain = rec[slot, 2]
    if prev == 0:
        expected_chain = stored_chain
    elif prev < 0:
        expected_chain = _ANCHOR
    else:
        expected_chain = np.int64(chain_hash_nb(rec[prev, 2], rec[prev, 0], rec[prev, 1]))
    bits = 0
    if prev != 0 and stored_chain != expected_chain:
        bits |= _CHAIN
    if expected_token != -1 and rec[slot, 0] != expected_token:
        bits |= _TOKEN
    if rec[slot, 1] != position:
        bits |= _POSITION
    if rec[slot, 3] != expected_real:
        bits |= _REAL_KV
    return bits, expected_chain


@numba.njit(cache=True, inline="always")
def _record_entry(ring, ring_index, tag, rec, slot, expected_token, expected_chain, bits):
    _record(ring, ring_index, tag, slot, rec[slot, 1], rec[slot, 0], expected_token,
            rec[slot, 2], expected_chain, bits)  # fmt: skip


@numba.njit(cache=True, inline="always")
def _reader_bits(rec, slot, linked, reader, bits, expected_chain):
    """The reader chain's check (:mod:`.dispatch`): an entry linked to the entry before it
    whose stored chain differs from the reader's chain fails ``verify_chain_hash``, the
    reader's chain its expected chain (unless the stored predecessor's check failed too)."""
    if linked and not bits & _CHAIN and rec[slot, 2] != reader:
        return bits | _CHAIN, reader
    return bits, expected_chain


@numba.njit(cache=True, inline="always")
def _reader_next(rec, slot, linked, reader, expected_chain, expected_token, position, bits):
    """``(reader chain after an entry, whether the next entry may link to it)``: from the
    entry's reader chain (linked) or its expected chain (a run's first entry), with the
    reader's token (the stored one when not checked) at the reader's position. A stored token
    stands in for the reader's only while its entry passes: after a failing entry whose
    token is not checked, the reader's history is unknown and the next entry starts a run."""
    base = reader if linked else expected_chain
    token = expected_token if expected_token != -1 else rec[slot, 0]
    known = expected_token != -1 or not bits & _HISTORY
    return np.int64(chain_hash_nb(base, token, position)), known


@numba.njit(cache=True)
def _verify_kernel(
    slots, prev_slots, positions, expected_tokens, check_token, tag,
    rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index, runs, processed,
    reader_chain,
):  # fmt: skip
    _check_tag(tag, runs)
    num_slots = rec.shape[0]
    real = real_kv_hashes_nb(slots, words0, words1, words2, words3, meta, num_sources)
    # The reader chain after the entry before, that entry's slot (0: none), and whether the
    # next entry may link to it.
    reader, last, known = _ANCHOR, np.int64(0), False
    for i in range(slots.shape[0]):
        slot = slots[i]
        if slot == 0:
            last = 0
            continue
        _check_slot(slot, num_slots)
        prev = prev_slots[i]
        if prev > 0:
            _check_slot(prev, num_slots)
        expected_token = expected_tokens[i] if check_token else np.int64(-1)
        bits, expected_chain = _entry_bits(rec, slot, prev, positions[i], expected_token, real[i])
        reported = expected_chain
        if reader_chain:
            linked = known and prev > 0 and prev == last
            bits, reported = _reader_bits(rec, slot, linked, reader, bits, expected_chain)
            reader, known = _reader_next(rec, slot, linked, reader, expected_chain,
                                         expected_token, positions[i], bits)  # fmt: skip
        last = slot
        if bits:
            _record_entry(ring, ring_index, tag, rec, slot, expected_token, reported, bits)
    _count(runs, processed, tag, slots.shape[0])


# _row_may_violate checks a row's entries in runs of this many, asking for the records of
# the next run's entries before it checks a run (records sit in slot order, a row's slots in
# pages scattered over the pool; the hardware prefetcher cannot follow them).
_VERIFY_RUN = 64


@numba.njit(cache=True, inline="always")
def _may_violate(rec, slot, prev, position, token, check_token, expected_real):
    """1 when an entry may violate (exact bits: :func:`_entry_bits`), its predecessor the
    entry before it in the row (``prev`` 0: the chain unchecked); branch-free, so the loops
    over a run vectorise."""
    expected_chain = np.int64(chain_hash_nb(rec[prev, 2], rec[prev, 0], rec[prev, 1]))
    bad = (rec[slot, 2] != expected_chain) & (prev != 0)
    bad |= rec[slot, 1] != position
    bad |= check_token & (token != -1) & (rec[slot, 0] != token)
    bad |= rec[slot, 3] != expected_real
    return bad & (slot != 0)


@numba.njit(cache=True)
def _row_may_violate(rec, slots, tokens, real, first, count, first_position, check_token):
    """Whether an entry of a row-plan row, but its first, may violate. Each entry's
    predecessor is the entry before it, so each check reads two records and nothing carries
    from one entry to the next: the run loops vectorise (one loop per case of ``real``; a
    select between them inside the loop stops that). Measured on AVX2 (AMD EPYC), 16 rows
    of 153 entries: 6.8 / 9.6 ns an entry warm / cache-cold with 32-slot pages, against
    10.0 / 14.3 gathering each run's records into contiguous arrays first."""
    last = first + count
    n = slots.shape[0]
    num_bad = 0
    e0 = first + 1
    while e0 < last:
        e1 = min(e0 + _VERIFY_RUN, last)
        for e in range(e1, min(e1 + _VERIFY_RUN, n)):  # (past the row: the next row's)
            prefetch(rec, slots[e])
        p0 = first_position - first
        if real.shape[0]:
            for e in range(e0, e1):
                num_bad += _may_violate(rec, slots[e], slots[e - 1], p0 + e, tokens[e],
                                        check_token, real[e])  # fmt: skip
        else:
            for e in range(e0, e1):
                num_bad += _may_violate(rec, slots[e], slots[e - 1], p0 + e, tokens[e],
                                        check_token, 0)  # fmt: skip
        e0 = e1
    return num_bad != 0


_ERR_SLOT = 1

# A row plan's verify splits its rows among threads from this much work (entries, plus an
# eighth of an entry per fingerprinted word): a parallel region costs ~3 us to start, about
# what ~1000 entries of checks take on one core. Read by split_args (tests set it to 0 to
# split every verify).
SPLIT_MIN_WORK = 1024
# A write interleaves its requests' chains (_chains_nb) from this many tokens a request on
# average (_write_kernel).
_CHAINS_MIN_TOKENS = 8
# prange loops only: no array expression or allocation becomes a parallel region of its own.
_PRANGE_ONLY: Any = {
    "prange": True, "comprehension": False, "numpy": False, "reduction": False,
    "setitem": False, "stencil": False, "fusion": False, "inplace_binop": False,
}  # fmt: skip


def split_args() -> np.ndarray:
    """The row-plan verifies' ``split`` argument: ``[threads, SPLIT_MIN_WORK]`` now."""
    return np.array((parallel_threads(), SPLIT_MIN_WORK), dtype=np.int64)


@numba.njit(cache=True, inline="always")
def _splits(split, n, meta, num_sources):
    """Whether work on ``n`` entries is split among threads (``split``: :func:`split_args`'s
    ``[threads, min work]``; the work: entries plus an eighth per fingerprinted word)."""
    work = n
    for i in range(num_sources):
        work += n * meta[i, 2] // 8
    return split[0] > 1 and work >= split[1]


@numba.njit(cache=True, parallel=_PRANGE_ONLY)
def _split_hashes(slots, words0, words1, words2, words3, meta, num_sources, threads):
    """:func:`.real_kv.real_kv_hashes_nb` on ``threads`` threads, one run of slots each (the
    same values; slots range-checked before)."""
    n = slots.shape[0]
    real = np.zeros(n, dtype=np.int64)
    for c in numba.prange(threads):
        e0, e1 = c * n // threads, (c + 1) * n // threads
        if e0 < e1:
            part = real_kv_hashes_nb(slots[e0:e1], words0, words1, words2, words3, meta,
                                     num_sources)  # fmt: skip
            for e in range(e1 - e0):  # (not a slice copy: see real_kv.fold_windows_nb)
                real[e0 + e] = part[e]
    return real


@numba.njit(cache=True)
def _part_clean(rec, slots, tokens, real, requests, r, a, b, check_token, num_sources):
    """Whether entries ``[a, b)`` of row ``r`` of a row plan surely have no violation (the
    fast check: the row's first entry's exact bits, when ``a`` is it, then
    :func:`_row_may_violate` on the others, each against the entry before it)."""
    if a >= b:
        return True
    first, first_position = requests[0, r], requests[1, r]
    if a > first:  # entries a .. b - 1 after their predecessors a - 1 .. b - 2
        return not _row_may_violate(rec, slots, tokens, real, a - 1, b - a + 1,
                                    first_position + (a - 1 - first), check_token)  # fmt: skip
    slot = slots[first]
    return not (
        (slot != 0 and _entry_bits(rec, slot, requests[3, r], first_position,
                                   tokens[first] if check_token else np.int64(-1),
                                   real[first] if num_sources else 0)[0])
        or _row_may_violate(rec, slots, tokens, real, first, b - first, first_position,
                            check_token)
    )  # fmt: skip


@numba.njit(cache=True, parallel=_PRANGE_ONLY)
def _split_rows(requests, num_rows, slots, tokens, check_token, rec,
                words0, words1, words2, words3, meta, num_sources, threads):  # fmt: skip
    """The fast checks of :func:`_verify_rows_kernel` on ``threads`` threads: ``(real,
    clean)``, each entry's fingerprint and whether each row is surely clean. The entries
    are split into ``threads`` runs of equal length (a long prefill row too: each entry's
    check reads only its own and its predecessor's records); each run fingerprints its
    entries, then checks the parts of the rows it holds (:func:`_part_clean`). The same
    values as one thread computes, so the records, ring rows (written afterwards, in entry
    order, by the caller) and counters are those of the serial path. Slots must be
    range-checked (records and sources) before."""
    n = slots.shape[0]
    real = np.zeros(n if num_sources else 0, dtype=np.int64)
    bad = np.zeros((threads, num_rows), dtype=np.bool_)  # per run: no two threads share a byte
    for c in numba.prange(threads):
        e0, e1 = c * n // threads, (c + 1) * n // threads
        if e0 < e1:
            if num_sources:
                part = real_kv_hashes_nb(slots[e0:e1], words0, words1, words2, words3, meta,
                                         num_sources)  # fmt: skip
                for e in range(e1 - e0):  # (not a slice copy: see real_kv.fold_windows_nb)
                    real[e0 + e] = part[e]
            for r in range(num_rows):
                first = requests[0, r]
                a, b = max(first, e0), min(first + requests[2, r], e1)
                bad[c, r] = not _part_clean(rec, slots, tokens, real, requests, r, a, b,
                                            check_token, num_sources)  # fmt: skip
    clean = np.ones(num_rows, dtype=np.bool_)
    for c in range(threads):
        for r in range(num_rows):
            clean[r] &= not bad[c, r]
    return real, clean


@numba.njit(cache=True)
def _verify_rows_kernel(
    requests, num_rows, entries, num_entries, check_token, tag,
    rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index, runs, processed,
    split, reader_chain,
):  # fmt: skip
    """:func:`_verify_kernel` over rows ``[0, num_rows)`` of a row plan (:mod:`.row_plan`)
    holding ``num_entries``; returns an error status (0: ok), checked before any row is
    recorded. ``split`` (int64 ``[threads, min work]``, :func:`split_args`): the fast checks
    on that many threads (:func:`_split_rows`; the same results) when there are more than
    one and the work (``SPLIT_MIN_WORK``'s measure) is at least the min work."""
    _check_tag(tag, runs)
    num_slots = rec.shape[0]
    slots, tokens = entries[0, :num_entries], entries[1, :num_entries]
    lo, hi = np.int64(0), np.int64(0)
    for e in range(num_entries):
        lo, hi = min(lo, slots[e]), max(hi, slots[e])
    entries_hi = hi
    for r in range(num_rows):  # a row's first predecessor matters only under a live slot
        if requests[2, r] > 0 and slots[requests[0, r]] != 0:
            hi = max(hi, requests[3, r])  # (< 0: the anchor)
    if lo < 0 or hi >= num_slots:
        return _ERR_SLOT
    # Raises on slots outside a source, before any row (as _verify_kernel does).
    real = np.empty(0, dtype=np.int64)  # no fingerprint: every record must hold 0
    parts = _splits(split, num_entries, meta, num_sources)
    clean = np.zeros(0, dtype=np.bool_)
    if parts:
        check_source_ranges(entries_hi, words0, words1, words2, words3, meta, num_sources)
        real, clean = _split_rows(requests, num_rows, slots, tokens, check_token, rec,
                                  words0, words1, words2, words3, meta, num_sources, split[0])  # fmt: skip
    elif num_sources:
        real = real_kv_hashes_nb(slots, words0, words1, words2, words3, meta, num_sources)
    no_token = np.int64(-1)
    for r in range(num_rows):
        first, first_position = requests[0, r], requests[1, r]
        count, prev = requests[2, r], requests[3, r]
        if clean[r] if parts else _part_clean(rec, slots, tokens, real, requests, r, first,
                                              first + count, check_token, num_sources):  # fmt: skip
            continue
        reader, known = _ANCHOR, False  # the reader chain after the entry before; linkable
        for e in range(first, first + count):  # the slow path, in entry order
            slot = slots[e]
            if slot != 0:
                expected_token = tokens[e] if check_token else no_token
                position = first_position + e - first
                bits, expected_chain = _entry_bits(
                    rec, slot, prev, position, expected_token, real[e] if num_sources else 0,
                )  # fmt: skip
                reported = expected_chain
                if reader_chain:
                    linked = known and e > first and prev != 0
                    bits, reported = _reader_bits(rec, slot, linked, reader, bits, expected_chain)
                    reader, known = _reader_next(rec, slot, linked, reader, expected_chain,
                                                 expected_token, position, bits)  # fmt: skip
                if bits:
                    _record_entry(ring, ring_index, tag, rec, slot, expected_token,
                                  reported, bits)  # fmt: skip
            prev = slot
    _count(runs, processed, tag, num_entries)
    return 0


@numba.njit(cache=True)
def _write_kernel(
    requests, num_reqs, token_ids, positions, slots,
    check_inputs, expected_token_ids, expected_positions, position_assert, tag,
    rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index, runs, processed,
    split,
):  # fmt: skip
    """Requests ``[0, num_reqs)``: ``requests[-3:]`` = seed slots, token starts, token
    counts (:mod:`.row_plan` scratch or a stacked WritePlan). ``split``: as
    :func:`_verify_rows_kernel`'s, for the fingerprints of the written slots."""
    _check_tag(tag, runs)
    num_slots = rec.shape[0]
    seed_slots, token_starts = requests[-3, :num_reqs], requests[-2, :num_reqs]
    num_tokens = requests[-1, :num_reqs]
    slots = slots[: token_ids.shape[0]]
    written_slots = np.full(slots.shape[0], -1, dtype=np.int64)  # fingerprint only these
    for r in range(num_reqs):
        end = token_starts[r] + num_tokens[r]
        if num_tokens[r] > 0 and (token_starts[r] < 0 or end > token_ids.shape[0]):
            raise IndexError("kv-canary: write plan token range out of the flat token arrays")
        written_slots[token_starts[r] : end] = slots[token_starts[r] : end]
    if num_sources and _splits(split, written_slots.shape[0], meta, num_sources):
        hi = np.int64(-1)
        for i in range(written_slots.shape[0]):
            hi = max(hi, written_slots[i])
        check_source_ranges(hi, words0, words1, words2, words3, meta, num_sources)
        real = _split_hashes(written_slots, words0, words1, words2, words3, meta, num_sources,
                             split[0])  # fmt: skip
    else:
        real = real_kv_hashes_nb(written_slots, words0, words1, words2, words3, meta,
                                 num_sources)  # fmt: skip
    for r in range(num_reqs):  # every seed is range-checked before any store
        if seed_slots[r] >= 0:
            _check_slot(seed_slots[r], num_slots)
    # Every entry's chain, from each seed as it is before any store (:func:`_chains_nb`),
    # when the requests' token ranges follow one another, hold several tokens each on
    # average (a decode's one token a request gains nothing) and no request holds more
    # than a third of them (one long chain is as slow interleaved, and the stores below
    # then come on top); else each chain in entry order below
    firsts = np.empty(num_reqs, dtype=np.int64)
    in_order, end, total, longest = True, np.int64(0), np.int64(0), np.int64(0)
    for r in range(num_reqs):
        if num_tokens[r] > 0:
            in_order &= token_starts[r] >= end
            end = token_starts[r] + num_tokens[r]
            total += num_tokens[r]
            longest = max(longest, num_tokens[r])
    in_order &= total >= _CHAINS_MIN_TOKENS * num_reqs and 3 * longest <= total
    chains = firsts
    if in_order:
        for r in range(num_reqs):
            firsts[r] = _seed_chain(rec, seed_slots[r])
        chains = _chains_nb(token_starts, num_tokens, slots, token_ids, positions, firsts)
    num_written = 0
    for r in range(num_reqs):
        # Each seed is read when its request starts (SGLang's write_ref): a store of an
        # earlier request to it (a remapped entry) is seen; such a request's chain is
        # computed again here, in entry order.
        seed = seed_slots[r]
        running = _seed_chain(rec, seed)
        prev_position = rec[seed, 1] if seed >= 0 else np.int64(0)
        computed = in_order and running == firsts[r]
        assert_position = position_assert and seed >= 0
        for i in range(token_starts[r], token_starts[r] + num_tokens[r]):
            slot = slots[i]
            if slot < 0:
                continue
            _check_slot(slot, num_slots)
            token, position = token_ids[i], positions[i]
            if computed:
                running = chains[i]
            if check_inputs:
                bits = 0
                if token != expected_token_ids[i]:
                    bits |= _WRITE_TOKEN
                if position != expected_positions[i]:
                    bits |= _WRITE_POSITION
                if bits:
                    _record(ring, ring_index, tag, slot, position, token, expected_token_ids[i],
                            running, expected_positions[i], bits)  # fmt: skip
            if assert_position:
                if position != prev_position + 1:
                    _record(ring, ring_index, tag, slot, position, token, token,
                            running, prev_position + 1, _WRITE_POSITION)  # fmt: skip
                prev_position = position
            rec[slot, 0] = token
            rec[slot, 1] = position
            rec[slot, 2] = running
            rec[slot, 3] = real[i]
            if not computed:
                running = np.int64(chain_hash_nb(running, token, position))
            num_written += 1
    _count(runs, processed, tag, num_written)
    return num_written


@numba.njit(cache=True)
def _chains_nb(starts, counts, slots, token_ids, positions, firsts):
    """The chain each entry of a write stores (its request's running hash before it) for
    requests ``r`` = entries ``[starts[r], + counts[r])``, from ``firsts[r]`` on; entries
    whose slot is < 0 are skipped (not stored, the chain does not move on). The hash is
    latency-bound and each request's chain depends only on its own entries, so four
    requests' chains run interleaved in one loop (a 16 x 128-token prefill: ~7 against
    ~21 us one chain after another, 2-core Xeon VM). The four lanes are written out: the
    same lane step as an ``inline="always"`` helper made the write ~6x slower."""
    chains = np.empty(slots.shape[0], dtype=np.int64)
    n = starts.shape[0]
    for r0 in range(0, n, 4):
        s0, c0, h0 = starts[r0], counts[r0], firsts[r0]
        s1, c1, h1 = (starts[r0 + 1], counts[r0 + 1], firsts[r0 + 1]) if r0 + 1 < n else (0, 0, 0)
        s2, c2, h2 = (starts[r0 + 2], counts[r0 + 2], firsts[r0 + 2]) if r0 + 2 < n else (0, 0, 0)
        s3, c3, h3 = (starts[r0 + 3], counts[r0 + 3], firsts[r0 + 3]) if r0 + 3 < n else (0, 0, 0)
        for j in range(max(max(c0, c1), max(c2, c3))):
            if j < c0 and slots[s0 + j] >= 0:
                chains[s0 + j] = h0
                h0 = np.int64(chain_hash_nb(h0, token_ids[s0 + j], positions[s0 + j]))
            if j < c1 and slots[s1 + j] >= 0:
                chains[s1 + j] = h1
                h1 = np.int64(chain_hash_nb(h1, token_ids[s1 + j], positions[s1 + j]))
            if j < c2 and slots[s2 + j] >= 0:
                chains[s2 + j] = h2
                h2 = np.int64(chain_hash_nb(h2, token_ids[s2 + j], positions[s2 + j]))
            if j < c3 and slots[s3 + j] >= 0:
                chains[s3 + j] = h3
                h3 = np.int64(chain_hash_nb(h3, token_ids[s3 + j], positions[s3 + j]))
    return chains


@numba.njit(cache=True, inline="always")
def _seed_chain(rec, seed):
    """The running hash a request's first entry stores: its seed record's chain hash
    (``seed`` >= 0), else the anchor."""
    if seed < 0:
        return _ANCHOR
    return np.int64(chain_hash_nb(rec[seed, 2], rec[seed, 0], rec[seed, 1]))


# The verify and write kernels as the fused HEAD / TAIL (:mod:`.fused_rows`) call them:
# through their addresses (kvcanary.jit.calls), every array int64 C-contiguous as the fused
# argument block describes them. Linked, both would be compiled again into HEAD and into
# TAIL.
_I1, _I2 = types.Array(types.int64, 1, "C"), types.Array(types.int64, 2, "C")
_SHARED_ARGS = (_I2, _I2, _I2, _I2, _I2, _I2, types.int64, _I2, _I1, _I1, _I1, _I1)
VERIFY_ROWS = Callee(_verify_rows_kernel, types.int64, _I2, types.int64, _I2, types.int64,
                     types.boolean, types.int64, *_SHARED_ARGS, types.boolean)  # fmt: skip
WRITE = Callee(_write_kernel, types.int64, _I2, types.int64, _I1, _I1, _I1, types.boolean, _I1,
               _I1, types.boolean, types.int64, *_SHARED_ARGS)  # fmt: skip
VERIFY_ROWS_T, WRITE_T = VERIFY_ROWS.type, WRITE.type


@numba.njit(cache=True, inline="always")
def _launch_rows_kernel(
    v_requests, v_rows, v_entries, v_num_entries, check_token,
    w_requests, w_reqs, token_ids, positions, w_slots, do_write, check_inputs,
    expected_token_ids, expected_positions, position_assert, tag,
    rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index,
    v_runs, v_processed, w_runs, w_processed, split, write_first, reader_chain,
):  # fmt: skip
    """One launch of a row plan: :func:`_verify_rows_kernel` then :func:`_write_kernel` on
    the same records, sources and ring, in one call, or the write first (``write_first``:
    the alias check, :mod:`.dispatch`; ``reader_chain``: the verify's); returns the verify's error status (after a verify
    error nothing more is written)."""
    if write_first:
        _write_or_count(
            w_requests, w_reqs, token_ids, positions, w_slots, do_write, check_inputs,
            expected_token_ids, expected_positions, position_assert, tag,
            rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index,
            w_runs, w_processed, split,
        )  # fmt: skip
    status = _verify_rows_kernel(
        v_requests, v_rows, v_entries, v_num_entries, check_token, tag,
        rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index,
        v_runs, v_processed, split, reader_chain,
    )  # fmt: skip
    if status or write_first:
        return status
    _write_or_count(
        w_requests, w_reqs, token_ids, positions, w_slots, do_write, check_inputs,
        expected_token_ids, expected_positions, position_assert, tag,
        rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index,
        w_runs, w_processed, split,
    )  # fmt: skip
    return 0


@numba.njit(cache=True, inline="always")
def _write_or_count(
    w_requests, w_reqs, token_ids, positions, w_slots, do_write, check_inputs,
    expected_token_ids, expected_positions, position_assert, tag,
    rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index,
    w_runs, w_processed, split,
):  # fmt: skip
    if do_write:
        _write_kernel(
            w_requests, w_reqs, token_ids, positions, w_slots, check_inputs, expected_token_ids,
            expected_positions, position_assert, tag,
            rec, words0, words1, words2, words3, meta, num_sources, ring, ring_index,
            w_runs, w_processed, split,
        )  # fmt: skip
    else:  # a write without tokens counts its launch, as write() does
        _check_tag(tag, w_runs)
        _count(w_runs, w_processed, tag, 0)


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing ``t``'s memory (kernel outputs must never be copies)."""
    if t.device.type != "cpu":
        raise ValueError(f"numba canary kernels need CPU tensors, got device {t.device}")
    return t.numpy()


_MAX_CACHED = 64  # launch-argument sets memoised per ring
_NO_COUNTERS = (np.zeros(NUM_LAUNCH_TAGS, dtype=np.int64), np.zeros(NUM_LAUNCH_TAGS, np.int64))


def _launch_args(
    records: torch.Tensor,
    sources: Sequence[RealKvSource],
    ring: ViolationRing,
    counters: RunCounters | None,
) -> tuple[Any, ...]:
    """The kernels' trailing arguments (int64 records, sources, ring, counters) as numpy
    views, memoised in ``ring.launch_args`` on the identity of the objects (kept alive by
    the entry, so their ids cannot be reused while cached; the memo goes with the ring, so
    with its canary): canary buffers, source tuples and counters live as long as the
    canary, and converting them per launch cost more than a decode-step verify."""
    cache = ring.launch_args
    key = (id(records), id(sources), id(counters))
    hit = cache.get(key)
    if hit is not None and hit[0] is records and hit[1] is sources and hit[2] is counters:
        return hit[3]
    if counters is None:
        count_args = _NO_COUNTERS
    elif counters.kernel_runs.device.type == "cpu":
        count_args = (_np(counters.kernel_runs), _np(counters.slots_processed))
    else:
        raise ValueError(f"numba canary kernels need CPU counters, got {counters.kernel_runs.device}")
    args = (_np(as_int64_records(records)), *numba_source_args(sources),
            _np(ring.rows), _np(ring.write_index), *count_args)  # fmt: skip
    if len(cache) >= _MAX_CACHED:
        del cache[next(iter(cache))]
    cache[key] = (records, sources, counters, args)
    return args


def verify(
    records: torch.Tensor,
    plan: VerifyPlan | RowVerifyPlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    check_token: bool = False,
    counters: RunCounters | None = None,
    reader_chain: bool = False,
) -> None:
    if isinstance(plan, RowVerifyPlan):
        verify_rows(records, plan, ring, launch_tag, real_kv_sources, check_token, counters,
                    reader_chain)  # fmt: skip
        return
    if not (plan.enabled and plan.num_entries):
        if counters is not None:
            counters.add(launch_tag, 0)
        return
    args = (*_launch_args(records, real_kv_sources, ring, counters), bool(reader_chain))
    _verify_kernel(
        plan.slots.numpy(), plan.prev_slots.numpy(), plan.positions.numpy(),
        plan.expected_tokens.numpy(), bool(check_token), int(launch_tag), *args,
    )  # fmt: skip


def verify_rows(
    records: torch.Tensor,
    plan: RowVerifyPlan,
    ring: ViolationRing,
    launch_tag: int,
    real_kv_sources: Sequence[RealKvSource],
    check_token: bool,
    counters: RunCounters | None,
    reader_chain: bool = False,
) -> None:
    """:func:`verify` of a row plan (positional: the per-forward path, where every Python
    operation costs microseconds once the forward has evicted the interpreter's caches)."""
    args = (*_launch_args(records, real_kv_sources, ring, counters), split_args(),
            bool(reader_chain))  # fmt: skip
    with parallel_lock:
        status = _verify_rows_kernel(
            plan.requests, plan.bs, plan.entries,
            plan.num_requested_entries if plan.enabled else 0, check_token and plan.has_tokens,
            int(launch_tag), *args,
        )  # fmt: skip
    if status:
        raise IndexError("kv-canary: plan slot out of range of the canary buffer")


def launch_rows(
    records: torch.Tensor,
    verify_plan: RowVerifyPlan,
    write_plan: HostWritePlan,
    ring: ViolationRing,
    launch_tag: int,
    real_kv_sources: Sequence[RealKvSource],
    check_token: bool,
    chain_position_assert: bool,
    verify_counters: RunCounters | None,
    write_counters: RunCounters | None,
    write_first: bool = False,
    reader_chain: bool = False,
) -> None:
    """:func:`verify_rows` then :func:`write` of one launch in one compiled call, or the
    write first (the per-forward path: it saves a dispatch and the Python around it per
    launch)."""
    args = _launch_args(records, real_kv_sources, ring, verify_counters)
    write_counts = args[-2:] if write_counters is verify_counters else (
        _launch_args(records, real_kv_sources, ring, write_counters)[-2:])  # fmt: skip
    tail = (*args, *write_counts, split_args(), bool(write_first), bool(reader_chain))
    ids, positions = write_plan.token_ids, write_plan.positions
    expected_ids, expected_positions = write_plan.expected_token_ids, write_plan.expected_positions
    check_inputs = expected_ids is not None and expected_positions is not None
    if not check_inputs:  # typed dummies: numba compiles one signature either way
        expected_ids, expected_positions = ids, positions
    with parallel_lock:
        status = _launch_rows_kernel(
            verify_plan.requests, verify_plan.bs, verify_plan.entries,
            verify_plan.num_requested_entries if verify_plan.enabled else 0,
            check_token and verify_plan.has_tokens,
            write_plan.requests, write_plan.bs, ids, positions, write_plan.slots,
            write_plan.max_num_tokens > 0, check_inputs, expected_ids, expected_positions,
            bool(chain_position_assert), int(launch_tag), *tail,
        )  # fmt: skip
    if status:
        raise IndexError("kv-canary: plan slot out of range of the canary buffer")


def write(
    records: torch.Tensor,
    plan: WritePlan | HostWritePlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    chain_position_assert: bool = False,
    counters: RunCounters | None = None,
) -> None:
    if not plan.max_num_tokens:
        if counters is not None:
            counters.add(launch_tag, 0)
        return
    if isinstance(plan, HostWritePlan):
        requests, num_reqs = plan.requests, plan.bs
        ids, positions, slots = plan.token_ids, plan.positions, plan.slots
        expected_ids, expected_positions = plan.expected_token_ids, plan.expected_positions
    else:
        requests = torch.stack((plan.seed_slots, plan.token_starts, plan.num_tokens)).numpy()
        num_reqs = requests.shape[1]
        ids, positions, slots = plan.token_ids.numpy(), plan.positions.numpy(), plan.slots.numpy()
        expected_ids = None if plan.expected_token_ids is None else plan.expected_token_ids.numpy()
        expected_positions = (
            None if plan.expected_positions is None else plan.expected_positions.numpy()
        )
    check_inputs = expected_ids is not None and expected_positions is not None
    if not check_inputs:  # typed dummies: numba compiles one signature either way
        expected_ids, expected_positions = ids, positions
    args = (*_launch_args(records, real_kv_sources, ring, counters), split_args())
    with parallel_lock:
        _write_kernel(
            requests, num_reqs, ids, positions, slots, check_inputs, expected_ids,
            expected_positions, bool(chain_position_assert), int(launch_tag), *args,
        )  # fmt: skip
