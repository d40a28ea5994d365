"""Periodic stats line: proof in the log that the canary is running and how much it covers.

Every ``interval`` forward steps (never at step 0) the counters are staged and, one step
later (:mod:`.delayed`), logged at INFO in SGLang's format::

    [canary] step=200 protected_tokens=51234 sweep_passes=5 violations=0 launch_tags_active=3/12

``protected_tokens`` = verify entries + records written, summed over every launch so far
(sweeps included); ``violations`` = violations ever recorded (the ring's write index);
``launch_tags_active`` = tags this canary launches / tags defined (12 = SGLang's FULL + SWA
tags; 30 once a DSV4 compressed group is present).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvcanary.canary.forward import CanaryRuntime
from kvcanary.canary.observe.delayed import DelayedDeviceHostHandler, Staged

logger = logging.getLogger("kvcanary.canary")

STATS_LINE = (
    "[canary] step=%d protected_tokens=%d sweep_passes=%d violations=%d launch_tags_active=%d/%d"
)


class PeriodicStatsLogger:
    def __init__(
        self,
        runtime: CanaryRuntime,
        interval: int,
        handler: DelayedDeviceHostHandler,
        sweep_passes: Callable[[], int],
        launch_tags_active: tuple[int, int],
    ):
        self.rt = runtime
        self.interval = interval
        self.handler = handler
        self.sweep_passes = sweep_passes
        self.launch_tags_active = launch_tags_active
        self.num_logged = 0

    def step(self, step: int) -> None:
        """Call once per forward step, after the step counter moved."""
        if self._due(step) or self.handler.pending:  # else a no-op: skip its closures
            self.handler.step(lambda: self._compute(step), self._log)

    def _due(self, step: int) -> bool:
        return not (self.interval <= 0 or step <= 0 or step % self.interval)

    def _compute(self, step: int) -> Staged | None:
        if not self._due(step):
            return None
        rt = self.rt
        protected = rt.verify_counters.slots_processed.sum() + rt.write_counters.slots_processed.sum()
        return {
            "step": step,
            "protected_tokens": protected.reshape(1),
            "violations": rt.ring.write_index,
            "sweep_passes": self.sweep_passes(),
        }

    def _log(self, v: Staged) -> None:
        active, total = self.launch_tags_active
        logger.info(
            STATS_LINE, v["step"], int(v["protected_tokens"][0]), v["sweep_passes"],
            int(v["violations"][0]), active, total,
        )  # fmt: skip
        self.num_logged += 1
