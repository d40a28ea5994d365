"""The store check: does the pool hold the K/V bytes attention handed to it this forward?

TAIL fingerprints each written slot's live bytes (record field 3). A store that never
happened (or went to another slot) leaves stale bytes there, which TAIL would fingerprint
and bless. So the canary also watches the stores themselves::

    attention: pool.set_kv_buffer(layer, loc, k, v)       (patched on the sub-pool instance)
        └─ for each fingerprinted (layer, half) buffer, token i of the forward (flat order):
           intended[source, i] = fold of the first read_bytes of k[i] / v[i] (the fold of
           record field 3), target[source, i] = loc[i]; a store whose row count is not the
           forward's token count cannot be aligned: every target becomes -2
    TAIL, after the write, for every token i written this forward to slot s:
        stored = every source was stored this forward, to target s
        want   = combine(intended[j, i] for every source j)
        not stored, or the pool's fingerprint (the record TAIL just wrote) != want
            → ring row (TAIL tag, s, position, token, token, pool fingerprint, want or 0,
                        write_kv_store); the record keeps ``want`` (0 when not stored), so
              every later verify of the slot fails too (real_kv_hash)

A watch arms on the first store it sees: a host that has ``set_kv_buffer`` but writes the
buffers another way is never checked (rather than flagged on every token).

A backend that stores itself (our CPU decode layer, ``PagedAttentionBackend.rope_forward``)
reports what it stored through the wrapper's ``kv_canary_observe`` (tensors) or, where the
rows are contiguous and stored as they are, ``kv_canary_observe_rows`` (addresses:
:meth:`StoreChecker.observe_rows`, one compiled call for every watch of the layer, the same
scratch; ~2 us less a layer at batch 1, ~7 us at 32 on tiny-swa, where the tensors'
metadata reads cost more than the fold).

Keyed by token, not slot: a misdirected store (two tokens' slots swapped) stores
self-consistent bytes at each slot, but not the token's own. Scratch: int64
``[num_sources, num_tokens]`` twice per launched (group, half) with sources. Without
real-KV sources (``--kv-canary-real-data none``) nothing is watched.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, cast

import numba
import numpy as np
import torch

from kvcanary.canary.kernels.numba_kernels import _record, entry_point, i64_ptr
from kvcanary.canary.plan.types import HostWritePlan, WritePlan
from kvcanary.canary.report.ring import ViolationRing
from kvcanary.canary.wire.constants import (
    FailReason,
    KvHalf,
    LaunchStage,
    launch_tag,
)
from kvcanary.canary.wire.hashing import (
    fold_real_kv_words_t,
    splitmix64_nb,
    splitmix64_t,
)
from kvcanary.canary.wire.real_kv import RealKvSource, fold_windows_nb

_KV_STORE = int(FailReason.WRITE_KV_STORE_MISMATCH)
_UNALIGNED = -2  # target of a store that did not cover the forward's tokens one to one
# Stores numba reads as they are (others, e.g. bfloat16, are viewed as int64 in torch first),
# with their element size.
_NUMPY_DTYPES = {torch.float32: 4, torch.float64: 8}


def _watchable(sources: Sequence[RealKvSource]) -> bool:
    """Whether a (group, half) with these sources gets a store watch: some, none strided
    (a host with strided sources, vLLM's CPU layout, stores through its own kernels)."""
    return bool(sources) and not any(s.strided for s in sources)


class StoreWatch:
    """The stores seen this forward for one (group, half): per source, the fold of the
    bytes handed over for each token, the slot they went to, the epoch of the last store."""

    def __init__(self, tag: int, records: torch.Tensor, sources: tuple[RealKvSource, ...]):
        for s in sources:  # a store's rows are folded as contiguous words
            if s.strided:
                raise ValueError(
                    f"store check of a strided real-KV source (element_size={s.element_size}, "
                    f"element_stride={s.element_stride}); allowed: contiguous sources only"
                )
        self.tag = tag
        self.records = records
        self.sources = sources
        self.stamp = np.full(len(sources), -1, dtype=np.int64)  # host side: epochs
        # Armed by the first store seen: a host whose attention writes the buffers without
        # set_kv_buffer (it has the method but bypasses it) gets no check, not false alarms.
        self.armed = False
        self._alloc(256)

    def _alloc(self, num_tokens: int) -> None:
        shape, device = (len(self.sources), num_tokens), self.records.device
        self.intended = torch.zeros(shape, dtype=torch.int64, device=device)
        self.target = torch.full(shape, _UNALIGNED, dtype=torch.int64, device=device)
        self._np = (
            (self.intended.numpy(), self.target.numpy()) if device.type == "cpu" else None
        )
        # Per source (CPU): its rows of the scratch and its fold width, for observe's fast path.
        self._rows = None if self._np is None else [
            (self._np[0][j], self._np[1][j], s.read_bytes // 8) for j, s in enumerate(self.sources)
        ]  # fmt: skip
        # The records as int64 numpy (CPU): made once, a per-call view costs microseconds.
        self.records_np = self.records.view(torch.int64).numpy() if device.type == "cpu" else None

    def reserve(self, num_tokens: int) -> bool:
        """Grow the scratch to ``num_tokens``; True when it was reallocated."""
        if self.intended.shape[1] >= num_tokens:
            return False
        self._alloc(max(num_tokens, 2 * self.intended.shape[1]))
        return True


@numba.njit(cache=True)
def _observe_nb(words, num_words, loc, intended, target):
    """``intended[t]`` = the fold of row ``t``'s first ``num_words`` words, ``target[t] =
    loc[t]``, for every stored row (folded across rows: :func:`.real_kv.fold_windows_nb`)."""
    n = loc.shape[0]
    rows = np.arange(n)
    intended[:n] = fold_windows_nb(rows, words, 1, 0, num_words).view(np.int64)
    target[:n] = loc


@numba.njit(cache=True, inline="always")
def _rows_readable(addr, step, row_bytes, n):
    """Whether ``n`` rows of ``row_bytes`` at ``addr``, ``step`` bytes apart, are whole int64
    words at 8-byte aligned addresses that do not overlap (what :func:`_fold_rows` reads)."""
    return addr % 8 == 0 and row_bytes % 8 == 0 and (n <= 1 or (step % 8 == 0 and step >= row_bytes))


@numba.njit(cache=True)
def _fold_rows(addr, step, row_bytes, n, num_words, loc, intended, target):
    """``intended[t]`` = the fold of the first ``num_words`` words of row ``t`` (``n`` rows at
    ``addr``, ``step`` bytes apart: :func:`_rows_readable`), ``target[t] = loc[t]``."""
    step_words = step // 8 if n > 1 else 0
    # One row spanning exactly the stored rows (no view past the last row's end); row t's
    # words start at t * step_words of it: a "page" of n tokens.
    words = numba.carray(i64_ptr(addr), (1, (n - 1) * step_words + row_bytes // 8))
    intended[:n] = fold_windows_nb(np.arange(n), words, n, step_words, num_words).view(np.int64)
    target[:n] = loc


@numba.njit(cache=True)
def _observe_in_place_nb(kv_addr, shape, strides, elem_size, loc_addr, loc_stride, n, num_tokens,
                         num_words, intended, target, stamp, j, epoch):  # fmt: skip
    """:func:`_observe_nb` of a store read where it is (``n`` slots int64 at ``loc_addr``;
    rows at ``kv_addr``, 2-D or 3-D ``shape`` with element ``strides``, of ``elem_size``
    bytes), stamping ``stamp[j] = epoch``. False, with nothing read or stamped, unless the
    store covers the forward's ``num_tokens`` tokens one row each, each row is contiguous
    whole int64 words at an 8-byte aligned address, rows do not overlap and the slots are
    contiguous."""
    ok = n == num_tokens and shape[0] == n and (loc_stride == 1 or n == 1)
    row_elems = 1
    for d in range(1, len(shape)):
        row_elems *= shape[d]
    if len(strides) == 3:
        ok &= strides[2] == 1 and strides[1] == shape[2]
    else:
        ok &= len(strides) == 2 and strides[1] == 1
    row_bytes, step = row_elems * elem_size, strides[0] * elem_size
    ok &= loc_addr % 8 == 0 and num_words * 8 <= row_bytes and _rows_readable(kv_addr, step, row_bytes, n)
    if not ok:
        return False
    stamp[j] = epoch
    _fold_rows(kv_addr, step, row_bytes, n, num_words, numba.carray(i64_ptr(loc_addr), (n,)),
               intended, target)  # fmt: skip
    return True


# A layer's row-observe block (int64 [watches, 7]; :meth:`StoreChecker.observe_rows`), one
# row per (watch, source) the layer's store feeds: K half (1) or V (0), source index, fold
# words, addresses of the watch's intended and target rows for that source and of its stamp
# array, and the tokens those rows hold.
_ROW_IS_K, _ROW_J, _ROW_WORDS, _ROW_INTENDED, _ROW_TARGET, _ROW_STAMP, _ROW_CAPACITY = range(7)


@numba.njit(cache=True)
def _observe_layer_rows_nb(block, state, n, loc_addr, rows, k_addr, k_step, v_addr, v_step,
                           row_bytes):  # fmt: skip
    """:func:`_observe_in_place_nb` for every watch of one layer's store, given as addresses:
    ``n`` slots (int64, contiguous) at ``loc_addr``, ``rows`` K rows at ``k_addr`` and V rows
    at ``v_addr``, each row ``row_bytes`` of contiguous whole int64 words, ``k_step`` /
    ``v_step`` bytes apart; ``state``: [epoch, the forward's tokens]. False, with nothing read
    or stamped, unless every address is 8-byte aligned, rows do not overlap, ``rows == n``
    and every watch's window fits in a row; else each watch stamped with the epoch and, when
    ``n`` is the forward's tokens, its intended / target rows filled (else every target
    -2: the store cannot be aligned with the forward's tokens)."""
    ok = rows == n and loc_addr % 8 == 0
    ok &= _rows_readable(k_addr, k_step, row_bytes, n) and _rows_readable(v_addr, v_step, row_bytes, n)
    for w in range(block.shape[0]):
        ok &= block[w, _ROW_WORDS] * 8 <= row_bytes
        ok &= n != state[1] or block[w, _ROW_CAPACITY] >= n
    if not ok:
        return False
    epoch, num_tokens = state[0], state[1]
    loc = numba.carray(i64_ptr(loc_addr), (n,))
    for w in range(block.shape[0]):
        j = block[w, _ROW_J]
        stamp = numba.carray(i64_ptr(block[w, _ROW_STAMP]), (j + 1,))
        stamp[j] = epoch
        capacity = block[w, _ROW_CAPACITY]
        target = numba.carray(i64_ptr(block[w, _ROW_TARGET]), (capacity,))
        if n != num_tokens:
            target[:] = _UNALIGNED
            continue
        if n == 0:
            continue
        addr, step = (k_addr, k_step) if block[w, _ROW_IS_K] else (v_addr, v_step)
        intended = numba.carray(i64_ptr(block[w, _ROW_INTENDED]), (capacity,))
        _fold_rows(addr, step, row_bytes, n, block[w, _ROW_WORDS], loc, intended, target)
    return True


@numba.njit(cache=True)
def _observe_rows_nb(kv, num_words, loc, intended, target):
    """:func:`_observe_nb` of a C-contiguous ``[n, ...]`` store (any dtype whose row is a
    whole number of int64 words), its rows seen as int64 words here."""
    n = kv.shape[0]
    _observe_nb(kv.reshape(n, kv.size // n).view(np.int64), num_words, loc, intended, target)


@numba.njit(cache=True)
def _check_nb(requests, num_reqs, slots, token_ids, positions, intended, target, stored, rec,
              ring, ring_index, tag):  # fmt: skip
    num_sources = intended.shape[0]
    num_bad = 0
    for r in range(num_reqs):
        start = requests[-2, r]
        for i in range(start, start + requests[-1, r]):
            s = slots[i]
            if s <= 0:
                continue
            acc = np.uint64(0)
            ok = stored
            for j in range(num_sources):
                ok &= target[j, i] == s
                acc = splitmix64_nb(acc ^ np.uint64(intended[j, i]))
            want = np.int64(acc) if ok else np.int64(0)
            if not ok or rec[s, 3] != want:
                _record(ring, ring_index, tag, s, positions[i], token_ids[i], token_ids[i],
                        rec[s, 3], want, _KV_STORE)  # fmt: skip
                rec[s, 3] = want
                num_bad += 1
    return num_bad


def kv_buffer_owners(pool: Any) -> dict[int, tuple[Any, int, KvHalf]]:
    """``data_ptr`` of every K / V layer buffer of ``pool`` and of its sub-pools
    (``full_kv_pool``, ``swa_kv_pool``) -> (the sub-pool whose ``set_kv_buffer`` writes it,
    its layer index there, the half)."""
    subs = [pool] + [getattr(pool, n) for n in ("full_kv_pool", "swa_kv_pool") if hasattr(pool, n)]
    return {
        buf.data_ptr(): (sub, layer, half)
        for sub in subs
        for half, bufs in ((KvHalf.K, getattr(sub, "k_buffer", None)),
                           (KvHalf.V, getattr(sub, "v_buffer", None)))
        for layer, buf in enumerate(bufs or [])
    }  # fmt: skip


class StoreChecker:
    """Watches the stores of every fingerprinted layer buffer of one canary."""

    def __init__(self, watches: list[StoreWatch]):
        self.watches = watches
        self.epoch = 0
        self.num_tokens = 0  # of the current forward
        self.generation = 0  # bumped when a watch's scratch is reallocated (fused_rows rebinds)
        self._capacity = -1  # tokens every watch's scratch holds (-1: not checked yet)
        self._ring: tuple[ViolationRing, np.ndarray, np.ndarray] | None = None  # numpy views
        # id(sub-pool) -> layer -> [(watch, source index, half)]
        self._targets: dict[int, dict[int, list[tuple[StoreWatch, int, KvHalf]]]] = {}
        # The in-place fold's compiled function per rank of the stores (2-D, 3-D): its other
        # arguments are Python ints and 1-D int64 scratch rows (kernels_numba.entry_point).
        self._in_place: dict[int, Any] = {}
        # observe_rows: [epoch, the forward's tokens] (what the compiled call reads of this
        # forward), the row-observe entries (block, their watches; see _observe_layer_rows_nb)
        # and their compiled function.
        self._state = np.zeros(2, dtype=np.int64)
        self._row_entries: list[tuple[np.ndarray, list[tuple[StoreWatch, int, bool]]]] = []
        self._rows_run: Any = None

    @staticmethod
    def for_groups(groups: Sequence[Any], v_half: bool) -> StoreChecker:
        watches = [
            StoreWatch(int(launch_tag(g.kind, LaunchStage.TAIL, half)),
                       g.records(LaunchStage.TAIL, half), g.real_kv_sources(LaunchStage.TAIL, half))
            for g in groups if g.per_position
            for half in g.halves(v_half) if _watchable(g.real_kv_sources(LaunchStage.TAIL, half))
        ]  # fmt: skip
        return StoreChecker(watches)

    @property
    def active(self) -> bool:
        return bool(self.watches)

    def attach(self, pool: Any) -> None:
        """Patch ``set_kv_buffer`` on every sub-pool that owns a fingerprinted buffer
        (:func:`kv_buffer_owners`)."""
        owners = kv_buffer_owners(pool)
        by_sub: dict[int, tuple[Any, dict[int, list[tuple[StoreWatch, int, KvHalf]]]]] = {}
        for w in self.watches:
            for j, source in enumerate(w.sources):
                owner = owners.get(source.tensor.data_ptr())
                if owner is not None:
                    sub, layer, half = owner
                    targets = by_sub.setdefault(id(sub), (sub, defaultdict(list)))[1]
                    targets[layer].append((w, j, half))
        for key, (sub, targets) in by_sub.items():
            if key not in self._targets:
                self._targets[key] = dict(targets)
                self._patch(sub, self._targets[key])
        # A buffer no patched set_kv_buffer writes (a pool that stores another way) is not
        # store-checked; TAIL still fingerprints it.
        watched = {id(w) for t in self._targets.values() for ts in t.values() for w, _, _ in ts}
        self.watches = [w for w in self.watches if id(w) in watched]

    def _patch(self, sub: Any, targets: dict[int, list[tuple[StoreWatch, int, KvHalf]]]) -> None:
        original = sub.set_kv_buffer
        # layer -> ([(watch, source index, K half?)], the dtype the layer stores), looked up
        # once here rather than per store
        layers = {
            layer: ([(w, j, half == KvHalf.K) for w, j, half in ts], sub.k_buffer[layer].dtype)
            for layer, ts in targets.items()
        }  # fmt: skip

        def observe(layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Any) -> None:
            watched = layers.get(layer_id)
            if watched is not None:
                for watch, j, is_k in watched[0]:
                    self.observe(watch, j, loc, k if is_k else v, watched[1])

        @functools.wraps(original)
        def set_kv_buffer(layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Any,
                          *args: Any, **kwargs: Any) -> Any:  # fmt: skip
            observe(layer_id, loc, k, v)
            return original(layer_id, loc, k, v, *args, **kwargs)

        # For a backend that stores itself (our CPU decode layer,
        # PagedAttentionBackend.rope_forward): the layers this wrapper observes, and the
        # observation alone, which it makes with what it stored at ``loc``.
        set_kv_buffer.kv_canary_observed_layers = frozenset(layers)  # type: ignore[attr-defined]
        set_kv_buffer.kv_canary_observe = observe  # type: ignore[attr-defined]
        if all(w._np is not None for ts in targets.values() for w, _, _ in ts):  # host scratch
            entries = {layer: self._row_entry(ts[0]) for layer, ts in layers.items()}

            def observe_rows(layer_id: int, n: int, loc_addr: int, rows: int, k_addr: int,
                             k_step: int, v_addr: int, v_step: int, row_bytes: int) -> bool:  # fmt: skip
                entry = entries.get(layer_id)
                return entry is None or self.observe_rows(
                    entry, n, loc_addr, rows, k_addr, k_step, v_addr, v_step, row_bytes)  # fmt: skip

            # The same observation from addresses (observe_rows): ~2 us a layer instead of ~5.
            set_kv_buffer.kv_canary_observe_rows = observe_rows  # type: ignore[attr-defined]
        sub.set_kv_buffer = set_kv_buffer

    def _row_entry(self, watched: list[tuple[StoreWatch, int, bool]],
                   ) -> tuple[np.ndarray, list[tuple[StoreWatch, int, bool]]]:  # fmt: skip
        """A layer's row-observe entry: its block (filled by :meth:`_fill_rows`) and watches."""
        entry = (np.zeros((len(watched), 7), dtype=np.int64), list(watched))
        self._row_entries.append(entry)
        self._fill_rows(entry)
        return entry

    @staticmethod
    def _fill_rows(entry: tuple[np.ndarray, list[tuple[StoreWatch, int, bool]]]) -> None:
        """(Re)write a row-observe block from its watches' scratch (reallocated as forwards
        grow: :meth:`begin_forward` calls this again)."""
        block, watched = entry
        for r, (w, j, is_k) in enumerate(watched):
            intended, target, num_words = cast(list[tuple[np.ndarray, np.ndarray, int]], w._rows)[j]
            block[r] = (int(is_k), j, num_words, intended.ctypes.data, target.ctypes.data,
                        w.stamp.ctypes.data, intended.shape[0])  # fmt: skip

    def observe_rows(self, entry: tuple[np.ndarray, list[tuple[StoreWatch, int, bool]]], n: int,
                     loc_addr: int, rows: int, k_addr: int, k_step: int, v_addr: int, v_step: int,
                     row_bytes: int) -> bool:  # fmt: skip
        """One layer's store, every watch of it (:meth:`observe` of each, its K or V rows),
        from addresses: ``n`` int64 slots at ``loc_addr``; ``rows`` K rows at ``k_addr``, V
        rows at ``v_addr``, ``k_step`` / ``v_step`` bytes apart, ``row_bytes`` each, the
        stored dtype's bytes as they are (the caller's promise: the layer stores them
        unconverted, each row contiguous). False, nothing done, where the layout is not one
        this reads (see :func:`_observe_layer_rows_nb`): call :meth:`observe` instead."""
        args = (entry[0], self._state, n, loc_addr, rows, k_addr, k_step, v_addr, v_step, row_bytes)
        run = self._rows_run
        if run is None:
            run = self._rows_run = entry_point(_observe_layer_rows_nb, *args)
        if not run(*args):
            return False
        for w, _, _ in entry[1]:
            w.armed = True
        return True

    def begin_forward(self, num_tokens: int) -> None:
        self.epoch += 1
        self.num_tokens = num_tokens
        self._state[0], self._state[1] = self.epoch, num_tokens
        if num_tokens <= self._capacity:  # every watch's scratch holds the forward
            return
        generation = self.generation
        for w in self.watches:
            if w.reserve(num_tokens):
                self.generation += 1
        self._capacity = min((w.intended.shape[1] for w in self.watches), default=num_tokens)
        if self.generation != generation:
            for entry in self._row_entries:
                self._fill_rows(entry)

    def targets(self, sub: Any) -> dict[int, list[tuple[StoreWatch, int, KvHalf]]] | None:
        """What :meth:`attach` watches on sub-pool ``sub``: layer -> [(watch, source index,
        half)] (None: nothing). A host whose ``set_kv_buffer`` speaks another signature
        re-wraps it and reports each store through :meth:`observe`."""
        return self._targets.get(id(sub))

    def observe(self, watch: StoreWatch, j: int, loc: torch.Tensor, kv: torch.Tensor,
                dtype: torch.dtype) -> None:  # fmt: skip
        """One store of ``kv`` (one row per token, stored as ``dtype``) at slots ``loc`` into
        the buffer of ``watch``'s source ``j``."""
        watch.armed = True
        fast = watch._rows
        size = _NUMPY_DTYPES.get(dtype) if kv.dtype is dtype else None  # (dtypes are singletons)
        if fast is not None and size and loc.dtype is torch.int64:
            # A decode step's path: k and v arrive as views of the model's projections (rows
            # strided), read in place; no torch call but the layout (each costs ~0.3 us right
            # after the model's forward; the compiled call checks it).
            intended, target, num_words = fast[j]
            args = (kv.data_ptr(), kv.shape, kv.stride(), size, loc.data_ptr(), loc.stride(0),
                    loc.shape[0], self.num_tokens, num_words, intended, target, watch.stamp, j,
                    self.epoch)  # fmt: skip
            run = self._in_place.get(len(args[2]))
            if run is None:  # (typed with a plain tuple for the shape: a torch.Size is one)
                run = self._in_place[len(args[2])] = entry_point(
                    _observe_in_place_nb, args[0], tuple(args[1]), *args[2:])  # fmt: skip
            if run(*args):
                return
        n = loc.shape[0]
        watch.stamp[j] = self.epoch
        if n != self.num_tokens:
            watch.target[j].fill_(_UNALIGNED)
            return
        if n == 0:
            return
        if fast is not None and size and size * kv.numel() // n % 8 == 0:
            intended, target, num_words = fast[j]
            _observe_rows_nb(kv.contiguous().numpy(), num_words, loc.numpy(), intended, target)
            return
        rows = (kv if kv.dtype == dtype else kv.to(dtype)).reshape(n, -1)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        words = rows.view(torch.int64)
        num_words = watch.sources[j].read_bytes // 8
        if loc.dtype != torch.int64:
            loc = loc.to(torch.int64)
        if watch._np is not None:
            intended, target = watch._np
            _observe_nb(words.numpy(), num_words, loc.numpy(), intended[j], target[j])
            return
        watch.intended[j, :n] = fold_real_kv_words_t(words[:, :num_words])
        watch.target[j, :n] = loc

    def watch_for(self, tag: int) -> StoreWatch | None:
        return next((w for w in self.watches if w.tag == tag), None)

    def check(self, watch: StoreWatch, plan: WritePlan | HostWritePlan, ring: ViolationRing) -> None:
        """After the TAIL write of ``watch``'s (group, half): the module doc's check."""
        if not plan.max_num_tokens or not watch.armed:
            return
        stored = bool((watch.stamp == self.epoch).all())
        if isinstance(plan, HostWritePlan) and watch._np is not None:
            if self._ring is None or self._ring[0] is not ring:
                self._ring = (ring, ring.rows.numpy(), ring.write_index.numpy())
            _check_nb(plan.requests, plan.bs, plan.slots, plan.token_ids, plan.positions,
                      watch._np[0], watch._np[1], stored, watch.records_np, self._ring[1],
                      self._ring[2], watch.tag)  # fmt: skip
            return
        if isinstance(plan, WritePlan):
            self._check_t(watch, plan, ring, stored)

    def _check_t(self, watch: StoreWatch, plan: WritePlan, ring: ViolationRing, stored: bool) -> None:
        counts, device = plan.num_tokens, plan.num_tokens.device
        bs, total = counts.shape[0], plan.total_num_tokens
        req = torch.repeat_interleave(torch.arange(bs, device=device), counts, output_size=total)
        first = torch.cumsum(counts, 0) - counts
        tok = plan.token_starts[req] + torch.arange(total, device=device) - first[req]
        slots = plan.slots[tok]
        s = slots.clamp(min=0)
        acc = torch.zeros(total, dtype=torch.int64, device=device)
        ok = torch.full((total,), stored, dtype=torch.bool, device=device)
        for j in range(watch.intended.shape[0]):
            ok &= watch.target[j, tok] == slots
            acc = splitmix64_t(acc ^ watch.intended[j, tok])
        want = torch.where(ok, acc, 0)
        rec = watch.records.view(torch.int64)
        pool_fp = rec[s, 3]
        bad = (slots > 0) & (~ok | (pool_fp != want))
        ids = plan.token_ids[tok]
        rows = torch.stack((torch.full_like(s, watch.tag), s, plan.positions[tok], ids, ids,
                            pool_fp, want, torch.full_like(s, _KV_STORE)), 1)  # fmt: skip
        ring.append_t(rows, bad)
        rec[:, 3].index_put_((s,), torch.where(bad, want, pool_fp))
