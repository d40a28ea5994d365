"""Kernel-run-counter health check: raise when a launch tag that should run stopped running.

Every launch bumps ``kernel_runs[tag]`` of the verify or the write counters. Every
``interval`` forward steps (from step ``interval`` on) the two counter vectors are staged and,
one step later, compared with the previous check (:mod:`.delayed`). A tag is *expected* in a
check window when the host launched it in that window:

* HEAD/TAIL tags of every group and launched half (verify and write), whenever forward steps
  happened in the window (every forward launches them, with or without entries);
* SWEEP tags (verify only) only if the sweep actually launched them in the window.

SGLang expects the SWEEP tags whenever ``sweep_interval > 0``, so a sweep interval longer than
the check period, or an engine without a prefix cache, makes its check fire on a healthy
canary; counting the sweep's own launches cannot. A stalled tag raises
:class:`KVCanaryHealthError` (mode independent: the canary is not protecting anything).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from kvcanary.canary.errors import KVCanaryHealthError
from kvcanary.canary.forward import CanaryRuntime
from kvcanary.canary.observe.delayed import DelayedDeviceHostHandler, Staged
from kvcanary.canary.wire.constants import CanaryLaunchTag


class KernelRunHealthChecker:
    def __init__(
        self,
        runtime: CanaryRuntime,
        interval: int,
        handler: DelayedDeviceHostHandler,
        per_forward_tags: Sequence[CanaryLaunchTag],
        sweep_launches: Callable[[], Counter[CanaryLaunchTag]],
    ):
        self.rt = runtime
        self.interval = interval
        self.handler = handler
        self.per_forward_tags = list(per_forward_tags)
        self.sweep_launches = sweep_launches
        zeros = torch.zeros_like(runtime.verify_counters.kernel_runs, device="cpu")
        self._prev: Staged = {"step": 0, "verify_runs": zeros, "write_runs": zeros,
                              "sweep_launches": Counter()}  # fmt: skip
        self.num_checks = 0

    def step(self, step: int) -> None:
        """Call once per forward step, after the step counter moved; may raise."""
        if self._due(step) or self.handler.pending:  # else a no-op: skip its closures
            self.handler.step(lambda: self._compute(step), self._check)

    def _due(self, step: int) -> bool:
        return not (self.interval <= 0 or step < self.interval or step % self.interval)

    def _compute(self, step: int) -> Staged | None:
        if not self._due(step):
            return None
        return {
            "step": step,
            "verify_runs": self.rt.verify_counters.kernel_runs,
            "write_runs": self.rt.write_counters.kernel_runs,
            "sweep_launches": Counter(self.sweep_launches()),
        }

    def _check(self, now: Staged) -> None:
        prev, self._prev = self._prev, now
        self.num_checks += 1
        forwards = now["step"] > prev["step"]
        swept = now["sweep_launches"] - prev["sweep_launches"]
        expected_verify = (self.per_forward_tags if forwards else []) + sorted(swept)
        expected_write = self.per_forward_tags if forwards else []
        # One host list per vector: indexing the tensor per tag cost ~3 us a tag.
        verify_delta = (now["verify_runs"] - prev["verify_runs"]).tolist()
        write_delta = (now["write_runs"] - prev["write_runs"]).tolist()
        stalled_verify = [t.name for t in expected_verify if verify_delta[t] <= 0]
        stalled_write = [t.name for t in expected_write if write_delta[t] <= 0]
        if stalled_verify or stalled_write:
            tags = sorted(set(stalled_verify) | set(stalled_write))
            raise KVCanaryHealthError(
                f"kv-canary: kernel_run_counter did not increase since previous check for "
                f"tags={tags} at step={now['step']}; canary path is not executing "
                f"(verify: {stalled_verify}, write: {stalled_write}; previous check at "
                f"step={prev['step']})"
            )
