"""ViolationPump: brings new violation-ring rows to the host, without stalling the forward.

Kernels append to the device ring; the host learns about it by reading the ring's write
index. On an accelerator that read is *staged* (an asynchronous copy into pinned memory
plus an event) after step ``T`` and consumed after step ``T + 1``, by which time the copy
has long finished: no host sync on the forward path. Only when the index moved are the new
rows copied (synchronously: violations are rare and reporting them is the point). On the
CPU reading the index is free, so the default delay there is 0 steps::

    step T    forward ... post-ops: stage(write_index)            (delay 1)
    step T+1  forward ... post-ops: stage(...); consume T's copy -> new rows?

The ring is fill-once: rows past its capacity are counted but lost; ``read`` never
returns a row twice.
"""

from __future__ import annotations

from collections import deque

import torch

from kvcanary.canary.report.ring import ViolationRing
from kvcanary.canary.wire.violation import ViolationRecord


class ViolationPump:
    def __init__(self, ring: ViolationRing, delay_steps: int):
        if delay_steps not in (0, 1):
            raise ValueError(f"violation pump delay_steps={delay_steps}; allowed: 0 or 1")
        self.ring = ring
        self.delay_steps = delay_steps
        self._staged: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self.num_rows_read = 0  # ring rows already handed out
        self.total_seen = 0  # violations ever recorded, as of the last consumed read

    def step(self) -> list[ViolationRecord]:
        """Call once per forward step (after its post-ops); the rows that became visible."""
        if self.delay_steps == 0:
            return self._read(self.ring.num_recorded())
        self._stage()
        if len(self._staged) <= self.delay_steps:
            return []
        host, event = self._staged.popleft()
        if event is not None:
            event.synchronize()  # recorded a whole step ago: already complete
        return self._read(int(host[0]))

    def drain(self) -> list[ViolationRecord]:
        """Every row recorded so far (a host sync; call outside the forward path)."""
        self._staged.clear()
        return self._read(self.ring.num_recorded())

    def _stage(self) -> None:
        index = self.ring.write_index
        if index.device.type == "cpu":
            self._staged.append((index.clone(), None))
            return
        host = torch.empty(1, dtype=index.dtype, pin_memory=index.device.type == "cuda")
        host.copy_(index, non_blocking=True)
        event = None
        if index.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._staged.append((host, event))

    def _read(self, total: int) -> list[ViolationRecord]:
        self.total_seen = max(self.total_seen, total)
        end = min(self.total_seen, self.ring.capacity)
        if end <= self.num_rows_read:
            return []
        rows = [ViolationRecord(*r) for r in self.ring.rows[self.num_rows_read : end].tolist()]
        self.num_rows_read = end
        return rows
