"""Fused row launches: a CPU canary's HEAD and TAIL of one forward, one compiled call each.

The row-plan path (:mod:`.row_plan`, :mod:`.kernels_numba`) plans each group and launches
each (group, half) from Python: on a tiny model that is six compiled calls per decode step
(plan FULL, plan SWA, HEAD x 2, TAIL x 2) and the Python around them, each paying the
cache-cold cost right after (or before) the model's forward; together they measured
~100 us of a ~2 ms tiny-swa decode step, five times the checks themselves. Here::

    HEAD  head_nb(batch, groups, launches)
          1. plan every group into its RowPlanner's scratch (nothing else is touched, so a
             plan that needs more scratch, or fails, leaves no trace: Python grows the
             scratch and calls again, or raises the planner's error)
          2. per launch (group, half), in group order: the group's holes (first half only,
             under its HEAD K tag, as ``ViolationRing.append_holes``), then its write
          3. per launch, in group order, its verify: every write before any verify (the
             alias check, :mod:`.dispatch`: groups may share a record buffer, as vLLM's do);
             every verify, HEAD's and TAIL's, with the reader chain
          4. each group's verify entries (0 when it overflowed) onto the SWA divergence
             reporter's totals, when it is on (``VerifyTotals.observe``)
    TAIL  tail_nb(batch, groups, launches)
          per launch: verify + write on the plans HEAD made, then the store check of its
          watch (:func:`.store_check._check_nb`, when the watch is armed)

A batch goes in as one "batch block" of addresses (``_head_batch_nb`` / ``_tail_batch_nb``,
same bodies), made once for a host's persistent arrays (the graph runner's decode buffers)
and per forward otherwise: each argument the dispatcher types costs time, most of all right
after the model's forward, and these calls skip the dispatcher altogether
(:func:`.kernels_numba.entry_point`). The planner and the launch are inlined into them,
the shared verify / write kernels called (one compiled body each but those; ~2 us less a
call at batch 1 than calls into separate code); the token table of a canary that verifies
tokens goes in the block too, and only a forward with a write-input assertion runs
``_head_nb`` / ``_tail_nb`` (the same bodies, arrays passed one by one). Exactly the
per-launch path's records, ring rows (same order), counters and errors
(``tests/canary/test_canary_fused_rows.py`` runs both on the same state and compares).
A host that makes its batch in a compiled call of its own may run HEAD there, whole or as
its phases (:func:`_plan_phase`, :func:`_write_phase`, then the verify; the vLLM worker's
``steps.head_step_nb``, or ``head_groups_nb`` for all of a hybrid model's groups), and hand
TAIL the batch block it filled (:meth:`FusedRowLaunches.opened`).
It applies when every group plans as rows and every array the block describes is int64
C-contiguous, but for real-KV words, which may be a column range of a wider tensor's rows
(:func:`_rows_ok`: vLLM's CPU layout, where they are one head's V rows of each block; the
block holds their row stride): :meth:`FusedRowLaunches.build` returns None otherwise, and
the per-launch path runs. On vLLM (tiny Llama, 16 decoding requests, in-process timers)
fused HEAD / TAIL took ~165 / ~160 -> ~87 / ~79 us a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numba
import numpy as np

from kvcanary.canary.kernels.numba_kernels import (
    _NO_COUNTERS,
    VERIFY_ROWS,
    VERIFY_ROWS_T,
    WRITE,
    WRITE_T,
    _check_tag,
    _count,
    _np,
    _record,
    entry_point,
    i64_ptr,
    split_args,
)
from kvcanary.canary.kernels.store_check import StoreChecker, StoreWatch, _check_nb
from kvcanary.canary.plan.rows import _NEED_SCRATCH, _OK, HostInputs, RowPlanner, _plan_rows
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import NO_TOKEN, FailReason, KvHalf, LaunchStage, launch_tag
from kvcanary.canary.wire.real_kv import numba_source_args
from kvcanary.canary.wire.records import as_int64_records
from kvcanary.jit.calls import call
from kvcanary.jit.parallel import parallel_lock

_NOT_RESIDENT = int(FailReason.VERIFY_NOT_RESIDENT)
# Per-group results of HEAD's planning: status, total verify, total extend, total write,
# max write, holes.
_STATUS, _TOTAL_VERIFY, _TOTAL_EXTEND, _TOTAL_WRITE, _MAX_WRITE, _NUM_HOLES = range(6)
# head_nb / tail_nb return codes (>= _PLAN_FAILED: + the group; >= _SLOT_ERROR: + the launch).
_DONE, _OVERFLOW, _PLAN_FAILED, _SLOT_ERROR = 0, 1, 2, 1 << 20
_NO_WATCH = (np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.int64),
             np.zeros(0, dtype=np.int64))  # fmt: skip

# The argument block (int64): every array a compiled call needs but the batch's, as
# (address, shape...) of an int64 C-contiguous array, so a call passes one array instead of
# ~40 (the dispatcher types each argument it is given: ~8 us a call, cold, for the tuples).
#   header   G, H, L (groups, HEAD launches, TAIL launches), ring [2D], ring index, verify
#            runs, verify processed, write runs, write processed [1D each], out [2D],
#            verify totals [1D] (the SWA divergence reporter's, or empty), threads and
#            min work of the verifies' split (:func:`.kernels_numba.split_args` when bound:
#            the first forward, or a scratch grown), the addresses of the verify and write
#            kernels (:data:`.kernels_numba.VERIFY_ROWS`, :data:`.kernels_numba.WRITE`)
#   group    window, has LUT, offset, capacity, check holes, LUT [1D], requests [2D],
#            entries [2D], write slots [1D], holes [2D], verify totals index (-1: none)
#   launch   group, tag, hole tag, sources, records [2D], words0..3 [2D: address, rows,
#            words from one row to the next (:func:`_rows_ok`: a column range of a wider
#            tensor's rows too)], meta [2D], watch intended [2D], watch target [2D], watch
#            stamp [1D]
# HEAD launches first, then TAIL's. The owner keeps every array alive (and rebuilds the block
# when one is reallocated).
#
# A batch block (int64 [18]) describes a forward batch the same way: (address, length) of
# its req_pool_indices, prefix_lens, extend_lens, out_cache_loc, input_ids, positions, each
# int64 C-contiguous; then the token table (address, rows, columns; int64 C-contiguous), its
# lengths per batch row (address, length) and whether there is one (placeholder arrays when
# not); made once for a host's persistent batch arrays without a token table
# (ForwardBatch.host_arrays), per forward otherwise, so a call passes 3 arrays instead of 14
# (:meth:`FusedRowLaunches.batch_block`).
_HEADER = 25
_SPLIT = 21  # [threads, min work] (kernels_numba.split_args)
_VERIFY_FN, _WRITE_FN = 23, 24  # the verify and write kernels' addresses
_GROUP_W = 19
_LAUNCH_W = 30
_BATCH_W = 18


@numba.njit(cache=True)
def _batch_block_nb(rows, prefix, extend, out_cache_loc, input_ids, positions, table, lens,
                    has_table):  # fmt: skip
    """The batch block (see above ``_HEADER``) of six int64 1-D C-contiguous arrays and a
    token table (int64 2-D C-contiguous) with its per-row lengths, or placeholders."""
    blk = np.empty(_BATCH_W, dtype=np.int64)
    blk[0], blk[1] = rows.ctypes.data, rows.shape[0]
    blk[2], blk[3] = prefix.ctypes.data, prefix.shape[0]
    blk[4], blk[5] = extend.ctypes.data, extend.shape[0]
    blk[6], blk[7] = out_cache_loc.ctypes.data, out_cache_loc.shape[0]
    blk[8], blk[9] = input_ids.ctypes.data, input_ids.shape[0]
    blk[10], blk[11] = positions.ctypes.data, positions.shape[0]
    blk[12], blk[13], blk[14] = table.ctypes.data, table.shape[0], table.shape[1]
    blk[15], blk[16] = lens.ctypes.data, lens.shape[0]
    blk[17] = has_table
    return blk


_INT64 = np.dtype(np.int64)
_batch_block_entry: Any = None


@numba.njit(cache=True, inline="always")
def _a1(blk, k):
    return numba.carray(i64_ptr(blk[k]), (blk[k + 1],))


@numba.njit(cache=True, inline="always")
def _a2(blk, k):
    return numba.carray(i64_ptr(blk[k]), (blk[k + 1], blk[k + 2]))


@numba.njit(cache=True, inline="always")
def _launch_write(blk, k, bs, input_ids, positions, exp_ids, exp_positions, check_inputs,
                  position_assert):  # fmt: skip
    """The write of the launch at ``blk[k]`` on its group's plan."""
    out = _a2(blk, 16)
    g = blk[k]
    kg = _HEADER + g * _GROUP_W
    tag = blk[k + 1]
    w_runs, w_processed = _a1(blk, 12), _a1(blk, 14)
    if out[g, _MAX_WRITE] > 0:
        # (as kernels_numba._launch_rows_kernel, the kernel called through its address)
        call(WRITE_T, blk[_WRITE_FN], (
            _a2(blk, kg + 7), bs, input_ids, positions, _a1(blk, kg + 13), check_inputs,
            exp_ids, exp_positions, position_assert, tag, _a2(blk, k + 4), _a2(blk, k + 7),
            _a2(blk, k + 10), _a2(blk, k + 13), _a2(blk, k + 16), _a2(blk, k + 19), blk[k + 3],
            _a2(blk, 3), _a1(blk, 6), w_runs, w_processed, blk[_SPLIT : _SPLIT + 2]))  # fmt: skip
    else:  # a write without tokens counts its launch, as write() does
        _check_tag(tag, w_runs)
        _count(w_runs, w_processed, tag, 0)


