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
             under its HEAD K tag, as ``ViolationRing.append_holes``), then verify + write
             (:func:`.kernels_numba._launch_rows_kernel`)
    TAIL  tail_nb(batch, groups, launches)
          per launch: verify + write on the plans HEAD made, then the store check of its
          watch (:func:`.store_check._check_nb`, when the watch is armed)

Exactly the per-launch path's records, ring rows (same order), counters and errors
(``tests/canary/test_canary_fused_rows.py`` runs both on the same state and compares).
It applies when every group plans as rows and the per-launch argument tuples share one
numba type (a launch whose real-KV views differ in dtype or layout cannot be a member of
the homogeneous tuple these loops iterate): :meth:`FusedRowLaunches.build` returns None
otherwise, and the per-launch path runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np

from kvcanary.canary.constants import NO_TOKEN, FailReason, KvHalf, LaunchStage, launch_tag
from kvcanary.canary.kernels_numba import _NO_COUNTERS, _launch_rows_kernel, _np, _record
from kvcanary.canary.real_kv import numba_source_args
from kvcanary.canary.records import as_int64_records
from kvcanary.canary.ring import RunCounters, ViolationRing
from kvcanary.canary.row_plan import _NEED_SCRATCH, _OK, HostInputs, RowPlanner, _plan_rows
from kvcanary.canary.store_check import StoreChecker, StoreWatch, _check_nb

_NOT_RESIDENT = int(FailReason.VERIFY_NOT_RESIDENT)
# Per-group results of HEAD's planning: status, total verify, total extend, total write,
# max write, holes.
_STATUS, _TOTAL_VERIFY, _TOTAL_EXTEND, _TOTAL_WRITE, _MAX_WRITE, _NUM_HOLES = range(6)
# head_nb / tail_nb return codes (>= _PLAN_FAILED: + the group; >= _SLOT_ERROR: + the launch).
_DONE, _OVERFLOW, _PLAN_FAILED, _SLOT_ERROR = 0, 1, 2, 1 << 20
_NO_WATCH = (np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.int64),
             np.zeros(0, dtype=np.int64))  # fmt: skip


@numba.njit(cache=True)
def _head_nb(
    r2t, rows, prefix, extend, out_cache_loc, input_ids, positions, exp_ids, exp_positions,
    check_inputs, table, table_lens, has_table, windows, luts, has_luts, offsets, capacities,
    check_holes, requests_t, entries_t, write_slots_t, holes_t, out, launches, check_token,
    position_assert, ring, ring_index, v_runs, v_processed, w_runs, w_processed,
):  # fmt: skip
    num_groups = len(requests_t)
    num_tokens = input_ids.shape[0]
    overflow = False
    for g in range(num_groups):  # 1. plans only: a failure or a retry leaves no trace
        res = _plan_rows(
            r2t, rows, prefix, extend, out_cache_loc, num_tokens, positions.shape[0],
            exp_ids.shape[0], exp_positions.shape[0], windows[g], luts[g], has_luts[g], table,
            table_lens, has_table, offsets[g], capacities[g], check_holes[g], requests_t[g],
            entries_t[g], write_slots_t[g], holes_t[g],
        )  # fmt: skip
        for k in range(6):
            out[g, k] = res[k]
        if res[0] != _OK:
            return _PLAN_FAILED + g
        overflow |= res[1] > capacities[g]
    bs = rows.shape[0]
    for i, launch in enumerate(launches):  # 2. holes, then verify + write, in group order
        g, tag, hole_tag = launch[0], launch[1], launch[2]
        holes = holes_t[g]
        if hole_tag >= 0:
            for h in range(out[g, _NUM_HOLES]):
                _record(ring, ring_index, hole_tag, holes[0, h], holes[1, h], NO_TOKEN, NO_TOKEN,
                        0, holes[2, h], _NOT_RESIDENT)  # fmt: skip
        total_verify = out[g, _TOTAL_VERIFY]
        if _launch_rows_kernel(
            requests_t[g], bs, entries_t[g], total_verify if total_verify <= capacities[g] else 0,
            check_token and has_table, requests_t[g], bs, input_ids, positions, write_slots_t[g],
            out[g, _MAX_WRITE] > 0, check_inputs, exp_ids, exp_positions, position_assert, tag,
            launch[3], launch[4], launch[5], launch[6], launch[7], launch[8], launch[9], ring,
            ring_index, v_runs, v_processed, w_runs, w_processed,
        ):  # fmt: skip
            return _SLOT_ERROR + i
    return _OVERFLOW if overflow else _DONE


