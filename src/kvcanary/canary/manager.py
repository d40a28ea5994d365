"""CanaryManager: the installed canary of one host (see :mod:`.host` for the contract).

It owns the device state (violation ring, per-tag run counters), one
:class:`SingleForwardManager` per forward of a step (1; a speculative draft runner would
have one per draft step), the pump and the reporter, and takes the host's three calls::

    host forward(batch):
      canary.before_forward(batch)     SFM pre-ops, perturbation pre-forward hook, then per
                                       group: plan -> holes -> HEAD verify / write
      ... the host's own pre-forward work (attention metadata), the model forward ...
      canary.after_forward(batch)      per group: TAIL verify / write (+ store check); SFM
                                       post-ops, perturbation post-forward hook, radix
                                       sweep, step += 1, pump -> reporter (modes), health
                                       check, stats line, SWA divergence
    host step loop:
      canary.end_step()                abort mode acts between steps; end-of-step injection

``forward_scope(batch)`` is the same pair as a context manager. Calls must alternate:
``before_forward`` twice, or ``after_forward`` without ``before_forward``, is an error.

Observability (each opt-in by its interval; all read the device on the delayed schedule of
:mod:`.delayed`): :mod:`.sweep` (radix sweep), :mod:`.stats_logger`, :mod:`.health`,
:mod:`.swa_divergence`. After a forward they are called only from the step at which one
of them is due (and the step after, when a staged read drains): a forward with nothing due
skips them, and skips the pump while the (CPU) ring's index has not moved. Fault injection
(:mod:`.perturb`) attaches as ``perturber`` and is called at the three host-side points
(pre-forward, post-forward, end of step).

Until :meth:`mark_init_finished` (after warm-up / graph capture) the write kernels' chain
position assert is disarmed: synthetic warm-up batches break position chains on purpose.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvcanary import envs
from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.forward import CanaryRuntime, SingleForwardManager
from kvcanary.canary.host import (
    AbortHandler,
    ExpectedInputs,
    ForwardBatchView,
    KVPool,
    PrefixCacheView,
    ReqToTokenTable,
)
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.kernels.fused_rows import FusedRowLaunches
from kvcanary.canary.kernels.store_check import StoreChecker
from kvcanary.canary.observe.delayed import DelayedDeviceHostHandler
from kvcanary.canary.observe.health import KernelRunHealthChecker
from kvcanary.canary.observe.stats_logger import PeriodicStatsLogger
from kvcanary.canary.observe.swa_divergence import SwaDivergenceReporter, VerifyTotals
from kvcanary.canary.observe.sweep import SweepOrchestrator
from kvcanary.canary.plan.reference import CanaryPlans
from kvcanary.canary.report.pump import ViolationPump
from kvcanary.canary.report.reporter import CanaryViolationRow, ImplicatedSlots, ViolationReporter
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import (
    NUM_LAUNCH_TAGS,
    NUM_SGLANG_LAUNCH_TAGS,
    CanaryLaunchTag,
    LaunchStage,
    PoolKind,
)
from kvcanary.canary.wire.violation import ViolationRecord

logger = logging.getLogger("kvcanary.canary")

__all__ = ["AbortHandler", "CanaryManager"]


class CanaryManager:
    def __init__(
        self,
        config: CanaryConfig,
        groups: list[CanaryBufferGroup],
        req_to_token_pool: ReqToTokenTable,
        *,
        device: torch.device,
        num_single_forward_managers: int = 1,
        pool: KVPool | None = None,
    ):
        """``pool``: the host's KV pool the groups are attached to (fault injection breaks
        its stores); ``req_to_token_pool``: the host's req->token table."""
        if not groups:
            raise ValueError("kv-canary: no buffer group to protect")
        if num_single_forward_managers < 1:
            raise ValueError(
                f"num_single_forward_managers={num_single_forward_managers}; allowed: >= 1"
            )
        self.config = config
        self.groups = groups
        self.device = device
        self.pool = pool
        factor = envs.KVCANARY_KV_CANARY_VERIFY_CAPACITY_FACTOR.get()
        self.runtime = CanaryRuntime(
            config=config,
            groups=groups,
            req_to_token_pool=req_to_token_pool,
            ring=ViolationRing(config.ring_capacity, device),
            verify_counters=RunCounters(device),
            write_counters=RunCounters(device),
            verify_capacities=[config.verify_capacity or factor * g.num_slots for g in groups],
        )
        self.single_forward_managers = [
            SingleForwardManager(i, self.runtime) for i in range(num_single_forward_managers)
        ]
        delay = config.pump_delay_steps
        if delay is None:
            delay = 0 if device.type == "cpu" else 1
        self.pump = ViolationPump(self.runtime.ring, delay)
        self.reporter = ViolationReporter(
            config.mode, {g.kind: g.compression_ratio for g in groups},
            {g.kind: g.state_ring for g in groups if g.state_ring is not None},
        )  # fmt: skip
        self.abort_handler: AbortHandler | None = None
        self.aborted_request_ids: list[int] = []
        self.step = 0  # forwards completed (after_forward calls)
        self.init_finished = False
        # The forward between before_forward and after_forward: (SFM index, its plans).
        self._open: tuple[int, list[CanaryPlans]] | None = None
        # The forward's fused launches when its HEAD ran through fast_head (TAIL: theirs).
        self._fast_tail: FusedRowLaunches | None = None
        self.perturber: Any = None  # kvcanary.canary.perturb.Perturber, when injecting faults
        self._init_observability(config, groups, req_to_token_pool)
        # end_forward's fast path: the ring index to compare with the pump's count (CPU,
        # no delay: a new row is visible right away), and the next step at which a periodic
        # observer (sweep, health, stats, SWA divergence) has anything to do.
        # (A memoryview: indexing it reads a Python int; a numpy scalar costs ~1.3 us more
        # right after a forward, when numpy's code is out of the caches.)
        index = self.runtime.ring.host_index
        self._pump_index = index.data if index is not None and self.pump.delay_steps == 0 else None
        self._next_periodic = 0

    def _init_observability(
        self, config: CanaryConfig, groups: list[CanaryBufferGroup],
        req_to_token_pool: ReqToTokenTable,
    ) -> None:  # fmt: skip
        rt, device = self.runtime, self.device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # shared D2H stream

        def handler() -> DelayedDeviceHostHandler:
            return DelayedDeviceHostHandler(device, stream)

        self.sweep = SweepOrchestrator(rt, config.sweep_interval)
        per_forward = (LaunchStage.HEAD, LaunchStage.TAIL)
        self.per_forward_tags = [t for g in groups for t in g.launch_tags(per_forward, config.v_half)]
        sweep_tags = [
            t for g in groups if g.sweepable and config.sweep_interval
            for t in g.launch_tags((LaunchStage.SWEEP,), config.v_half)
        ]  # fmt: skip
        # What this canary launches (the stats line's `launch_tags_active=a/b`; b = SGLang's
        # 12 tags unless a DSV4 compressed group brings kvcanary's own).
        self.launch_tags = sorted(self.per_forward_tags + sweep_tags)
        sglang_only = max(self.launch_tags) < NUM_SGLANG_LAUNCH_TAGS
        self.num_launch_tags_defined = NUM_SGLANG_LAUNCH_TAGS if sglang_only else NUM_LAUNCH_TAGS
        self.stats_logger = (
            PeriodicStatsLogger(rt, config.stats_interval, handler(),
                                lambda: self.sweep.num_passes,
                                (len(self.launch_tags), self.num_launch_tags_defined))
            if config.stats_interval else None
        )  # fmt: skip
        self.health = (
            KernelRunHealthChecker(rt, config.health_check_interval, handler(),
                                   self.per_forward_tags, lambda: self.sweep.launches)
            if config.health_check_interval else None
        )  # fmt: skip
        self.swa_divergence: SwaDivergenceReporter | None = None
        if config.swa_divergence_interval:
            rt.verify_totals = VerifyTotals(device)
            swa = next((g for g in groups if g.kind == PoolKind.SWA), None)
            self.swa_divergence = SwaDivergenceReporter(
                config.swa_divergence_interval, rt.verify_totals, handler(),
                None if swa is None else swa.swa_index_lut, req_to_token_pool.req_to_token,
            )  # fmt: skip

    # ------------------------------------------------------------------ the host's calls
    def before_forward(self, batch: ForwardBatchView, forward_index: int = 0,
                       verify: bool = True) -> None:  # fmt: skip
        """Before the host's forward of ``batch`` (and before it gathers slot tables for
        attention): single-forward manager ``forward_index``'s host pre-ops, the
        perturbation pre-forward hook (faults must be what attention reads), then per group
        plan -> holes -> HEAD verify / write (:meth:`begin_forward` + :meth:`head`; a decode
        step of the host's persistent batch arrays seen before, with no perturber:
        ``SingleForwardManager.fast_head``, the same work with less Python). ``verify``
        False: HEAD's writes only, :meth:`head_verify` its verifies (a host whose canaries
        share a record buffer, vLLM's, runs every canary's writes first: the alias check)."""
        if self._open is None and forward_index == 0 and self.perturber is None:
            self._fast_tail = self.single_forward_managers[0].fast_head(batch, verify)
            if self._fast_tail is not None:
                self._open = (0, [])
                return
        self.begin_forward(batch, forward_index)
        try:
            self.head(batch, verify)
        except BaseException:  # a forward whose HEAD failed never opened
            self._open = None
            raise

    def host_fused(self) -> FusedRowLaunches | None:
        """The fused launches of single-forward manager 0 when a host may run their HEAD in
        a compiled call of its own (a vLLM CPU worker's step: ``steps.head_step_nb`` /
        ``head_groups_nb``), then
        call :meth:`opened_fused`: no forward open, no perturber, and
        ``SingleForwardManager.host_fused``. None otherwise (:meth:`before_forward`)."""
        if self._open is not None or self.perturber is not None:
            return None
        return self.single_forward_managers[0].host_fused()

    def opened_fused(self, fused: FusedRowLaunches, batch: np.ndarray, overflow: bool) -> None:
        """After a host ran ``fused``'s HEAD (:meth:`host_fused`) on the batch block
        ``batch`` (its arrays kept alive until TAIL), ``overflow`` its code's: the forward is
        open as :meth:`before_forward` leaves it; :meth:`after_forward` runs its TAIL."""
        self.single_forward_managers[0].fused_opened(fused, batch, overflow)
        self._fast_tail = fused
        self._open = (0, [])

    def after_forward(self, batch: ForwardBatchView, tail_ran: bool = False) -> None:
        """After the host's forward of ``batch`` (the one :meth:`before_forward` saw): per
        group TAIL verify / write (+ store check) on the plans HEAD used, then the host-side
        work: overflow warning, perturbation post-forward hook, radix sweep, step += 1,
        pump -> reporter (``raise`` mode raises here), health check, stats line, SWA
        divergence sample (:meth:`tail` + :meth:`end_forward`, without their frames: each
        costs ~0.5 us right after the model's forward). ``tail_ran``: the host ran the fused
        TAIL of a forward :meth:`opened_fused` opened itself; the host-side work only."""
        opened = self._open
        if opened is None:
            raise _not_open()
        sfm = self.single_forward_managers[opened[0]]
        fused, self._fast_tail = self._fast_tail, None
        if fused is not None:  # HEAD ran through fast_head: TAIL is its fused launches'
            if tail_ran:
                fused.tail_ran()
            else:
                fused.tail()
        elif tail_ran:
            raise RuntimeError("kv-canary: tail_ran for a forward opened_fused did not open")
        else:
            sfm.post_ops_maybe_inside_graph(batch, opened[1])
        self._open = None
        self._end_forward(sfm, batch)

    # A captured decode graph (GraphRunner on CUDA) splits each call in two: the host parts
    # run around every replay, HEAD and TAIL are recorded into the graph with the model:
    #     begin_forward(fb); [head(fb); model; tail(fb)]; end_forward(fb)
    @property
    def graph_capturable(self) -> bool:
        """Whether :meth:`head` / :meth:`tail` of a decode forward can be recorded into a
        CUDA graph: graph-safe plans (``--kv-canary-graph-safe``, per-position groups) and
        Triton kernels, and nothing in them that runs Python per forward (no store check, no
        write-input assertion, no fault injection)."""
        rt = self.runtime
        device_ok = (rt.ring.device.type == "cuda" and self.config.backend in ("auto", "triton")
                     and kernels.triton_installed())  # the torch write reads the device once
        return (device_ok and self.single_forward_managers[0].graph_safe
                and rt.store_checker is None and rt.expected_inputs is None
                and self.perturber is None)  # fmt: skip

    def begin_forward(self, batch: ForwardBatchView, forward_index: int = 0) -> None:
        """The host part before a forward: the single-forward manager's host pre-ops and the
        perturbation pre-forward hook."""
        if self._open is not None:
            raise RuntimeError(
                f"kv-canary: before_forward called while forward {self._open[0]} is still "
                "open; call after_forward(batch) after each forward first"
            )
        if not 0 <= forward_index < len(self.single_forward_managers):
            raise ValueError(
                f"forward_index={forward_index}; allowed: "
                f"[0, {len(self.single_forward_managers)}) (num_single_forward_managers)"
            )
        sfm = self.single_forward_managers[forward_index]
        sfm.pre_ops_outside_graph(batch)
        if self.perturber is not None:
            self.perturber.pre_forward(batch)
        self._open = (forward_index, [])

    def head(self, batch: ForwardBatchView, verify: bool = True) -> list[CanaryPlans]:
        """Per group plan -> holes -> HEAD write, then every group's HEAD verify (``verify``
        False: :meth:`head_verify` does; inside a captured graph: device work only when
        graph-safe); the plans TAIL will use."""
        if self._open is None:
            raise RuntimeError("kv-canary: head(batch) needs begin_forward(batch) first")
        index = self._open[0]
        plans = self.single_forward_managers[index].pre_ops_maybe_inside_graph(batch, verify)
        self._open = (index, plans)
        return plans

    def head_verify(self) -> None:
        """The HEAD verifies of a :meth:`before_forward` / :meth:`head` run with ``verify``
        False."""
        if self._open is None:
            raise _not_open()
        self.single_forward_managers[self._open[0]].head_verify()

    def tail(self, batch: ForwardBatchView) -> None:
        """Per group TAIL verify / write (+ store check) on the plans :meth:`head` made."""
        if self._open is None:
            raise _not_open()
        fused, self._fast_tail = self._fast_tail, None
        if fused is not None:  # HEAD ran through fast_head
            fused.tail()
            return
        index, plans = self._open
        self.single_forward_managers[index].post_ops_maybe_inside_graph(batch, plans)

    def end_forward(self, batch: ForwardBatchView) -> None:
        """The host part after a forward (see :meth:`after_forward`); closes the forward."""
        if self._open is None:
            raise _not_open()
        (index, _), self._open = self._open, None
        self._end_forward(self.single_forward_managers[index], batch)

    def _end_forward(self, sfm: SingleForwardManager, batch: ForwardBatchView) -> None:
        if sfm.overflows:  # (a call costs ~0.7 us right after the forward)
            sfm.post_ops_outside_graph()
        if self.perturber is not None:
            self.perturber.post_forward(batch)
        periodic = self.step + 1 >= self._next_periodic
        if periodic:
            self.sweep.maybe_run(self.step)
        self.step += 1
        ring_index = self._pump_index
        if ring_index is None or ring_index[0] > self.pump.total_seen:
            self._report(self.pump.step())
        if periodic:
            self._periodic_observers(batch)

    def _periodic_observers(self, batch: ForwardBatchView) -> None:
        """Health check, stats line, SWA divergence sample (each a no-op off its interval),
        then the next step at which one of them, or the sweep, is due (or drains a read)."""
        step = self.step
        if self.health is not None:
            self.health.step(step)
        if self.stats_logger is not None:
            self.stats_logger.step(step)
        if self.swa_divergence is not None:
            self.swa_divergence.step(step, batch)
        observers = (self.health, self.stats_logger, self.swa_divergence)
        if any(o is not None and o.handler.pending for o in observers):
            self._next_periodic = step + 1
            return
        # In counted steps t (self.step after the increment): the others are due at
        # t % interval == 0, the sweep at (t - 1) % interval == 0.
        due = [step + i - step % i for i in (o.interval for o in observers if o is not None) if i > 0]
        if (i := self.sweep.interval) > 0:
            due.append(step + 1 + (-step) % i)
        self._next_periodic = min(due, default=sys.maxsize)

    @contextlib.contextmanager
    def forward_scope(self, batch: ForwardBatchView, forward_index: int = 0) -> Iterator[None]:
        """``before_forward(batch, forward_index)`` on entry, ``after_forward(batch)`` on a
        clean exit (a convenience for hosts; a forward that raises stays open)."""
        self.before_forward(batch, forward_index)
        yield
        self.after_forward(batch)

    @property
    def forward_open(self) -> bool:
        """True between :meth:`before_forward` and :meth:`after_forward`."""
        return self._open is not None

    # ------------------------------------------------------------------ lifecycle
    def mark_init_finished(self) -> None:
        """Warm-up / capture is over: arm the write kernels' chain-position assert."""
        self.runtime.chain_position_assert = True
        self.init_finished = True

    def attach_store_check(self, pool: KVPool) -> bool:
        """Watch the stores of ``pool``'s fingerprinted buffers (:mod:`.store_check`);
        False when nothing could be watched (no real-KV sources, or no patchable store)."""
        checker = StoreChecker.for_groups(self.groups, self.config.v_half)
        if checker.active:
            checker.attach(pool)
        if not checker.active:
            return False
        self.runtime.store_checker = checker
        for sfm in self.single_forward_managers:
            sfm.bind_store_checker()
        return True

    def set_abort_handler(self, handler: AbortHandler) -> None:
        """``handler(full_slots, swa_slots, req_rows) -> aborted request ids`` (abort mode)."""
        self.abort_handler = handler

    def attach_radix_cache(self, cache: PrefixCacheView | None) -> None:
        """The host's prefix cache, for the radix sweep (and cached-slot perturbations);
        it needs ``iter_cached()`` (see :mod:`.sweep`). None: no cache."""
        self.sweep.attach_radix_cache(cache)

    def set_expected_inputs(self, expected_inputs: ExpectedInputs | None) -> None:
        """Arm (or, with None, disarm) the write-input assertion: ``fn(fb) -> (token ids,
        positions)`` every token written by ``fb`` must carry."""
        self.runtime.expected_inputs = expected_inputs

    def end_step(self) -> list[int]:
        """Between host steps: in abort mode, abort the requests referencing the slots of
        the rows reported since the last call; then the end-of-step perturbation hook.
        Returns the aborted request ids."""
        slots = self.reporter.take_implicated_slots()
        aborted = [] if slots is None else self._abort(slots)
        if self.perturber is not None:
            self.perturber.end_step()
        return aborted

    def flush(self) -> None:
        """Report every row recorded so far and drain the staged stats / health /
        divergence reads (a host sync: call when idle)."""
        self._report(self.pump.drain())
        for observer in (self.health, self.stats_logger, self.swa_divergence):
            if observer is not None:
                observer.handler.flush()
        slots = self.reporter.take_implicated_slots()
        if slots is not None:
            self._abort(slots)

    def _report(self, records: list[ViolationRecord]) -> None:
        self.reporter.report(
            records, total=self.pump.total_seen, capacity=self.runtime.ring.capacity,
            step=self.step,
        )  # fmt: skip

    def _abort(self, slots: ImplicatedSlots) -> list[int]:
        if self.abort_handler is None:
            logger.warning("kv-canary abort: no abort handler attached; nothing aborted")
            return []
        full, swa, rows = (t.to(self.device) for t in slots)
        aborted = self.abort_handler(full, swa, rows)
        self.aborted_request_ids += aborted
        logger.warning(
            "kv-canary abort: aborted requests %s referencing full slots %s / swa slots %s "
            "(slots quarantined) / holding req->token rows %s", aborted, slots.full.tolist(),
            slots.swa.tolist(), slots.req_rows.tolist(),
        )  # fmt: skip
        return aborted

    # ------------------------------------------------------------------ inspection
    @property
    def violations(self) -> list[CanaryViolationRow]:
        """Violations reported so far (call :meth:`flush` first for the very latest)."""
        return list(self.reporter.rows)

    def stats(self) -> dict[str, Any]:
        """Counters since install (host reads: call outside the forward path).

        ``protected_tokens`` follows SGLang's stats line: verify entries + tokens written,
        summed over launches (a decode step re-verifies each request's whole prefix).
        """
        rt = self.runtime
        verify = rt.verify_counters.slots_processed.tolist()
        write = rt.write_counters.slots_processed.tolist()
        runs = (rt.verify_counters.kernel_runs + rt.write_counters.kernel_runs).tolist()
        tags = [t for t in CanaryLaunchTag if runs[t]]
        by_tag, by_reason = self.reporter.counts()
        return {
            "protected_tokens": sum(verify) + sum(write),
            "verify_entries": sum(verify),
            "write_entries": sum(write),
            "verify_entries_by_tag": {t.name: verify[t] for t in tags},
            "write_entries_by_tag": {t.name: write[t] for t in tags},
            "kernel_runs_by_tag": {t.name: runs[t] for t in tags},
            "violations": rt.ring.num_recorded(),
            "violations_reported": len(self.reporter.rows),
            "violations_by_tag": by_tag,
            "violations_by_reason": by_reason,
            "verify_overflow_steps": rt.num_verify_overflow_steps,
            "aborted_requests": len(self.aborted_request_ids),
            "steps": self.step,
            "sweep_passes": self.sweep.num_passes,
            "launch_tags_active": [t.name for t in self.launch_tags],
            "launch_tags_defined": self.num_launch_tags_defined,
            "swa_divergence": {} if self.swa_divergence is None else self.swa_divergence.peak(),
        }


def _not_open() -> RuntimeError:
    return RuntimeError(
        "kv-canary: after_forward called without before_forward(batch) for this forward"
    )