@numba.njit(cache=True, inline="always")
def _launch_verify(blk, k, bs, has_table, check_token):
    """The verify of the launch at ``blk[k]`` on its group's plan, with the reader chain
    (the verify kernel called through its address); its error status."""
    out = _a2(blk, 16)
    g = blk[k]
    kg = _HEADER + g * _GROUP_W
    total_verify = out[g, _TOTAL_VERIFY]
    num_verify = total_verify if total_verify <= blk[kg + 3] else 0
    return call(VERIFY_ROWS_T, blk[_VERIFY_FN], (
        _a2(blk, kg + 7), bs, _a2(blk, kg + 10), num_verify, check_token and has_table,
        blk[k + 1], _a2(blk, k + 4), _a2(blk, k + 7), _a2(blk, k + 10), _a2(blk, k + 13),
        _a2(blk, k + 16), _a2(blk, k + 19), blk[k + 3], _a2(blk, 3), _a1(blk, 6), _a1(blk, 8),
        _a1(blk, 10), blk[_SPLIT : _SPLIT + 2], True))  # fmt: skip


@numba.njit(cache=True, inline="always")
def _verify_body(bs, has_table, check_token, blk):
    """HEAD's verifies (3.) and the divergence reporter's totals (4.)."""
    num_groups, num_launches = blk[0], blk[1]
    out = _a2(blk, 16)
    launches = _HEADER + num_groups * _GROUP_W
    for i in range(num_launches):  # 3. every verify after every write: the alias check
        if _launch_verify(blk, launches + i * _LAUNCH_W, bs, has_table, check_token):
            return _SLOT_ERROR + i
    totals = _a1(blk, 19)  # 4. the SWA divergence reporter's totals (VerifyTotals.observe)
    for g in range(num_groups):
        k = _HEADER + g * _GROUP_W
        if blk[k + 18] >= 0 and out[g, _TOTAL_VERIFY] <= blk[k + 3]:
            totals[blk[k + 18]] += out[g, _TOTAL_VERIFY]
    return _DONE