@numba.njit(cache=True)
def _tail_nb(
    bs, input_ids, positions, exp_ids, exp_positions, check_inputs, has_table, capacities,
    requests_t, entries_t, write_slots_t, out, launches, check_token, position_assert, epoch,
    ring, ring_index, v_runs, v_processed, w_runs, w_processed,
):  # fmt: skip
    for i, launch in enumerate(launches):
        g, tag, rec = launch[0], launch[1], launch[3]
        total_verify, max_write = out[g, _TOTAL_VERIFY], out[g, _MAX_WRITE]
        if _launch_rows_kernel(
            requests_t[g], bs, entries_t[g], total_verify if total_verify <= capacities[g] else 0,
            check_token and has_table, requests_t[g], bs, input_ids, positions, write_slots_t[g],
            max_write > 0, check_inputs, exp_ids, exp_positions, position_assert, tag, rec,
            launch[4], launch[5], launch[6], launch[7], launch[8], launch[9], ring, ring_index,
            v_runs, v_processed, w_runs, w_processed,
        ):  # fmt: skip
            return _SLOT_ERROR + i
        stamp = launch[12]
        if max_write > 0 and stamp.shape[0]:  # the store check, once its watch is armed
            armed, stored = False, True
            for j in range(stamp.shape[0]):
                armed |= stamp[j] >= 0  # StoreWatch.armed: set with the first stamp
                stored &= stamp[j] == epoch
            if armed:
                _check_nb(requests_t[g], bs, write_slots_t[g], input_ids, positions, launch[10],
                          launch[11], stored, rec, ring, ring_index, tag)  # fmt: skip
    return _DONE


