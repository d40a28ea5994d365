"""Radix sweep: every N forward steps, verify every slot the prefix cache holds.

Per-forward verification only reads what running requests reference. A prefix that sits
in the cache waiting for its next hit (cached but unused) is read by nobody until a request
matches it, so corruption there would first surface inside a later request's forward. The
sweep closes that gap: a DFS over the cache emits one verify entry per cached slot ::

    node at depth d (tokens on the path before it), slots s_0 .. s_{n-1}
    entry j:  slot s_j, position d + j, predecessor s_{j-1} (j = 0: the parent's last slot,
              -1 at depth 0 = the chain anchor)

and each (non-compressed) group verifies them on its TAIL records with its real-KV sources
(tags ``SWEEP_<K|V>_<GROUP>``; verify only, no token check). SWA groups translate slots and
predecessors through the full->SWA mapping: a tombstoned (window-evicted) slot maps to 0 and
is skipped, a predecessor mapping to 0 skips that entry's chain check. Locked nodes (in use
by running requests) are included: harmless redundancy.

The sweep runs in the step's post-ops, before the step counter moves, on steps
``step % interval == 0`` (so a perturbation can target "a step the sweep will run").
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from kvcanary.canary.forward import CanaryRuntime
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.plan.reference import translate_slots
from kvcanary.canary.plan.types import VerifyPlan
from kvcanary.canary.wire.constants import NO_SLOT, CanaryLaunchTag, LaunchStage

logger = logging.getLogger("kvcanary.canary")

SWEEP_LINE = "[canary] sweep succeeded %d times (last_step=%d)"


def walk_radix_cache(cache: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slots, prev_slots, positions)`` (int64, full-pool slots) of every cached token.

    ``cache.iter_cached()`` yields ``(node, prefix_len, slots)`` in DFS order; ``node.parent``
    leads to the predecessor of the node's first slot.
    """
    slots, prevs, positions = [], [], []
    for node, prefix_len, value in cache.iter_cached():
        n = int(value.numel())
        if n == 0:
            continue
        value = value.reshape(-1).long()
        first_prev = (
            node.parent.value.reshape(-1)[-1:].long()
            if prefix_len > 0
            else torch.full((1,), NO_SLOT, dtype=torch.int64, device=value.device)
        )
        slots.append(value)
        prevs.append(torch.cat([first_prev, value[:-1]]))
        positions.append(torch.arange(prefix_len, prefix_len + n, device=value.device))
    if not slots:
        empty = torch.zeros(0, dtype=torch.int64, device=getattr(cache, "device", "cpu"))
        return empty, empty, empty
    return torch.cat(slots), torch.cat(prevs), torch.cat(positions)


class SweepOrchestrator:
    """Owns the sweep schedule; ``num_passes`` and ``launches`` (per tag, host side) feed the
    stats line and the health check (which expects a SWEEP tag only once it was launched)."""

    def __init__(self, runtime: CanaryRuntime, interval: int):
        self.rt = runtime
        self.interval = interval
        self.cache: Any = None
        self.num_passes = 0
        self.last_step = -1
        self.launches: Counter[CanaryLaunchTag] = Counter()

    def attach_radix_cache(self, cache: Any) -> None:
        """The engine's prefix cache (None: nothing to sweep). Late binding: the cache is
        usually built after the canary is installed."""
        self.cache = cache

    def is_sweep_step(self, step: int) -> bool:
        return self.interval > 0 and self.cache is not None and step % self.interval == 0

    def maybe_run(self, step: int) -> None:
        if self.is_sweep_step(step):
            self.run(step)

    def run(self, step: int) -> None:
        """One pass over the whole cache (host DFS + one verify launch per group and half)."""
        rt = self.rt
        slots, prevs, positions = walk_radix_cache(self.cache)
        for group in rt.groups:
            if not group.sweepable:
                continue
            lut = group.swa_index_lut
            plan = VerifyPlan.from_entries(
                translate_slots(slots, lut), translate_slots(prevs, lut), positions
            )
            for tag, half in zip(group.launch_tags([LaunchStage.SWEEP], rt.config.v_half),
                                 group.halves(rt.config.v_half), strict=True):  # fmt: skip
                kernels.verify(
                    group.records(LaunchStage.TAIL, half), plan, rt.ring, tag,
                    real_kv_sources=group.real_kv_sources(LaunchStage.TAIL, half),
                    counters=rt.verify_counters,
                    backend=rt.config.backend,  # type: ignore[arg-type]
                )  # fmt: skip
                self.launches[tag] += 1
        self.num_passes += 1
        self.last_step = step
        logger.info(SWEEP_LINE, self.num_passes, step)