@numba.njit(cache=True)
def _head_verify_nb(bs, has_table, check_token, blk):
    """HEAD's verifies alone, after a HEAD called with ``verify`` False (the host runs every
    canary's writes before any canary's verifies: its groups share a record buffer)."""
    return _verify_body(bs, has_table, check_token, blk)


@numba.njit(cache=True, inline="always")
def _plan_phase(r2t, rows, prefix, extend, out_cache_loc, num_tokens, num_positions,
                num_exp_ids, num_exp_positions, table, table_lens, has_table, blk):  # fmt: skip
    """HEAD's first part: every group's plan, nothing written (a failure or a retry leaves
    no trace). ``_PLAN_FAILED + g`` when group g's plan failed, else ``_OVERFLOW`` when a
    group's verify exceeds its capacity, else ``_DONE``."""
    num_groups = blk[0]
    out = _a2(blk, 16)
    overflow = False
    for g in range(num_groups):
        k = _HEADER + g * _GROUP_W
        res = _plan_rows(
            r2t, rows, prefix, extend, out_cache_loc, num_tokens, num_positions, num_exp_ids,
            num_exp_positions, blk[k], _a1(blk, k + 5), blk[k + 1] != 0, table, table_lens,
            has_table, blk[k + 2], blk[k + 3], blk[k + 4], _a2(blk, k + 7), _a2(blk, k + 10),
            _a1(blk, k + 13), _a2(blk, k + 15),
        )  # fmt: skip
        for j in range(6):
            out[g, j] = res[j]
        if res[0] != _OK:
            return _PLAN_FAILED + g
        overflow |= res[1] > blk[k + 3]
    return _OVERFLOW if overflow else _DONE


