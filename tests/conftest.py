"""Suite-wide settings: tests run under pytest-xdist on a small machine, so each worker
uses one torch thread (many tiny forwards slow down 10-50x when threads oversubscribe)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