class FusedRowLaunches:
    """HEAD and TAIL of one single-forward manager's groups as one compiled call each
    (module doc). Owns nothing but argument tuples: the scratch is the planners', the
    records, sources, ring, counters and store watches the canary's."""

    def __init__(self, planners: Sequence[RowPlanner], luts: tuple[np.ndarray, ...],
                 launches: tuple[tuple[Any, ...], ...], tails: tuple[tuple[Any, ...], ...],
                 tail_watches: Sequence[StoreWatch | None],
                 ring: ViolationRing, verify_counters: RunCounters | None,
                 write_counters: RunCounters | None,
                 store_checker: StoreChecker | None) -> None:  # fmt: skip
        self.planners = list(planners)
        n = len(self.planners)
        self.windows = np.array([p._window for p in self.planners], dtype=np.int64)
        self.has_luts = np.array([p._lut is not None for p in self.planners], dtype=np.bool_)
        self.offsets = np.array([p._offset for p in self.planners], dtype=np.int64)
        self.capacities = np.array([p.verify_capacity for p in self.planners], dtype=np.int64)
        self.check_holes = np.array([p._check_residency for p in self.planners], dtype=np.bool_)
        self.luts = luts
        self.launches, self.tails, self.tail_watches = launches, tails, list(tail_watches)
        self.ring_args = (_np(ring.rows), _np(ring.write_index))
        self.count_args = (*_counter_args(verify_counters), *_counter_args(write_counters))
        self.store_checker = store_checker
        self._watch_generation = 0 if store_checker is None else store_checker.generation
        self.out = np.zeros((n, 6), dtype=np.int64)
        self._bind_scratch()
        self._host: HostInputs | None = None

    @staticmethod
    def build(planners: Sequence[RowPlanner], groups: Sequence[Any], v_half: bool,
              ring: ViolationRing, verify_counters: RunCounters | None,
              write_counters: RunCounters | None,
              store_checker: StoreChecker | None) -> FusedRowLaunches | None:  # fmt: skip
        """The fused launches of ``groups`` (their planners, in order), or None when their
        arguments cannot share one numba type (the per-launch path then runs)."""
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
        if not (_one_type(luts) and _one_type(launches + tails)):
            return None
        return FusedRowLaunches(planners, luts, tuple(launches), tuple(tails), watches, ring,
                                verify_counters, write_counters, store_checker)  # fmt: skip

    def _bind_scratch(self) -> None:
        ps = self.planners
        self.scratch = (tuple(p._requests for p in ps), tuple(p._entries for p in ps),
                        tuple(p._write_slots for p in ps), tuple(p._holes for p in ps))  # fmt: skip

    def head(self, host: HostInputs, check_token: bool, position_assert: bool) -> bool:
        """Plan every group, record its holes, verify + write HEAD; True when a group's
        verify overflowed its capacity (its verify skipped; see :meth:`overflows`)."""
        ids, positions = host.expected_input_ids, host.expected_positions
        check_inputs = ids is not None and positions is not None
        table, lens = host.expected_token_table, host.expected_token_lens
        has_table = table is not None and lens is not None
        while True:
            requests, entries, write_slots, holes = self.scratch
            code = _head_nb(
                host.req_to_token, host.req_pool_indices, host.prefix_lens, host.extend_lens,
                host.out_cache_loc, host.input_ids, host.positions,
                ids if ids is not None else host.input_ids,
                positions if positions is not None else host.positions, check_inputs,
                table if has_table else _EMPTY_TABLE, lens if has_table else _EMPTY_LENS,
                has_table, self.windows, self.luts, self.has_luts, self.offsets,
                self.capacities, self.check_holes, requests, entries, write_slots, holes,
                self.out, self.launches, check_token, position_assert, *self.ring_args,
                *self.count_args,
            )  # fmt: skip
            if _PLAN_FAILED <= code < _SLOT_ERROR:
                g = code - _PLAN_FAILED
                status, total_verify, total_extend = (int(x) for x in self.out[g, :3])
                if status != _NEED_SCRATCH:
                    RowPlanner._raise(status, host, total_extend)
                self.planners[g]._grow(host.req_pool_indices.shape[0],
                                       host.out_cache_loc.shape[0], total_verify)  # fmt: skip
                self._bind_scratch()
                continue
            if code >= _SLOT_ERROR:
                raise IndexError("kv-canary: plan slot out of range of the canary buffer")
            self._host = host
            return code == _OVERFLOW

    def verify_entries(self, g: int) -> tuple[int, bool]:
        """Group ``g``'s verify entries this forward and whether they fit its capacity."""
        total = int(self.out[g, _TOTAL_VERIFY])
        return total, total <= int(self.capacities[g])

    def tail(self, check_token: bool, position_assert: bool) -> None:
        """Verify + write TAIL on HEAD's plans, then each launch's store check."""
        host = self._host
        if host is None:
            raise RuntimeError("kv-canary: fused TAIL without a HEAD in this forward")
        self._host = None
        checker = self.store_checker
        if checker is not None and checker.generation != self._watch_generation:
            self._bind_watches()
        ids, positions = host.expected_input_ids, host.expected_positions
        check_inputs = ids is not None and positions is not None
        has_table = host.expected_token_table is not None and host.expected_token_lens is not None
        requests, entries, write_slots, _ = self.scratch
        if _tail_nb(
            host.req_pool_indices.shape[0], host.input_ids, host.positions,
            ids if ids is not None else host.input_ids,
            positions if positions is not None else host.positions, check_inputs, has_table,
            self.capacities, requests, entries, write_slots, self.out, self.tails, check_token,
            position_assert, 0 if checker is None else checker.epoch, *self.ring_args,
            *self.count_args,
        ):  # fmt: skip
            raise IndexError("kv-canary: plan slot out of range of the canary buffer")

    def _bind_watches(self) -> None:
        """Re-read the store watches' scratch (reallocated when a forward outgrew it)."""
        self.tails = tuple((*t[:10], *_watch_args(w))
                           for t, w in zip(self.tails, self.tail_watches, strict=True))  # fmt: skip
        if self.store_checker is not None:
            self._watch_generation = self.store_checker.generation


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


def _one_type(values: Sequence[Any]) -> bool:
    """Whether numba types every value alike (a homogeneous tuple it can loop over)."""
    return len({numba.typeof(v) for v in values}) <= 1