@numba.njit(cache=True, inline="always")
def _write_phase(bs, input_ids, positions, exp_ids, exp_positions, check_inputs,
                 position_assert, blk):  # fmt: skip
    """HEAD's second part, on the plans of :func:`_plan_phase`: each launch's holes, then
    its write, in group order."""
    num_groups, num_launches = blk[0], blk[1]
    out, ring, ring_index = _a2(blk, 16), _a2(blk, 3), _a1(blk, 6)
    launches = _HEADER + num_groups * _GROUP_W
    for i in range(num_launches):
        k = launches + i * _LAUNCH_W
        g, hole_tag = blk[k], blk[k + 2]
        if hole_tag >= 0:
            holes = _a2(blk, _HEADER + g * _GROUP_W + 15)
            for h in range(out[g, _NUM_HOLES]):
                _record(ring, ring_index, hole_tag, holes[0, h], holes[1, h], NO_TOKEN, NO_TOKEN,
                        0, holes[2, h], _NOT_RESIDENT)  # fmt: skip
        _launch_write(blk, k, bs, input_ids, positions, exp_ids, exp_positions, check_inputs,
                      position_assert)  # fmt: skip


@numba.njit(cache=True, inline="always")
def _head_body(
    r2t, rows, prefix, extend, out_cache_loc, input_ids, positions, exp_ids, exp_positions,
    check_inputs, table, table_lens, has_table, check_token, position_assert, verify, blk,
):  # fmt: skip
    code = _plan_phase(r2t, rows, prefix, extend, out_cache_loc, input_ids.shape[0],
                       positions.shape[0], exp_ids.shape[0], exp_positions.shape[0], table,
                       table_lens, has_table, blk)  # fmt: skip
    if code >= _PLAN_FAILED:
        return code
    bs = rows.shape[0]
    _write_phase(bs, input_ids, positions, exp_ids, exp_positions, check_inputs,
                 position_assert, blk)  # fmt: skip
    if verify:
        status = _verify_body(bs, has_table, check_token, blk)
        if status != _DONE:
            return status
    return code


@numba.njit(cache=True)
def _head_nb(
    r2t, rows, prefix, extend, out_cache_loc, input_ids, positions, exp_ids, exp_positions,
    check_inputs, table, table_lens, has_table, check_token, position_assert, verify, blk,
):  # fmt: skip
    return _head_body(
        r2t, rows, prefix, extend, out_cache_loc, input_ids, positions, exp_ids, exp_positions,
        check_inputs, table, table_lens, has_table, check_token, position_assert, verify, blk,
    )  # fmt: skip


@numba.njit(cache=True)
def _head_batch_nb(r2t, batch, check_token, position_assert, verify, blk):
    """:func:`_head_nb` of a batch described by a batch block (see above ``_HEADER``; no
    write-input assertion; its token table, if any)."""
    ids, positions = _a1(batch, 8), _a1(batch, 10)
    return _head_body(
        r2t, _a1(batch, 0), _a1(batch, 2), _a1(batch, 4), _a1(batch, 6), ids, positions, ids,
        positions, False, _a2(batch, 12), _a1(batch, 15), batch[17] != 0, check_token,
        position_assert, verify, blk,
    )  # fmt: skip


@numba.njit(cache=True, inline="always")
def _tail_body(
    bs, input_ids, positions, exp_ids, exp_positions, check_inputs, has_table, check_token,
    position_assert, epoch, blk,
):  # fmt: skip
    num_groups, num_heads, num_launches = blk[0], blk[1], blk[2]
    out, ring, ring_index = _a2(blk, 16), _a2(blk, 3), _a1(blk, 6)
    launches = _HEADER + num_groups * _GROUP_W + num_heads * _LAUNCH_W
    for i in range(num_launches):
        k = launches + i * _LAUNCH_W
        if _launch_verify(blk, k, bs, has_table, check_token):
            return _SLOT_ERROR + i
        _launch_write(blk, k, bs, input_ids, positions, exp_ids, exp_positions, check_inputs,
                      position_assert)  # fmt: skip
        g = blk[k]
        stamp = _a1(blk, k + 28)
        if out[g, _MAX_WRITE] > 0 and stamp.shape[0]:  # the store check, once armed
            armed, stored = False, True
            for j in range(stamp.shape[0]):
                armed |= stamp[j] >= 0  # StoreWatch.armed: set with the first stamp
                stored &= stamp[j] == epoch
            if armed:
                kg = _HEADER + g * _GROUP_W
                _check_nb(_a2(blk, kg + 7), bs, _a1(blk, kg + 13), input_ids, positions,
                          _a2(blk, k + 22), _a2(blk, k + 25), stored, _a2(blk, k + 4), ring,
                          ring_index, blk[k + 1])  # fmt: skip
    return _DONE


