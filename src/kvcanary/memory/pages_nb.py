"""A decode step's page bookkeeping on host SWA pools in compiled calls: the window
eviction (:meth:`.SWAAllocator.free_swa_rows` and ``free_swa``) and the decode allocation
(:meth:`.SWAAllocator.alloc_decode`).

``free_swa`` of a host pool is ~25 numpy and torch calls on a few dozen slots (page ids of
the full slots, their SWA slots, the SWA pool's free: page ids again, range and double-free
checks, flags, the free list, the unmap): ~160-250 us a tiny-swa batch-64 decode step right
after its forward, where the compiled pass below takes a few (with the gather of the rows'
slots and the count of mapped ones: ``free_swa_rows``). It checks everything before
it writes anything; where numpy's path would raise or do something unusual (a negative
slot, an SWA page out of range or already free) it writes nothing and reports it, and the
caller runs the numpy path, which then raises (or does) exactly what it always did.
``alloc_decode`` of host lengths is the same story on the allocation side (~15 list and
numpy calls: pages to take from both pools, the last slots' SWA slots, the orphan check,
both pools' slots, flags, the mapping write; ~110 us a batch-64 step).
"""

from __future__ import annotations

import numba
import numpy as np

FUSED, FALL_BACK, NO_ROOM = 0, 1, 2


@numba.njit(cache=True)
def _unique_sorted_nb(values):  # type: ignore[no-untyped-def]
    """``np.unique`` of a 1-D int64 array (sorted, each value once)."""
    s = np.sort(values)
    n = 0
    for i in range(s.shape[0]):
        if i == 0 or s[i] != s[i - 1]:
            s[n] = s[i]
            n += 1
    return s[:n]


@numba.njit(cache=True)
def free_swa_rows(table, spans, page_size, mapping, allocated, quarantined, num_pages):  # type: ignore[no-untyped-def]
    """:func:`free_swa_pages` of the full slots ``table[row, a:b]`` of each span ``(row, a,
    b)`` (``spans`` int64 ``[n, 3]``; ``table`` the host req->token table), after counting
    how many of them were mapped. Returns ``(status, kept, unmapped, mapped)``; on
    ``FALL_BACK`` (a span outside the table too) nothing is written."""
    total = 0
    for i in range(spans.shape[0]):
        row, a, b = spans[i, 0], spans[i, 1], spans[i, 2]
        if row < 0 or row >= table.shape[0] or a < 0 or b < a or b > table.shape[1]:
            return FALL_BACK, np.empty(0, dtype=np.int64), False, 0
        total += b - a
    flat = np.empty(total, dtype=np.int64)
    j = 0
    for i in range(spans.shape[0]):
        for c in range(spans[i, 1], spans[i, 2]):
            flat[j] = table[spans[i, 0], c]
            j += 1
    mapped = 0
    for s in flat:
        if s < 0 or s >= mapping.shape[0]:
            return FALL_BACK, np.empty(0, dtype=np.int64), False, 0
        mapped += mapping[s] > 0
    status, kept, unmapped = free_swa_pages(flat, page_size, mapping, allocated, quarantined,
                                            num_pages)  # fmt: skip
    return status, kept, unmapped, mapped


