"""SingleForwardManager: the canary work of one model forward, over every buffer group.

    pre_ops_outside_graph      host only: reset the step's overflow notes
    pre_ops_maybe_inside_graph  per group: plan -> verify HEAD -> write HEAD   (K, then V)
    -- the model forward: attention reads the verified prefix, writes this forward's KV --
    post_ops_maybe_inside_graph per group: verify TAIL -> write TAIL           (K, then V)
                                (TAIL fingerprints the live KV: real-data modes)
    post_ops_outside_graph      host only: warn when a verify plan overflowed

The "maybe inside graph" part is pure tensor work on the forward batch's tensors (a
static-shape replay canaries the current batch; padding rows and slot 0 contribute
nothing). Each group is planned once per forward; HEAD and TAIL share the plan, so TAIL
verifies exactly what HEAD verified, now against the post-forward KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcanary.canary import kernels
from kvcanary.canary.buffers import CanaryBufferGroup
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.constants import LaunchStage, launch_tag
from kvcanary.canary.plan import CanaryPlans, build_plans
from kvcanary.canary.plan_inputs import compress_plan_inputs, plan_inputs_from_batch
from kvcanary.canary.ring import RunCounters, ViolationRing
from kvcanary.canary.swa_divergence import VerifyTotals

ExpectedInputs = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]

logger = logging.getLogger("kvcanary.canary")


@dataclass
class CanaryRuntime:
    """What every single-forward manager of one canary shares."""

    config: CanaryConfig
    groups: list[CanaryBufferGroup]
    req_to_token_pool: Any
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


class SingleForwardManager:
    def __init__(self, index: int, runtime: CanaryRuntime):
        self.index = index
        self.rt = runtime
        self._overflows: list[tuple[str, int, int]] = []  # (group kind, requested, capacity)

    def pre_ops_outside_graph(self, maybe_inaccurate_forward_batch: Any = None) -> None:
        self._overflows = []

    def pre_ops_maybe_inside_graph(self, fb: Any) -> list[CanaryPlans]:
        rt = self.rt
        inputs = plan_inputs_from_batch(
            fb, rt.req_to_token_pool, verify_tokens=rt.config.verify_tokens,
            expected_inputs=None if rt.expected_inputs is None else rt.expected_inputs(fb),
        )  # fmt: skip
        all_plans = []
        for group, capacity in zip(rt.groups, rt.verify_capacities, strict=True):
            group_inputs = (
                compress_plan_inputs(inputs, group.compression_ratio)
                if group.compression_ratio > 1
                else inputs
            )
            plans = build_plans(
                group_inputs,
                verify_capacity=capacity,
                window=group.window,
                lut=group.swa_index_lut,
                kv_token_id_vs_position_offset=group.kv_token_id_vs_position_offset,
                backend=rt.config.backend,  # type: ignore[arg-type]
            )
            if not plans.verify.enabled:
                self._overflows.append(
                    (group.kind.name, plans.verify.num_requested_entries, capacity)
                )
            if rt.verify_totals is not None:
                rt.verify_totals.observe(group.kind, plans.verify.num_entries)
            self._launch(group, LaunchStage.HEAD, plans)
            all_plans.append(plans)
        return all_plans

    def post_ops_maybe_inside_graph(self, fb: Any, all_plans: list[CanaryPlans]) -> None:
        for group, plans in zip(self.rt.groups, all_plans, strict=True):
            self._launch(group, LaunchStage.TAIL, plans)

    def post_ops_outside_graph(self) -> None:
        if not self._overflows:
            return
        self.rt.num_verify_overflow_steps += 1
        for kind, requested, capacity in self._overflows:
            logger.warning(
                "kv-canary: per-forward verify skipped this step due to overflow (total=%d, "
                "capacity=%d); check ServerArgs / pool sizing (group=%s requested_entries=%d; "
                "raise --kv-canary-verify-capacity)",
                self.rt.num_verify_overflow_steps, capacity, kind, requested,
            )  # fmt: skip
        self._overflows = []

    def _launch(self, group: CanaryBufferGroup, stage: LaunchStage, plans: CanaryPlans) -> None:
        rt = self.rt
        for half in group.halves(rt.config.v_half):
            tag = launch_tag(group.kind, stage, half)
            records = group.records(stage, half)
            sources = group.real_kv_sources(stage, half)
            kernels.verify(
                records, plans.verify, rt.ring, tag, real_kv_sources=sources,
                check_token=rt.config.verify_tokens, counters=rt.verify_counters,
                backend=rt.config.backend,  # type: ignore[arg-type]
            )  # fmt: skip
            kernels.write(
                records, plans.write, rt.ring, tag, real_kv_sources=sources,
                chain_position_assert=rt.chain_position_assert, counters=rt.write_counters,
                backend=rt.config.backend,  # type: ignore[arg-type]
            )  # fmt: skip
