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

    def write(self, full_slots: torch.Tensor, swa_slots: torch.Tensor | int) -> None:
        # An advanced-index write: the values must be on the mapping's device (indices may not).
        self.tensor[full_slots] = (
            swa_slots if isinstance(swa_slots, int) else swa_slots.to(self.tensor.device, torch.int64)
        )
        self.version += 1

    def write_host(self, full_slots: np.ndarray, swa_slots: int) -> None:
        """:meth:`write` of one value at host indices into a host mapping (numpy's write on
        the tensor's own memory: ~1 us where torch's advanced-index write costs ~5)."""
        self.tensor.numpy()[full_slots] = swa_slots
        self.version += 1

    def clear(self) -> None:
        self.tensor[:-1] = 0
        self.version += 1

    def translate(self, full_slots: torch.Tensor) -> torch.Tensor:
        return self.tensor[full_slots.to(torch.int64)]