@numba.njit(cache=True)
def free_swa_pages(full_slots, page_size, mapping, allocated, quarantined, num_pages):  # type: ignore[no-untyped-def]
    """Unmap the SWA slots of the whole full pages (``page_size`` > 1) holding ``full_slots``
    (int64) in ``mapping`` (full slot -> SWA slot, int64; 0: none) and free their SWA pages
    (``allocated`` / ``quarantined``: the SWA pool's page flags, bool, pages ``1..num_pages``).
    Returns ``(status, kept, unmapped)``: ``FUSED`` with the freed pages that are not
    quarantined (sorted; the caller appends them to the free list) and whether any slot was
    unmapped (the caller bumps the mapping's version), or ``FALL_BACK`` with nothing written.
    (Every array returned is made here: a global one would make numba type them all
    read-only.)"""
    p = page_size
    pages = np.empty(full_slots.shape[0], dtype=np.int64)
    for i in range(full_slots.shape[0]):
        if full_slots[i] < 0:
            return FALL_BACK, np.empty(0, dtype=np.int64), False
        pages[i] = full_slots[i] // p
    pages = _unique_sorted_nb(pages)
    if pages.shape[0] and pages[-1] * p + p > mapping.shape[0]:
        return FALL_BACK, np.empty(0, dtype=np.int64), False
    num_live = 0
    for pg in pages:
        for k in range(p):
            num_live += mapping[pg * p + k] > 0
    if num_live == 0:
        return FUSED, np.empty(0, dtype=np.int64), False
    live_slots = np.empty(num_live, dtype=np.int64)
    swa_pages = np.empty(num_live, dtype=np.int64)
    j = 0
    for pg in pages:
        for k in range(p):
            s = pg * p + k
            if mapping[s] > 0:
                live_slots[j] = s
                swa_pages[j] = mapping[s] // p
                j += 1
    swa_pages = _unique_sorted_nb(swa_pages)
    if swa_pages[0] <= 0 or swa_pages[-1] > num_pages:
        return FALL_BACK, np.empty(0, dtype=np.int64), False
    for pg in swa_pages:
        if not allocated[pg]:
            return FALL_BACK, np.empty(0, dtype=np.int64), False
    num_kept = 0  # checked: from here on, write
    for pg in swa_pages:
        allocated[pg] = False
        num_kept += not quarantined[pg]
    kept = np.empty(num_kept, dtype=np.int64)
    j = 0
    for pg in swa_pages:
        if not quarantined[pg]:
            kept[j] = pg
            j += 1
    for s in live_slots:
        mapping[s] = 0
    return FUSED, kept, True


@numba.njit(cache=True)
def alloc_decode(seq_lens, last_locs, page_size, mapping, full_free, full_allocated,  # type: ignore[no-untyped-def]
                 swa_free, swa_allocated):  # fmt: skip
    """One slot per request for position ``seq_len - 1`` in both pools of a host SWA
    allocator, mapped: a request whose new token starts a page takes the next free page of
    each pool (``full_free`` / ``swa_free``: the free lists, in order), the others continue
    their last slot (``last_locs``, full; its SWA slot through ``mapping``, -1 through the
    sentinel). Returns ``(status, full slots, pages taken from each list)``: ``NO_ROOM``
    (either pool short; nothing written), ``FALL_BACK`` (lengths and last slots of different
    counts, a last slot outside the mapping, a continuing request without an SWA slot:
    nothing written; the caller's path raises) or ``FUSED`` (flags set, mapping written; the
    caller drops the taken pages from the free lists and bumps the mapping's version)."""
    n = seq_lens.shape[0]
    p = page_size
    starts = np.empty(n, dtype=np.bool_)
    num_new = 0
    for i in range(n):
        starts[i] = (seq_lens[i] - 1) % p == 0
        num_new += starts[i]
    if num_new > full_free.shape[0] or num_new > swa_free.shape[0]:
        return NO_ROOM, np.empty(0, dtype=np.int64), 0
    if last_locs.shape[0] != n:
        return FALL_BACK, np.empty(0, dtype=np.int64), 0
    swa_last = np.empty(n, dtype=np.int64)
    for i in range(n):
        loc = last_locs[i]
        if loc < -1 or loc >= mapping.shape[0]:
            return FALL_BACK, np.empty(0, dtype=np.int64), 0
        swa_last[i] = mapping[loc] if loc >= 0 else mapping[mapping.shape[0] - 1]
        if not starts[i] and swa_last[i] <= 0:
            return FALL_BACK, np.empty(0, dtype=np.int64), 0
    full = np.empty(n, dtype=np.int64)
    swa = np.empty(n, dtype=np.int64)
    k = 0
    for i in range(n):
        if starts[i]:
            full[i] = full_free[k] * p
            swa[i] = swa_free[k] * p
            k += 1
        else:
            full[i] = last_locs[i] + 1
            swa[i] = swa_last[i] + 1
    for i in range(n):
        if full[i] < 0 or full[i] >= mapping.shape[0]:
            return FALL_BACK, np.empty(0, dtype=np.int64), 0
    for j in range(num_new):  # checked: from here on, write
        full_allocated[full_free[j]] = True
        swa_allocated[swa_free[j]] = True
    for i in range(n):
        mapping[full[i]] = swa[i]
    return FUSED, full, num_new
