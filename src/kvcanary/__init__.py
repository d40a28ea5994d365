"""kvcanary: a runtime KV-cache integrity canary, with the hybrid sliding-window KV memory
system and compact engine it guards."""

from __future__ import annotations

from kvcanary.config import CanaryConfig, EngineConfig, SamplingParams
from kvcanary.jit import cache_hook  # noqa: F401  (numba cache keyed by source; before any @njit)

__all__ = ["CanaryConfig", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing kvcanary must not load the model stack
    if name in ("Engine", "RequestOutput"):
        from kvcanary.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