@numba.njit(cache=True)
def _tail_nb(
    bs, input_ids, positions, exp_ids, exp_positions, check_inputs, has_table, check_token,
    position_assert, epoch, blk,
):  # fmt: skip
    return _tail_body(bs, input_ids, positions, exp_ids, exp_positions, check_inputs, has_table,
                      check_token, position_assert, epoch, blk)  # fmt: skip


@numba.njit(cache=True)
def _tail_batch_nb(batch, check_token, position_assert, epoch, blk):
    """:func:`_tail_nb` of a batch described by a batch block (as :func:`_head_batch_nb`)."""
    ids, positions = _a1(batch, 8), _a1(batch, 10)
    return _tail_body(batch[1], ids, positions, ids, positions, False, batch[17] != 0,
                      check_token, position_assert, epoch, blk)  # fmt: skip


class FusedRowLaunches:
    """HEAD and TAIL of one single-forward manager's groups as one compiled call each
    (module doc). Owns nothing but argument tuples: the scratch is the planners', the
    records, sources, ring, counters and store watches the canary's."""

    # head / _head_nb's codes (a host that runs HEAD itself reads them)
    OVERFLOW, PLAN_FAILED, SLOT_ERROR = _OVERFLOW, _PLAN_FAILED, _SLOT_ERROR

    def __init__(self, planners: Sequence[RowPlanner], luts: tuple[np.ndarray, ...],
                 launches: tuple[tuple[Any, ...], ...], tails: tuple[tuple[Any, ...], ...],
                 tail_watches: Sequence[StoreWatch | None],
                 ring: ViolationRing, verify_counters: RunCounters | None,
                 write_counters: RunCounters | None,
                 store_checker: StoreChecker | None,
                 verify_totals: tuple[np.ndarray, Sequence[int]] | None = None) -> None:  # fmt: skip
        self.planners = list(planners)
        n = len(self.planners)
        self.windows = np.array([p._window for p in self.planners], dtype=np.int64)
        self.has_luts = np.array([p._lut is not None for p in self.planners], dtype=np.bool_)
        self.offsets = np.array([p._offset for p in self.planners], dtype=np.int64)
        self.capacities = np.array([p.verify_capacity for p in self.planners], dtype=np.int64)
        self.check_holes = np.array([p._check_residency for p in self.planners], dtype=np.int64)
        self.luts = luts
        self.launches, self.tails, self.tail_watches = launches, tails, list(tail_watches)
        self.ring_args = (_np(ring.rows), _np(ring.write_index))
        self.count_args = (*_counter_args(verify_counters), *_counter_args(write_counters))
        self.store_checker = store_checker
        self._watch_generation = 0 if store_checker is None else store_checker.generation
        self.out = np.zeros((n, 6), dtype=np.int64)
        # HEAD adds each group's verify entries (0 when it overflowed) to the SWA divergence
        # reporter's totals at its index, as VerifyTotals.observe would.
        self.totals: np.ndarray = np.zeros(0, dtype=np.int64)
        self.totals_index: Sequence[int] = [-1] * n
        if verify_totals is not None:
            self.totals, self.totals_index = verify_totals
        self.bind()
        # TAIL's arguments, set by HEAD: (bs, the batch's token ids, positions, expected ids
        # and positions, check inputs, has table, check token, position assert), or (batch
        # block, check token, position assert); and the HostInputs whose arrays a batch block
        # points into (kept alive until TAIL: a prefill's are made per forward).
        self._tail_call: tuple[Any, ...] | None = None
        # (batch rows, has a token table, check tokens) of the last HEAD: head_verify's
        self._verify_call: tuple[int, bool, bool] = (0, False, False)
        self._tail_host: HostInputs | None = None
        # The batch-block calls' compiled functions (:func:`.kernels_numba.entry_point`: their
        # argument types are fixed, int64 blocks made here and Python scalars, but for
        # req_to_token's): (the req_to_token HEAD's is for, HEAD's), TAIL's.
        self._head_entry: tuple[np.ndarray, Any] | None = None
        self._tail_entry: Any = None

    @staticmethod
    def build(planners: Sequence[RowPlanner], groups: Sequence[Any], v_half: bool,
              ring: ViolationRing, verify_counters: RunCounters | None,
              write_counters: RunCounters | None,
              store_checker: StoreChecker | None,
              verify_totals: tuple[np.ndarray, Sequence[int]] | None = None,
              ) -> FusedRowLaunches | None:  # fmt: skip
        """The fused launches of ``groups`` (their planners, in order), or None when their
        arguments cannot share one numba type (the per-launch path then runs).
        ``verify_totals``: (int64 totals, each group's index into them or -1), which HEAD
        adds the groups' verify entries to."""
        if not groups or not all(g.per_position for g in groups):
            return None
        luts = tuple(p._lut_np for p in planners)
        launches, tails, watches = [], [], []
        for gi, g in enumerate(groups):
            for hi, half in enumerate(g.halves(v_half)):
                hole_tag = int(launch_tag(g.kind, LaunchStage.HEAD, KvHalf.K)) if hi == 0 else -1
                launches.append(_launch_tuple(gi, g, LaunchStage.HEAD, half, hole_tag, None))
                tag = int(launch_tag(g.kind, LaunchStage.TAIL, half))
                watch = None if store_checker is None else store_checker.watch_for(tag)
                tails.append(_launch_tuple(gi, g, LaunchStage.TAIL, half, -1, watch))
                watches.append(watch)
        if not all(_flat_ok(a) for a in luts) or not all(
            (_rows_ok if _WORDS <= i < _WORDS + 4 else _flat_ok)(a)
            for t in launches + tails for i, a in enumerate(t) if isinstance(a, np.ndarray)
        ):  # fmt: skip
            return None
        if verify_totals is not None and not _flat_ok(verify_totals[0]):
            return None
        return FusedRowLaunches(planners, luts, tuple(launches), tuple(tails), watches, ring,
                                verify_counters, write_counters, store_checker,
                                verify_totals)  # fmt: skip

    def bind(self) -> None:
        """(Re)build the argument block (see ``_HEADER``) from the launches, the planners'
        scratch and the store watches; call after any of them was replaced."""
        ps, n = self.planners, len(self.planners)
        ring, index = self.ring_args
        words: list[int] = [n, len(self.launches), len(self.tails)]
        keep: list[np.ndarray] = []

        def arr(a: np.ndarray) -> None:
            if not _flat_ok(a):
                raise ValueError("kv-canary fused launches: an array is not int64 C-contiguous")
            keep.append(a)
            words.extend((a.ctypes.data, *a.shape))

        def rows(a: np.ndarray) -> None:  # a real-KV source's words
            keep.append(a)
            words.extend(_describe_rows(a))

        for a in (ring, index, *self.count_args, self.out, self.totals):
            arr(a)
        words += split_args().tolist()  # the threads now: the first forward, or a scratch grown
        words += [VERIFY_ROWS.address(), WRITE.address()]
        for i, p in enumerate(ps):
            words.extend((int(self.windows[i]), int(self.has_luts[i]), int(self.offsets[i]),
                          int(self.capacities[i]), int(self.check_holes[i])))  # fmt: skip
            for a in (self.luts[i], p._requests, p._entries, p._write_slots, p._holes):
                arr(a)
            words.append(int(self.totals_index[i]))
        for t in (*self.launches, *self.tails):
            words.extend((t[0], t[1], t[2], t[9]))
            arr(t[3])
            for a in t[_WORDS : _WORDS + 4]:
                rows(a)
            for a in (t[8], *t[10:13]):
                arr(a)
        self._block = np.array(words, dtype=np.int64)
        self._keep = keep  # the block holds their addresses

    @property
    def tail_entry(self) -> Any:
        """TAIL's compiled entry for batch blocks, once a HEAD with one resolved it."""
        return self._tail_entry

    @property
    def block(self) -> np.ndarray:
        """The argument block (see ``_HEADER``) a compiled HEAD / TAIL call takes."""
        return self._block

    def opened(self, batch: np.ndarray, check_token: bool, position_assert: bool) -> None:
        """After a host ran HEAD itself (its phases on the batch ``batch`` describes, a
        batch block whose arrays the host keeps alive until TAIL): what :meth:`tail`
        needs, as :meth:`head` leaves it (its verifies ran: no :meth:`head_verify`)."""
        self._tail_call, self._tail_host = (batch, check_token, position_assert), None

    @staticmethod
    def batch_block(host: HostInputs) -> np.ndarray | None:
        """The batch block of ``host`` (see ``_HEADER``; it holds addresses: keep ``host``
        alive with it), or None when ``host`` carries a write-input assertion, or an array
        is not int64 C-contiguous (1-D; its token table 2-D)."""
        if host.expected_input_ids is not None:
            return None
        arrays = (host.req_pool_indices, host.prefix_lens, host.extend_lens, host.out_cache_loc,
                  host.input_ids, host.positions)  # fmt: skip
        table, lens = _EMPTY_TABLE, _EMPTY_LENS
        has_table = host.expected_token_table is not None and host.expected_token_lens is not None
        if has_table:
            table, lens = cast(tuple[np.ndarray, np.ndarray],
                               (host.expected_token_table, host.expected_token_lens))  # fmt: skip
        # (per forward: no numpy flags / ctypes objects, ~50 us cold; dtypes compared by
        # value: numba's arrays carry an int64 descr other than np.dtype(np.int64))
        for a in (*arrays, lens):
            if a.dtype != _INT64 or a.ndim != 1 or (a.shape[0] > 1 and a.strides[0] != 8):
                return None
        rows, cols = table.shape if table.ndim == 2 else (0, 0)
        if table.dtype != _INT64 or table.ndim != 2 or (rows > 1 and table.strides[0] != 8 * cols) or (
                cols > 1 and table.strides[1] != 8):  # fmt: skip
            return None
        global _batch_block_entry
        if _batch_block_entry is None:  # (every call: the same argument types)
            _batch_block_entry = entry_point(_batch_block_nb, *arrays, _EMPTY_TABLE,
                                             _EMPTY_LENS, False)  # fmt: skip
        return cast(np.ndarray, _batch_block_entry(*arrays, table, lens, has_table))

    def head(self, host: HostInputs, check_token: bool, position_assert: bool,
             batch: np.ndarray | None = None, verify: bool = True) -> bool:  # fmt: skip
        """Plan every group, record its holes, write HEAD, then verify it (``verify`` False:
        :meth:`head_verify` does, later); True when a group's verify overflowed its
        capacity (its verify skipped; see :meth:`verify_entries`). ``batch``: ``host``'s
        :meth:`batch_block`, when it has one (fewer arguments to pass)."""
        self._verify_call = (host.req_pool_indices.shape[0], host.expected_token_table is not None
                             and host.expected_token_lens is not None, check_token)  # fmt: skip
        if batch is not None:
            r2t = host.req_to_token
            head = self._head_entry
            if head is None or head[0] is not r2t:
                head = self._head_entry = (r2t, entry_point(
                    _head_batch_nb, r2t, batch, check_token, position_assert, True,
                    self._block))  # fmt: skip
                self._tail_entry = entry_point(_tail_batch_nb, batch, check_token,
                                               position_assert, 0, self._block)  # fmt: skip
            while True:
                with parallel_lock:
                    code = head[1](r2t, batch, check_token, position_assert, verify, self._block)
                if code <= _OVERFLOW or not self._retry(code, host):
                    self._tail_call, self._tail_host = (batch, check_token, position_assert), host
                    return code == _OVERFLOW
        ids, positions = host.expected_input_ids, host.expected_positions
        check_inputs = ids is not None and positions is not None
        table, lens = host.expected_token_table, host.expected_token_lens
        has_table = table is not None and lens is not None
        # What TAIL passes too (the same checks, on the same batch).
        tokens = (host.input_ids, host.positions, host.input_ids if ids is None else ids,
                  host.positions if positions is None else positions, check_inputs)  # fmt: skip
        while True:
            with parallel_lock:
                code = _head_nb(
                    host.req_to_token, host.req_pool_indices, host.prefix_lens,
                    host.extend_lens, host.out_cache_loc, *tokens,
                    table if has_table else _EMPTY_TABLE, lens if has_table else _EMPTY_LENS,
                    has_table, check_token, position_assert, verify, self._block,
                )  # fmt: skip
            if not self._retry(code, host):
                self._tail_call = (host.req_pool_indices.shape[0], *tokens, has_table,
                                   check_token, position_assert)  # fmt: skip
                return code == _OVERFLOW

    def head_verify(self) -> None:
        """The verifies of a :meth:`head` called with ``verify`` False."""
        with parallel_lock:
            code = _head_verify_nb(*self._verify_call, self._block)
        if code >= _SLOT_ERROR:
            raise IndexError("kv-canary: plan slot out of range of the canary buffer")

    def _retry(self, code: int, host: HostInputs) -> bool:
        """After a HEAD call: True when a group's plan needed more scratch (grown: call
        again); raises the planner's error or a slot error; False when HEAD ran."""
        if _PLAN_FAILED <= code < _SLOT_ERROR:
            g = code - _PLAN_FAILED
            status, total_verify, total_extend = (int(x) for x in self.out[g, :3])
            if status != _NEED_SCRATCH:
                RowPlanner._raise(status, host, total_extend)
            self.planners[g]._grow(host.req_pool_indices.shape[0], host.out_cache_loc.shape[0],
                                   total_verify)  # fmt: skip
            self.bind()
            return True
        if code >= _SLOT_ERROR:
            raise IndexError("kv-canary: plan slot out of range of the canary buffer")
        return False

    def verify_entries(self, g: int) -> tuple[int, bool]:
        """Group ``g``'s verify entries this forward and whether they fit its capacity."""
        total = int(self.out[g, _TOTAL_VERIFY])
        return total, total <= int(self.capacities[g])

    def tail_ran(self) -> None:
        """A host ran this forward's TAIL itself, in a compiled call of its own (its
        HEAD's batch block, no store check: the vLLM worker's ``steps.tail_groups_nb``)."""
        if self._tail_call is None:
            raise RuntimeError("kv-canary: fused TAIL without a HEAD in this forward")
        self._tail_call = self._tail_host = None

    def tail(self) -> None:
        """Verify + write TAIL on HEAD's plans (and its batch and checks), then each
        launch's store check."""
        call, self._tail_call = self._tail_call, None
        if call is None:
            raise RuntimeError("kv-canary: fused TAIL without a HEAD in this forward")
        checker = self.store_checker
        epoch = 0
        if checker is not None:
            epoch = checker.epoch
            if checker.generation != self._watch_generation:
                self._bind_watches()
        with parallel_lock:
            if len(call) == 3:  # (HEAD resolved the entry)
                status = self._tail_entry(*call, epoch, self._block)
            else:
                status = _tail_nb(*(*call, epoch, self._block))
        self._tail_host = None
        if status:
            raise IndexError("kv-canary: plan slot out of range of the canary buffer")

    def _bind_watches(self) -> None:
        """Re-read the store watches' scratch (reallocated when a forward outgrew it)."""
        self.tails = tuple((*t[:10], *_watch_args(w))
                           for t, w in zip(self.tails, self.tail_watches, strict=True))  # fmt: skip
        if self.store_checker is not None:
            self._watch_generation = self.store_checker.generation
        self.bind()


