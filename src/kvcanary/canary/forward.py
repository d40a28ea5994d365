"""SingleForwardManager: the canary work of one model forward, over every buffer group.

Called by :class:`~kvcanary.canary.manager.CanaryManager` (``before_forward`` runs the
first two, ``after_forward`` the last two)::

    pre_ops_outside_graph      host only: reset the step's overflow notes
    pre_ops_maybe_inside_graph  per group: plan -> holes -> write HEAD (K, V); then per
                                group: verify HEAD (K, V) (holes: positions attention reads
                                that have no slot; every write before any verify: the alias
                                check, kernels.dispatch; compress-state rings and compressed
                                groups launch whole, verify then write)
    -- the host's forward: attention reads the verified prefix, writes this forward's KV --
    post_ops_maybe_inside_graph per group: verify TAIL -> write TAIL           (K, then V)
                                (TAIL fingerprints the live KV: real-data modes; state
                                rings verify only the rows this forward left alone)
    post_ops_outside_graph      host only: warn when a verify plan overflowed

(``fast_head`` does the first two for a decode step of a host's persistent batch arrays
already seen: the fused HEAD's compiled call, little Python around it.)

The "maybe inside graph" part is pure tensor work on the forward batch's tensors (a
static-shape replay canaries the current batch; padding rows and slot 0 contribute
nothing). Each group is planned once per forward; HEAD and TAIL share the plan, so TAIL
verifies exactly what HEAD verified, now against the post-forward KV (compress-state rings:
less, the rows the forward took over for new tokens are skipped). On the CPU (numba
backend) the plans are row plans (:mod:`.row_plan`) in per-group scratch, read from numpy
views of the batch: a decode step re-verifies every prefix, and the materialised plans'
tensor work cost several times the checks themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from kvcanary import envs
from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.host import ExpectedInputs, ForwardBatchView, ReqToTokenTable, TokenMirror
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.kernels.fused_rows import FusedRowLaunches
from kvcanary.canary.kernels.store_check import StoreChecker, StoreWatch
from kvcanary.canary.observe.swa_divergence import VerifyTotals
from kvcanary.canary.plan.inputs import (
    compress_plan_inputs,
    host_inputs_from_batch,
    plan_inputs_from_batch,
)
from kvcanary.canary.plan.reference import CanaryPlans, PlanInputs, build_plans
from kvcanary.canary.plan.rows import HostInputs, RowPlanner
from kvcanary.canary.plan.state import build_state_plans
from kvcanary.canary.plan.static import build_static_decode_plans, is_decode, static_key_width
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import KvHalf, LaunchStage, launch_tag

__all__ = ["CanaryRuntime", "ExpectedInputs", "SingleForwardManager"]

logger = logging.getLogger("kvcanary.canary")


@dataclass
class CanaryRuntime:
    """What every single-forward manager of one canary shares."""

    config: CanaryConfig
    groups: list[CanaryBufferGroup]
    req_to_token_pool: ReqToTokenTable  # + TokenMirror when config.verify_tokens
    ring: ViolationRing
    verify_counters: RunCounters
    write_counters: RunCounters
    verify_capacities: list[int]  # per group
    chain_position_assert: bool = False  # armed by mark_init_finished()
    num_verify_overflow_steps: int = 0
    # fb -> (expected input ids, expected positions): arms the write-input assertion
    # (e.g. TokenOracleExpectations under the engine's oracle sampler).
    expected_inputs: ExpectedInputs | None = None
    # Verify entries per FULL/SWA group, for the SWA divergence reporter (None: off).
    verify_totals: VerifyTotals | None = None
    # The TAIL store check (:mod:`.store_check`); set by install_canary when it could patch
    # the pool's stores (None: off).
    store_checker: StoreChecker | None = None


def compile_static_plans(device: torch.device) -> bool:
    """Whether graph-safe plans go through ``torch.compile``
    (``KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS``; auto: on CUDA with triton installed)."""
    choice = envs.KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS.get()
    if choice == "auto":
        return device.type == "cuda" and kernels.triton_installed()
    return choice == "on"


class SingleForwardManager:
    def __init__(self, index: int, runtime: CanaryRuntime):
        self.index = index
        self.rt = runtime
        # This forward's overflowed verifies: (group kind, requested, capacity); the manager
        # calls post_ops_outside_graph only when there is one.
        self.overflows: list[tuple[str, int, int]] = []
        config, pool = runtime.config, runtime.req_to_token_pool
        # (tag, records, real-KV sources, store watch) of each launch, per (group, stage),
        # K then V.
        self._launches: dict[tuple[int, LaunchStage], list[tuple[int, Any, Any, StoreWatch | None]]]
        self._launches = {
            (id(g), stage): [
                (int(launch_tag(g.kind, stage, half)), g.records(stage, half),
                 g.real_kv_sources(stage, half), None)
                for half in g.halves(config.v_half)
            ]  # fmt: skip
            for g in runtime.groups
            for stage in (LaunchStage.HEAD, LaunchStage.TAIL)
        }
        # CPU canaries under the numba backend plan as row plans (:mod:`.row_plan`), in
        # per-group scratch reused every forward; other devices materialise the plans.
        tensors = [pool.req_to_token, *(t for g in runtime.groups for t in g.buffers())]
        tensors += [g.swa_index_lut for g in runtime.groups if g.swa_index_lut is not None]
        self._planners: list[RowPlanner] | None = None
        if config.backend in ("auto", "numba") and all(t.device.type == "cpu" for t in tensors):
            self._planners = [
                RowPlanner(verify_capacity=capacity, window=g.window, lut=g.swa_index_lut,
                           kv_token_id_vs_position_offset=g.kv_token_id_vs_position_offset,
                           check_residency=g.residency_check)
                for g, capacity in zip(runtime.groups, runtime.verify_capacities, strict=True)
            ]  # fmt: skip
        self._req_to_token: tuple[torch.Tensor, np.ndarray] | None = None
        # The token mirror's tables and their numpy views (made again when one is replaced).
        self._token_views: tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray] | None = None
        # A host's persistent batch arrays -> (their HostInputs, its batch block or None).
        self._host_cache: tuple[tuple[np.ndarray, ...], HostInputs, np.ndarray | None] | None
        self._host_cache = None
        # Graph-safe decode plans (:mod:`.static_plan`): per-position groups only (a
        # DeepSeek-V4 pool's compressed and ring groups plan per forward; its decode is eager).
        self._static = config.graph_safe and all(g.per_position for g in runtime.groups)
        self._compile_static = self._static and compile_static_plans(pool.req_to_token.device)
        # Row plans of per-position groups: HEAD and TAIL as one compiled call each
        # (:mod:`.fused_rows`); built on first use, None when they cannot be fused.
        self._fused: FusedRowLaunches | None | bool = self._planners is not None
        self._fused_open = False  # this forward's HEAD ran fused: so does its TAIL
        # A HEAD run with verify False: its verifies (head_verify).
        self._pending_verify: Callable[[], None] | None = None

    @property
    def graph_safe(self) -> bool:
        """Decode forwards plan with static capacities on the device (:mod:`.static_plan`)."""
        return self._static

    def bind_store_checker(self) -> None:
        """Point each TAIL launch at its store watch (after ``rt.store_checker`` is set)."""
        checker = self.rt.store_checker
        for (gid, stage), launches in self._launches.items():
            if stage == LaunchStage.TAIL:
                self._launches[gid, stage] = [
                    (tag, rec, src, None if checker is None else checker.watch_for(tag))
                    for tag, rec, src, _ in launches
                ]
        self._fused = self._planners is not None  # rebuilt with the store watches

    def pre_ops_outside_graph(
        self, maybe_inaccurate_forward_batch: ForwardBatchView | None = None
    ) -> None:
        self.overflows = []

    def fast_head(self, fb: ForwardBatchView, verify: bool = True) -> FusedRowLaunches | None:
        """:meth:`pre_ops_outside_graph` + :meth:`pre_ops_maybe_inside_graph` of a forward
        of the persistent batch arrays whose HostInputs and batch block are cached (a
        decode step of the host's graph runner), once the fused launches are built and with
        nothing per forward to prepare: the fused HEAD's compiled call and little Python
        around it (before_forward 10.0-10.4 -> 8.2-8.8 us, tiny-swa batch 1, where the
        canary's Python is most of its cost). Returns the fused launches, whose ``tail()``
        the caller runs after the forward (instead of :meth:`post_ops_maybe_inside_graph`);
        None, with nothing done, otherwise (the full path: the same work)."""
        cached, fused, table, rt = self._host_cache, self._fused, self._req_to_token, self.rt
        if (cached is None or cached[0] is not getattr(fb, "host_arrays", None)
                or cached[2] is None or not isinstance(fused, FusedRowLaunches) or self._static
                or rt.expected_inputs is not None or table is None
                or table[0] is not rt.req_to_token_pool.req_to_token):  # fmt: skip
            return None
        if self.overflows:
            self.overflows = []
        host = cached[1]
        if rt.store_checker is not None:
            rt.store_checker.begin_forward(host.out_cache_loc.shape[0])
        self._fused_open = False  # the caller runs fused.tail()
        # (_fused_head's body: one frame fewer, ~0.5 us right after the previous forward)
        if fused.head(host, rt.config.verify_tokens, rt.chain_position_assert, cached[2], verify):
            self._note_overflows(fused)
        self._pending_verify = None if verify else fused.head_verify
        return fused

    def host_fused(self) -> FusedRowLaunches | None:
        """The fused launches, when a host may run their HEAD in a compiled call of its own
        (``fused_rows``' HEAD phases on a batch block it made; then :meth:`fused_opened`): built,
        their TAIL entry resolved by an earlier batch-block HEAD, and nothing per forward
        that only the full path runs (graph-safe plans, a store check, a write-input
        assertion). None otherwise."""
        fused, rt = self._fused, self.rt
        if (not isinstance(fused, FusedRowLaunches) or fused.tail_entry is None or self._static
                or rt.store_checker is not None or rt.expected_inputs is not None):  # fmt: skip
            return None
        return fused

    def fused_opened(self, fused: FusedRowLaunches, batch: np.ndarray, overflow: bool) -> None:
        """After a host ran :meth:`host_fused`'s HEAD (verifies included) on ``batch``: the
        state :meth:`fast_head` leaves (its TAIL is ``fused.tail()``)."""
        if self.overflows:
            self.overflows = []
        fused.opened(batch, self.rt.config.verify_tokens, self.rt.chain_position_assert)
        self._fused_open = False
        self._pending_verify = None
        if overflow:
            self._note_overflows(fused)

    def pre_ops_maybe_inside_graph(self, fb: ForwardBatchView,
                                   verify: bool = True) -> list[CanaryPlans]:  # fmt: skip
        """HEAD; ``verify`` False: its writes only, the verifies left to :meth:`head_verify`
        (a host whose canaries share a record buffer runs every canary's writes first)."""
        rt = self.rt
        if rt.store_checker is not None:
            rt.store_checker.begin_forward(int(fb.out_cache_loc.shape[0]))
        expected_inputs = None if rt.expected_inputs is None else rt.expected_inputs(fb)
        if self._static and is_decode(fb):
            return self._static_decode(fb, expected_inputs, verify)
        fused = self._fused_launches()
        if fused is not None:
            batch_host = self._host_inputs(fb, expected_inputs)
            cached = self._host_cache
            if cached is not None and cached[1] is batch_host:
                batch = cached[2]
            else:  # made per forward (a prefill): one compiled body for every forward
                batch = FusedRowLaunches.batch_block(batch_host)
            self._fused_head(fused, batch_host, batch, verify)
            return []
        host: HostInputs | None = None  # row planners' view of the batch, made once
        inputs: PlanInputs | None = None  # the others', made once
        all_plans = []
        for i, group in enumerate(rt.groups):
            if self._planners is not None and group.per_position:
                if host is None:
                    host = self._host_inputs(fb, expected_inputs)
                plans = self._planners[i].plan(host)
            else:
                if inputs is None:
                    inputs = plan_inputs_from_batch(
                        fb, rt.req_to_token_pool, verify_tokens=rt.config.verify_tokens,
                        expected_inputs=expected_inputs,
                    )  # fmt: skip
                plans = self._plan_inputs(i, group, inputs)
            if not plans.verify.enabled:
                self.overflows.append(
                    (group.kind.name, plans.verify.num_requested_entries, rt.verify_capacities[i])
                )
            if rt.verify_totals is not None:
                rt.verify_totals.observe(group.kind, plans.verify.num_entries)
            if plans.holes is not None:  # once per forward, under the group's HEAD K tag
                rt.ring.append_holes(int(launch_tag(group.kind, LaunchStage.HEAD, KvHalf.K)),
                                     plans.holes)  # fmt: skip
            self._head_write(group, plans)
            all_plans.append(plans)
        self._verify_or_defer(all_plans, verify)
        return all_plans

    def _verify_or_defer(self, all_plans: list[CanaryPlans], verify: bool) -> None:
        if verify:
            self._pending_verify = None
            self._head_verify(all_plans)
        else:
            self._pending_verify = lambda: self._head_verify(all_plans)

    def head_verify(self) -> None:
        """The verifies of a HEAD run with ``verify`` False."""
        pending, self._pending_verify = self._pending_verify, None
        if pending is None:
            raise RuntimeError("kv-canary: head_verify() without a HEAD that deferred it")
        pending()

    def _fused_launches(self) -> FusedRowLaunches | None:
        if self._fused is True:
            rt = self.rt
            # Fused HEAD adds the divergence reporter's totals itself: they must be host memory.
            totals = None if rt.verify_totals is None else rt.verify_totals.host_index(
                [g.kind for g in rt.groups])  # fmt: skip
            self._fused = False
            if rt.verify_totals is None or totals is not None:
                self._fused = FusedRowLaunches.build(
                    cast(list[RowPlanner], self._planners), rt.groups, rt.config.v_half, rt.ring,
                    rt.verify_counters, rt.write_counters, rt.store_checker, totals,
                ) or False  # fmt: skip
        return self._fused if isinstance(self._fused, FusedRowLaunches) else None

    def _fused_head(self, fused: FusedRowLaunches, host: HostInputs,
                    batch: np.ndarray | None, verify: bool = True) -> None:  # fmt: skip
        """HEAD of every group in one compiled call (:mod:`.fused_rows`; ``batch``: the
        batch block of ``host``, if any; it adds the divergence reporter's totals too), then
        the host's note of overflowed verifies."""
        rt = self.rt
        self._fused_open = False
        overflow = fused.head(host, rt.config.verify_tokens, rt.chain_position_assert, batch,
                              verify)  # fmt: skip
        self._pending_verify = None if verify else fused.head_verify
        self._fused_open = True
        if overflow:
            self._note_overflows(fused)

    def _note_overflows(self, fused: FusedRowLaunches) -> None:
        """After a fused HEAD that reported an overflow: each group whose verify did not fit
        its capacity (skipped) onto :attr:`overflows`."""
        rt = self.rt
        for i, group in enumerate(rt.groups):
            total, enabled = fused.verify_entries(i)
            if not enabled:
                self.overflows.append((group.kind.name, total, rt.verify_capacities[i]))

    def _static_decode(
        self, fb: ForwardBatchView, expected_inputs: tuple[torch.Tensor, torch.Tensor] | None,
        verify: bool = True,
    ) -> list[CanaryPlans]:
        """HEAD of a decode forward with static-capacity plans (:mod:`.static_plan`): device
        ops only, holes appended on the device."""
        rt = self.rt
        inputs = plan_inputs_from_batch(fb, rt.req_to_token_pool, verify_tokens=rt.config.verify_tokens,
                                        expected_inputs=expected_inputs)  # fmt: skip
        width = static_key_width(fb, inputs.req_to_token.shape[1])
        all_plans = []
        for group in rt.groups:
            static = build_static_decode_plans(
                inputs, width, window=group.window, lut=group.swa_index_lut,
                kv_token_id_vs_position_offset=group.kv_token_id_vs_position_offset,
                hole_tag=int(launch_tag(group.kind, LaunchStage.HEAD, KvHalf.K)),
                compiled=self._compile_static,
            )  # fmt: skip
            if rt.verify_totals is not None:
                rt.verify_totals.observe(group.kind, static.num_live)
            rt.ring.append_t(static.hole_rows, static.hole_mask)
            self._head_write(group, static.plans)
            all_plans.append(static.plans)
        self._verify_or_defer(all_plans, verify)
        return all_plans

    def _plan_inputs(self, i: int, group: CanaryBufferGroup, inputs: PlanInputs) -> CanaryPlans:
        """Plans of group ``i`` from PlanInputs: other devices, compressed groups (whose
        inputs are derived per forward) and compress-state rings (:mod:`.state_plan`)."""
        if group.state_ring is not None:
            return build_state_plans(
                inputs, group.state_ring, group.swa_index_lut,
                kv_token_id_vs_position_offset=group.kv_token_id_vs_position_offset,
            )  # fmt: skip
        if group.compression_ratio > 1:
            inputs = compress_plan_inputs(inputs, group.compression_ratio)
        if self._planners is not None:
            return self._planners[i].plan(HostInputs.of(inputs))
        return build_plans(
            inputs, verify_capacity=self.rt.verify_capacities[i], window=group.window,
            lut=group.swa_index_lut,
            kv_token_id_vs_position_offset=group.kv_token_id_vs_position_offset,
            backend=self.rt.config.backend,  # type: ignore[arg-type]
            check_residency=group.residency_check,
        )  # fmt: skip

    def _host_inputs(
        self, fb: ForwardBatchView, expected_inputs: tuple[torch.Tensor, torch.Tensor] | None
    ) -> HostInputs:
        """The batch as numpy views (the pool's tables: views made once; a host's
        persistent ``fb.host_arrays``: their HostInputs made once)."""
        pool = self.rt.req_to_token_pool
        r2t = pool.req_to_token
        if self._req_to_token is None or self._req_to_token[0] is not r2t:
            self._req_to_token = (r2t, r2t.numpy())  # a view: the table mutates in place
            self._host_cache = None
        arrays = getattr(fb, "host_arrays", None)
        cached = self._host_cache
        if arrays is not None and cached is not None and cached[0] is arrays and expected_inputs is None:
            return cached[1]  # (made without a token table: verify_tokens is fixed at install)
        token_table = None
        if self.rt.config.verify_tokens:  # install_canary checked the mirror is there
            mirror = cast(TokenMirror, pool)
            ids, lens = mirror.token_ids, mirror.token_lens
            views = self._token_views
            if views is None or views[0] is not ids or views[1] is not lens:
                views = self._token_views = (ids, lens, ids.numpy(), lens.numpy())
            token_table = (views[2], views[3])
        host = host_inputs_from_batch(fb, self._req_to_token[1], token_table, expected_inputs)
        if arrays is not None and token_table is None and expected_inputs is None:
            # Nothing in it changes per forward; nor in its batch block (fused launches).
            self._host_cache = (arrays, host, FusedRowLaunches.batch_block(host))
        return host

    def post_ops_maybe_inside_graph(
        self, fb: ForwardBatchView, all_plans: list[CanaryPlans]
    ) -> None:
        if self._fused_open:  # HEAD ran fused (and returned no plans): its TAIL too
            self._fused_open = False
            cast(FusedRowLaunches, self._fused).tail()
            return
        for group, plans in zip(self.rt.groups, all_plans, strict=True):
            self._launch(group, LaunchStage.TAIL, plans)

    def post_ops_outside_graph(self) -> None:
        if not self.overflows:
            return
        self.rt.num_verify_overflow_steps += 1
        for kind, requested, capacity in self.overflows:
            logger.warning(
                "kv-canary: per-forward verify skipped this step due to overflow (total=%d, "
                "capacity=%d); check ServerArgs / pool sizing (group=%s requested_entries=%d; "
                "raise --kv-canary-verify-capacity)",
                self.rt.num_verify_overflow_steps, capacity, kind, requested,
            )  # fmt: skip
        self.overflows = []

    def _head_write(self, group: CanaryBufferGroup, plans: CanaryPlans) -> None:
        """HEAD, first half: a per-position group's writes (the alias check: every group's
        writes before any group's verify, since groups may share a record buffer, as vLLM's
        do); other groups launch whole (verify, then write)."""
        if not group.per_position:
            self._launch(group, LaunchStage.HEAD, plans)
            return
        rt = self.rt
        for tag, records, sources, _ in self._launches[id(group), LaunchStage.HEAD]:
            kernels.write(records, plans.write, rt.ring, tag, real_kv_sources=sources,
                          chain_position_assert=rt.chain_position_assert,
                          counters=rt.write_counters,
                          backend=rt.config.backend)  # type: ignore[arg-type]  # fmt: skip

    def _head_verify(self, all_plans: list[CanaryPlans]) -> None:
        """HEAD, second half: the per-position groups' verifies, in group order."""
        rt = self.rt
        for group, plans in zip(rt.groups, all_plans, strict=True):
            if not group.per_position:
                continue
            for tag, records, sources, _ in self._launches[id(group), LaunchStage.HEAD]:
                kernels.verify(records, plans.verify, rt.ring, tag, real_kv_sources=sources,
                               check_token=rt.config.verify_tokens, counters=rt.verify_counters,
                               backend=rt.config.backend,  # type: ignore[arg-type]
                               reader_chain=True)  # fmt: skip

    def _launch(self, group: CanaryBufferGroup, stage: LaunchStage, plans: CanaryPlans) -> None:
        rt = self.rt
        backend = rt.config.backend
        verify_plan = plans.verify
        if stage == LaunchStage.TAIL and plans.tail_verify is not None:
            verify_plan = plans.tail_verify
        # (HEAD of a per-position group: _head_write / _head_verify.) Every verify checks
        # each row against its reader's chain too (kernels.dispatch), on every backend.
        for tag, records, sources, watch in self._launches[id(group), stage]:
            kernels.launch(
                records, verify_plan, plans.write, rt.ring, tag, real_kv_sources=sources,
                check_token=rt.config.verify_tokens, chain_position_assert=rt.chain_position_assert,
                verify_counters=rt.verify_counters, write_counters=rt.write_counters,
                backend=backend, reader_chain=True,  # type: ignore[arg-type]
            )  # fmt: skip
            if watch is not None and rt.store_checker is not None:
                rt.store_checker.check(watch, plans.write, rt.ring)
