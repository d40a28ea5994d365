"""Canary options of the vLLM connector, read from ``kv_connector_extra_config``.

Keys (all optional; the values of ``kvcanary run``'s ``--kv-canary*`` flags)::

    mode                 log (default) | raise | abort    (abort: see docs/VLLM.md; it
                         reports the violating blocks to vLLM as KV load errors, and
                         vLLM's kv_load_failure_policy fails or recomputes the requests)
    real_data            none | partial (default) | all    fingerprint of the live KV bytes
    real_data_layers     first (default) | all             fingerprinted layers per group
    v_half               false (default) | true            a second, independent record set
    verify_tokens        true (default) | false            stored token vs the request's ids
    ring_capacity, verify_capacity, stats_interval, health_check_interval  as in kvcanary
    summary_path         write a JSON summary there at shutdown (and at each stats line);
                         with several workers (tensor / pipeline parallel) rank 0 writes
                         PATH and rank r > 0 PATH with ``.rank<r>`` before the extension
                         (:func:`rank_summary_path`)
    tenant_isolation     false (default) | true            seed each request's records with
                         its cache namespace (LoRA adapter, cache_salt): KV shared across
                         namespaces is a violation (:mod:`.namespace`)

Unknown keys are an error (a typo must not silently disable a check). Nothing here
imports vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvcanary.canary.config import CanaryConfig

#: The connector name vLLM knows it by (``--kv-transfer-config '{"kv_connector": ...}'``).
CONNECTOR_NAME = "KVCanaryConnector"
CONNECTOR_MODULE = "kvcanary.integrations.vllm.connector"

_CANARY_KEYS = {
    "mode": str,
    "real_data": str,
    "real_data_layers": str,
    "v_half": bool,
    "verify_tokens": bool,
    "ring_capacity": int,
    "verify_capacity": int,
    "stats_interval": int,
    "health_check_interval": int,
}
_DEFAULTS: dict[str, Any] = {
    "mode": "log",
    "real_data": "partial",
    "verify_tokens": True,
    # Coverage telemetry that reads a fixed req->token table; the vLLM host rebuilds its
    # tables every step, so it stays off here.
    "swa_divergence_interval": 0,
}


@dataclass(frozen=True)
class VllmCanaryOptions:
    canary: CanaryConfig
    summary_path: str | None = None
    tenant_isolation: bool = False


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"kv_connector_extra_config[{key!r}]={value!r}: allowed true or false")


def parse_options(extra: dict[str, Any] | None) -> VllmCanaryOptions:
    """The canary options in ``extra`` (``kv_connector_extra_config``)."""
    extra = dict(extra or {})
    summary = extra.pop("summary_path", None)
    tenants = _as_bool("tenant_isolation", extra.pop("tenant_isolation", False))
    unknown = sorted(set(extra) - set(_CANARY_KEYS))
    if unknown:
        raise ValueError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; allowed: "
            f"{sorted([*_CANARY_KEYS, 'summary_path', 'tenant_isolation'])}"
        )
    kwargs = dict(_DEFAULTS)
    for key, value in extra.items():
        kind = _CANARY_KEYS[key]
        if kind is bool:
            kwargs[key] = _as_bool(key, value)
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"kv_connector_extra_config[{key!r}]={value!r}: an integer")
            kwargs[key] = int(value)
        else:
            kwargs[key] = str(value)
    if kwargs["mode"] == "none":
        raise ValueError(
            "kv_connector_extra_config['mode']='none': to run without the canary, leave "
            "kv_transfer_config out"
        )
    if tenants and not kwargs["verify_tokens"]:
        raise ValueError(
            "kv_connector_extra_config['tenant_isolation']=true needs verify_tokens true "
            "(the namespace rides in the token ids the canary checks)"
        )
    return VllmCanaryOptions(CanaryConfig(**kwargs), None if summary is None else str(summary),
                             tenants)  # fmt: skip


def rank_summary_path(path: str, rank: int, world_size: int) -> str:
    """Where worker ``rank`` of ``world_size`` writes ``summary_path`` ``path`` (its
    Prometheus text beside it, at ``+ ".prom"``): ``path`` itself for rank 0 (a single
    worker's path is unchanged), else ``.rank<r>`` before the extension::

        /tmp/kv-canary.json  rank 1 -> /tmp/kv-canary.rank1.json (.prom: ...rank1.json.prom)
        /tmp/kv-canary       rank 1 -> /tmp/kv-canary.rank1
    """
    if rank == 0 or world_size <= 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"
