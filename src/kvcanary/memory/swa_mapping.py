"""SwaIndexMapping: the full→SWA slot mapping an SWA allocator owns and its pools read.

::

    mapping[f] = s > 0   full slot f's SWA KV is in SWA slot s (live)
    mapping[f] = 0       no SWA slot (never allocated, evicted from the window, freed,
                         or the reserved sink page)
    mapping[-1] = -1     sentinel: ``mapping[last_loc=-1]`` reads "no prefix"

The tensor is mutated in place and never reallocated, and every write goes through this
class, which bumps ``version``: a translation cache keyed on it can never outlive a
mutation. It lives apart from :mod:`~kvcanary.memory.swa_allocator` (which writes it) so
that the pools (which read it) and :mod:`~kvcanary.memory.base` can name it without
importing the allocator.
"""

from __future__ import annotations

import numpy as np
import torch

# memory.base.HOST (not imported: base names this module): the host, not "cpu:0".
HOST = torch.device("cpu")


class SwaIndexMapping:
    """The full→SWA mapping tensor plus its mutation counter."""

    def __init__(self, full_size: int, page_size: int, device: torch.device):
        self.tensor = torch.cat(
            [
                torch.zeros(full_size + page_size, dtype=torch.int64, device=device),
                torch.full((1,), -1, dtype=torch.int64, device=device),
            ]
        )
        self.version = 0
        # On the host (not "cpu:0", the stand-in device that keeps the torch paths): its numpy
        # view; a decode step's few reads and writes go through it (~1 us where torch's
        # advanced indexing costs ~5 an op).
        self._host = self.tensor.numpy() if self.tensor.device == HOST else None

    def write(self, full_slots: torch.Tensor, swa_slots: torch.Tensor | int) -> None:
        if self._host is not None and full_slots.device == HOST and (
            isinstance(swa_slots, int) or swa_slots.device == HOST
        ):
            self.write_host(full_slots.numpy(),
                            swa_slots if isinstance(swa_slots, int) else swa_slots.to(torch.int64).numpy())  # fmt: skip
            return
        # An advanced-index write: the values must be on the mapping's device (indices may not).
        self.tensor[full_slots] = (
            swa_slots if isinstance(swa_slots, int) else swa_slots.to(self.tensor.device, torch.int64)
        )
        self.version += 1

    def write_host(self, full_slots: np.ndarray, swa_slots: np.ndarray | int) -> None:
        """:meth:`write` at host indices into a host mapping (numpy's write on the tensor's
        own memory)."""
        self._host_array()[full_slots] = swa_slots
        self.version += 1

    @property
    def host_view(self) -> np.ndarray | None:
        """The mapping's numpy view on the host (None on a device); a write through it must
        bump :attr:`version`."""
        return self._host

    def translate_host(self, full_slots: np.ndarray) -> np.ndarray:
        """:meth:`translate` of host indices on a host mapping, as a numpy array."""
        swa: np.ndarray = self._host_array()[full_slots]
        return swa

    def _host_array(self) -> np.ndarray:
        return self._host if self._host is not None else self.tensor.numpy()

    def clear(self) -> None:
        self.tensor[:-1] = 0
        self.version += 1

    def translate(self, full_slots: torch.Tensor) -> torch.Tensor:
        if self._host is not None and full_slots.device == HOST:
            return torch.from_numpy(self.translate_host(full_slots.to(torch.int64).numpy()))
        return self.tensor[full_slots.to(torch.int64)]
