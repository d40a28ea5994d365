"""The KV-cache integrity canary, wire-compatible with SGLang's kv_canary. It imports no
engine, no memory system and no host (``tests/canary/test_layering.py``); hosts live in
:mod:`kvcanary.integrations` and call it through the contract of :mod:`.host`
(docs/CANARY_PROTOCOL.md).

The front door (names below, loaded on first use)::

    install_canary(host, config) -> CanaryManager   before_forward / after_forward / end_step
    CanaryConfig, CanaryHost (and the other host protocols), KVCanaryViolation,
    register_pool_attacher / AttachOptions (teach it a pool type)

Inside, by role:

    wire/      the SGLang-compatible format: record layout, tags, fail reasons (constants),
               chain hash (hashing), records, real-KV fingerprints, violation log lines
    attach/    record buffer groups, the pool-attacher registry, MHA / SWA groups shared by
               every host's pools, buf-info splicing
    plan/      what one forward verifies and writes: the reference builder (the spec), the
               numba, row and Triton builders, graph-safe static plans, DSV4 state rings
    kernels/   verify / write: the contract and backend choice (dispatch), numba, torch and
               Triton backends, the fused CPU HEAD / TAIL, the TAIL store check
    report/    device ring -> log / raise / abort (pump, reporter), Prometheus
    observe/   one-step-late observers: radix sweep, stats line, health, SWA divergence,
               write-input token expectations
    perturb/   fault injection
    forward.py (HEAD / TAIL of one forward), manager.py, install.py, config.py, errors.py,
    explain.py (violation lines -> likely causes)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcanary.canary.attach.registry import AttachOptions, register_pool_attacher
    from kvcanary.canary.config import CanaryConfig
    from kvcanary.canary.errors import KVCanaryHealthError, KVCanaryViolation
    from kvcanary.canary.host import (
        CanaryHost,
        ForwardBatchView,
        KVPool,
        PrefixCacheView,
        ReqToTokenTable,
        TokenMirror,
    )
    from kvcanary.canary.install import install_canary
    from kvcanary.canary.manager import CanaryManager

_EXPORTS = {
    "install_canary": "install",
    "CanaryManager": "manager",
    "CanaryConfig": "config",
    "CanaryHost": "host",
    "ForwardBatchView": "host",
    "KVPool": "host",
    "PrefixCacheView": "host",
    "ReqToTokenTable": "host",
    "TokenMirror": "host",
    "KVCanaryViolation": "errors",
    "KVCanaryHealthError": "errors",
    "AttachOptions": "attach.registry",
    "register_pool_attacher": "attach.registry",
}
__all__ = [
    "AttachOptions",
    "CanaryConfig",
    "CanaryHost",
    "CanaryManager",
    "ForwardBatchView",
    "KVCanaryHealthError",
    "KVCanaryViolation",
    "KVPool",
    "PrefixCacheView",
    "ReqToTokenTable",
    "TokenMirror",
    "install_canary",
    "register_pool_attacher",
]


def __getattr__(name: str) -> Any:
    """Load a front-door name on first use: importing a sub-module (e.g. the wire format)
    must not load the manager, its kernels and numba."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcanary.canary' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvcanary.canary.{module}"), name)
