"""Delayed device->host reads: stage a few device values after step ``T``, use them at ``T + 1``.

The stats logger, the health check and the SWA divergence reporter all read small device
tensors on the host. Reading them right away would stall the forward path on an
accelerator; instead each stages a *frozen copy* (clone, then an asynchronous copy into
pinned memory on a side stream, then an event) and consumes it one step later, when the
copy has long finished::

    step T    handler.step(compute, post):  drain T-1's copy -> post(values)
                                            compute() on the side stream -> stage copy
    step T+1  handler.step(...)             drain T's copy -> post(values of step T)

The side stream waits for the compute stream *before* ``compute`` runs (SGLang queued the
reductions first, so they were not ordered after the producing work), and the compute
stream waits for the clones before the next forward may update a staged counter (a
device-side wait, no host sync). On the CPU the copy is a synchronous clone: the values are
still those of the staging step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Staged = dict[str, Any]


class FutureTensors:
    """Host copies of the tensor values of a dict (other values pass through unchanged).

    At least one tensor is required (it names the device). :meth:`wait` may be called once.
    """

    def __init__(self, values: Staged, stream: Any = None):
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            raise ValueError("FutureTensors: at least one tensor value is required")
        self._event: Any = None
        self._values: Staged | None = {}
        if tensors[0].device.type != "cuda":
            self._values = {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in values.items()
            }
            return
        with torch.cuda.stream(stream):
            out: Staged = {}
            for k, v in values.items():
                if isinstance(v, torch.Tensor):
                    host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                    host.copy_(v.detach().clone(), non_blocking=True)  # clone freezes the value
                    out[k] = host
                else:
                    out[k] = v
            self._event = torch.cuda.Event()
            self._event.record(stream)
        self._values = out

    def wait(self) -> Staged:
        if self._values is None:
            raise RuntimeError("FutureTensors.wait() called twice")
        if self._event is not None:
            self._event.synchronize()
        values, self._values = self._values, None
        return values


class DelayedDeviceHostHandler:
    """One staged read at a time; see the module doc."""

    def __init__(self, device: torch.device, stream: Any = None):
        """``stream``: the side stream (CUDA; None: a new one); ignored off CUDA."""
        self.device = device
        self._stream: Any = None
        if device.type == "cuda":
            self._stream = stream if stream is not None else torch.cuda.Stream(device)
        self._pending: tuple[FutureTensors, Callable[[Staged], None]] | None = None

    def step(
        self, compute_on_device: Callable[[], Staged | None], postprocess_on_host: Callable[[Staged], None]
    ) -> None:
        """Drain the previous staging (``postprocess_on_host`` of its values), then run
        ``compute_on_device`` and stage its result (None: nothing to stage this step)."""
        self.flush()
        if self._stream is None:
            staged = compute_on_device()
        else:
            main = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(main)
            with torch.cuda.stream(self._stream):
                staged = compute_on_device()
        if staged is None:
            return
        self._pending = (FutureTensors(staged, self._stream), postprocess_on_host)
        if self._stream is not None:
            # The next forward's kernels must not update a counter before its clone ran.
            main.wait_stream(self._stream)

    def flush(self) -> None:
        """Handle the pending staging now, if any (a host wait; call when idle)."""
        if self._pending is None:
            return
        future, post = self._pending
        self._pending = None
        post(future.wait())

    @property
    def pending(self) -> bool:
        return self._pending is not None
