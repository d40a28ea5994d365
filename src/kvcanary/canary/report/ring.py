"""Device-side violation bookkeeping: the fill-once violation ring and per-tag run counters.

Ring contract (same as SGLang's ``violation_ring`` + ``violation_write_index``)::

    rows         int64 [capacity, 8]   row k = the k-th violation ever recorded (k < capacity)
    write_index  int64 [1]             number of violations ever recorded; never decreases

A violation with sequence number ``seq >= capacity`` is dropped but still counted, so
``write_index > capacity`` means overflow. Rows are never overwritten. The row layout is
``RING_COL_*`` in :mod:`kvcanary.canary.wire.constants`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcanary.canary.wire.constants import (
    NO_TOKEN,
    NUM_LAUNCH_TAGS,
    RING_COL_EXPECTED_AUX,
    RING_COL_EXPECTED_TOKEN,
    RING_COL_FAIL_REASON,
    RING_COL_LAUNCH_TAG,
    RING_COL_POSITION,
    RING_COL_SLOT_IDX,
    RING_COL_STORED_TOKEN,
    VIOLATION_ROW_FIELDS,
    FailReason,
)
from kvcanary.canary.wire.violation import ViolationRecord


class ViolationRing:
    """Owner of the ring tensors. Appends from kernels need no host sync."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        if capacity < 1:
            raise ValueError(f"violation ring capacity={capacity}; allowed: >= 1")
        self.capacity = capacity
        # One extra scratch row: vectorised appends aim dropped/non-violating candidates at it
        # instead of filtering them on the host.
        self._storage = torch.zeros(
            capacity + 1, VIOLATION_ROW_FIELDS, dtype=torch.int64, device=device
        )
        self.rows = self._storage[:capacity]
        self.write_index = torch.zeros(1, dtype=torch.int64, device=device)
        # CPU: read the index through a numpy view of the same memory (``.item()`` costs
        # microseconds per step once the forward has evicted torch's code from the caches).
        self._host_index = self.write_index.numpy() if self.write_index.device.type == "cpu" else None
        # The numba kernels' launch arguments for this ring (numpy views of the records,
        # real-KV sources and counters it is launched with: kernels.numba_kernels), kept
        # with the ring so they go when its canary goes (a module-level memo kept every
        # pool a process ever guarded alive).
        self.launch_args: dict[tuple[int, ...], tuple[Any, ...]] = {}

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def append_t(self, candidates: torch.Tensor, is_violation: torch.Tensor) -> None:
        """Record ``candidates[i]`` (int64 ``[n, 8]``) for each set ``is_violation[i]``, in order."""
        flags = is_violation.to(torch.int64)
        seq = self.write_index + torch.cumsum(flags, 0) - flags
        target = torch.where(is_violation & (seq < self.capacity), seq, self.capacity)
        self._storage.index_copy_(0, target, candidates)
        self.write_index += flags.sum()

    def append_holes(self, tag: int, holes: torch.Tensor | np.ndarray) -> None:
        """Record a ``verify_not_resident`` row per hole (int64 ``[3, n]``: full slot,
        position, prefix_len; see :class:`.plan.CanaryPlans`)."""
        h = torch.as_tensor(holes, device=self.device)
        n = h.shape[1]
        rows = torch.zeros(n, VIOLATION_ROW_FIELDS, dtype=torch.int64, device=self.device)
        rows[:, RING_COL_LAUNCH_TAG] = tag
        rows[:, RING_COL_SLOT_IDX] = h[0]
        rows[:, RING_COL_POSITION] = h[1]
        rows[:, RING_COL_STORED_TOKEN] = NO_TOKEN
        rows[:, RING_COL_EXPECTED_TOKEN] = NO_TOKEN
        rows[:, RING_COL_EXPECTED_AUX] = h[2]
        rows[:, RING_COL_FAIL_REASON] = int(FailReason.VERIFY_NOT_RESIDENT)
        self.append_t(rows, torch.ones(n, dtype=torch.bool, device=self.device))

    @property
    def host_index(self) -> np.ndarray | None:
        """A numpy view of ``write_index`` (CPU rings; None elsewhere)."""
        return self._host_index

    def num_recorded(self) -> int:
        """Violations ever recorded, including dropped ones (a host sync on accelerators)."""
        if self._host_index is not None:
            return int(self._host_index[0])
        return int(self.write_index.item())

    def read(self, start: int = 0) -> list[ViolationRecord]:
        """Host copies of the stored rows ``[start, min(write_index, capacity))``."""
        end = min(self.num_recorded(), self.capacity)
        return [ViolationRecord(*row) for row in self.rows[start:end].tolist()]

    def clear(self) -> None:
        self._storage.zero_()
        self.write_index.zero_()


class RunCounters:
    """Per-launch-tag health counters (int64 ``[NUM_LAUNCH_TAGS]`` each).

    ``kernel_runs[tag]`` grows by 1 on every kernel launch (even a disabled verify);
    ``slots_processed[tag]`` by the entries a launch processed (verify: every entry incl. slot 0;
    write: every token actually stored). Their sums feed the stats line and the health check.
    The numba kernels bump them in place (numpy views of the same memory).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.kernel_runs = torch.zeros(NUM_LAUNCH_TAGS, dtype=torch.int64, device=device)
        self.slots_processed = torch.zeros(NUM_LAUNCH_TAGS, dtype=torch.int64, device=device)
        # CPU: update through numpy views of the same memory (a torch indexed add costs
        # ~2.5 us per call, numpy ~0.1 us; counters are bumped on every kernel launch).
        self._host_views = (
            (self.kernel_runs.numpy(), self.slots_processed.numpy())
            if self.kernel_runs.device.type == "cpu"
            else None
        )

    def add(self, tag: int, num_slots: int | torch.Tensor) -> None:
        """One launch of ``tag`` that processed ``num_slots`` entries (tensor: no host sync)."""
        if self._host_views is not None and not isinstance(num_slots, torch.Tensor):
            runs, slots = self._host_views
            runs[tag] += 1
            slots[tag] += num_slots
            return
        self.kernel_runs[tag] += 1
        self.slots_processed[tag] += num_slots