_EMPTY_TABLE = np.zeros((1, 1), dtype=np.int64)
_EMPTY_LENS = np.zeros(1, dtype=np.int64)


def _counter_args(counters: RunCounters | None) -> tuple[np.ndarray, np.ndarray]:
    if counters is None:
        return _NO_COUNTERS
    return _np(counters.kernel_runs), _np(counters.slots_processed)


def _watch_args(watch: StoreWatch | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if watch is None or watch._np is None:
        return _NO_WATCH
    return watch._np[0], watch._np[1], watch.stamp


def _launch_tuple(gi: int, group: Any, stage: LaunchStage, half: KvHalf, hole_tag: int,
                  watch: StoreWatch | None) -> tuple[Any, ...]:  # fmt: skip
    """``(group, tag, hole tag, records, words0..3, meta, num sources, intended, target,
    stamp)``: one launch's arguments (the last three: its store watch's, or empty)."""
    sources = group.real_kv_sources(stage, half)
    return (gi, int(launch_tag(group.kind, stage, half)), hole_tag,
            _np(as_int64_records(group.records(stage, half))), *numba_source_args(sources),
            *_watch_args(watch))  # fmt: skip


def _flat_ok(a: np.ndarray) -> bool:
    """An array the block can describe: int64, C-contiguous, at most 2-D."""
    return a.dtype == np.int64 and a.flags.c_contiguous and a.ndim <= 2


# A launch tuple's real-KV words arrays: t[_WORDS : _WORDS + 4] (see _launch_tuple).
_WORDS = 4


def _describe_rows(a: np.ndarray) -> tuple[int, int, int]:
    """Real-KV words ``a`` (:func:`_rows_ok`) as the block holds them: (address, rows, int64
    words from one row to the next); ``_a2`` reads them back as C-contiguous rows that
    wide."""
    if not _rows_ok(a):
        raise ValueError("kv-canary fused launches: real-KV words are not int64 rows")
    stride = a.shape[1] if a.shape[0] <= 1 or a.flags.c_contiguous else a.strides[0] // 8
    return a.ctypes.data, a.shape[0], stride


def _rows_ok(a: np.ndarray) -> bool:
    """Real-KV words the block can describe as (address, rows, row stride): 2-D int64 whose
    words within a row are contiguous and whose rows do not overlap (a column range of a
    wider tensor's rows: vLLM's CPU layout, one head's slice of each block). The compiled
    calls see them as C-contiguous rows of ``stride`` words, of which the kernels read only
    the source's own (``meta``: page size x words per token), so a row's tail past the
    slice (the last one's past the tensor) is never read."""
    return a.dtype == np.int64 and a.ndim == 2 and (a.flags.c_contiguous or (
        a.strides[1] == 8 and a.strides[0] % 8 == 0 and a.strides[0] >= 8 * a.shape[1]))
