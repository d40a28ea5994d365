"""The pool-attacher registry: which canary buffer groups a KV pool gets, chosen by the
pool's type. A host registers an attacher per pool class it serves
(:func:`register_pool_attacher`; ours: :mod:`kvcanary.integrations.native.pools`, SGLang's:
:mod:`kvcanary.integrations.sglang.pools`, vLLM's: :mod:`kvcanary.integrations.vllm.pool`);
the MHA / SWA layouts' groups are built once for all of them (:mod:`.mha`). An attacher
allocates the groups, splices their record buffers into the pool's buf-infos
(:mod:`.splice`) so transfers carry them, and, where the pool has them, registers slot
sidecars so host copies do. Another pool type raises ``NotImplementedError`` naming the
supported ones."""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.wire.constants import RealKvHashMode


@dataclass(frozen=True)
class AttachOptions:
    real_kv_mode: RealKvHashMode
    real_data_layers: str  # "first" | "all"
    window: int | None  # the model's sliding window (SWA groups need it)
    kv_token_id_vs_position_offset: int = 0


PoolAttacher = Callable[[Any, AttachOptions], list[CanaryBufferGroup]]
_ATTACHERS: dict[type, PoolAttacher] = {}


def register_pool_attacher(pool_type: type, attacher: PoolAttacher) -> None:
    """Teach :func:`attach_canary_buffers` a new pool type (subclasses inherit it)."""
    _ATTACHERS[pool_type] = attacher


def supported_pool_types() -> list[str]:
    return [t.__name__ for t in _ATTACHERS]


def attach_canary_buffers(pool: Any, options: AttachOptions) -> list[CanaryBufferGroup]:
    """Allocate, splice and register the canary groups of ``pool``; returns the groups."""
    attacher = next((_ATTACHERS[t] for t in type(pool).__mro__ if t in _ATTACHERS), None)
    if attacher is None:
        raise NotImplementedError(
            f"kv-canary: no attacher registered for pool class {type(pool).__name__}; "
            f"supported: {', '.join(supported_pool_types())}"
        )
    return attacher(pool, options)
