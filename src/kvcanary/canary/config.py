"""CanaryConfig: what the canary checks and what it does on a violation (frozen).

Every field maps to one ``kvcanary run`` flag (and one ``EngineConfig.kv_canary_*`` field);
validation errors name the flag, the value and the allowed values. Environment variables
only supply defaults, through :mod:`kvcanary.envs`.

Modes (``--kv-canary``)::

    none   nothing is installed; the engine runs exactly as without the canary
    log    every violation is logged (one warning per row); serving goes on
    raise  every new violation is logged, then KVCanaryViolation is raised (once)
    abort  every violation is logged; the requests whose req->token rows reference the
           violating slots are aborted, those slots quarantined; serving goes on
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcanary import envs
from kvcanary.canary.constants import RealKvHashMode

KV_CANARY_MODES = ("none", "log", "raise", "abort")
REAL_DATA_MODES = ("none", "partial", "all")
REAL_DATA_LAYERS = ("first", "all")
KERNEL_BACKENDS = ("auto", "numba", "torch")


def _check(ok: bool, flag: str, value: Any, allowed: str) -> None:
    """Errors name the flag and its EngineConfig field: ``--kv-canary (kv_canary)='x' ...``."""
    if not ok:
        if flag.startswith("--"):
            flag = f"{flag} ({flag[2:].replace('-', '_')})"
        raise ValueError(f"{flag}={value!r} is invalid: allowed {allowed}")


@dataclass(frozen=True, kw_only=True)
class CanaryConfig:
    mode: str = "log"
    # Real-KV fingerprint (record field 3): none | partial (first 16 bytes of each slot) | all.
    real_data: str = "none"
    # Which layers of each sub-pool are fingerprinted: first (SGLang's layer 0) | all (<= 4).
    real_data_layers: str = "first"
    # Also run the V-half canaries (SGLang: SGLANG_KV_CANARY_ENABLE_MHA_V; K only by default).
    v_half: bool = False
    # Check each verified slot's token against the request's prompt + output ids.
    verify_tokens: bool = False
    ring_capacity: int = field(default_factory=envs.KVCANARY_KV_CANARY_RING_CAPACITY.get)
    # Most verify entries per group per forward; more => verify skipped that step with a
    # warning. 0: KVCANARY_KV_CANARY_VERIFY_CAPACITY_FACTOR x the group's slots.
    verify_capacity: int = 0
    backend: str = field(default_factory=envs.KVCANARY_KV_CANARY_KERNEL_BACKEND.get)
    # Steps between a violation and its report. None: 1 on accelerators (the device->host
    # copy of the ring counter is staged and read one step later: no host sync on the
    # forward path), 0 on CPU (reading host memory costs nothing).
    pump_delay_steps: int | None = None
    # Every N forward steps verify every slot the radix prefix cache holds (0 = off).
    sweep_interval: int = 0
    # Every N forward steps log the `[canary] step=... protected_tokens=...` line (0 = off).
    stats_interval: int = 100
    # Every N forward steps (from step N on) check that every launch tag expected to run
    # since the last check did run; raises KVCanaryHealthError otherwise (0 = off).
    health_check_interval: int = 100
    # Every N forward steps log `kv_canary_swa_divergence={...}` (0 = off): coverage
    # telemetry of the sliding-window path, never a check.
    swa_divergence_interval: int = field(
        default_factory=envs.KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL.get
    )

    def __post_init__(self) -> None:
        _check(self.mode in KV_CANARY_MODES, "--kv-canary", self.mode,
               f"one of {KV_CANARY_MODES}")  # fmt: skip
        _check(self.real_data in REAL_DATA_MODES, "--kv-canary-real-data", self.real_data,
               f"one of {REAL_DATA_MODES}")  # fmt: skip
        _check(self.real_data_layers in REAL_DATA_LAYERS, "--kv-canary-real-data-layers",
               self.real_data_layers, f"one of {REAL_DATA_LAYERS}")  # fmt: skip
        _check(isinstance(self.ring_capacity, int) and self.ring_capacity >= 1,
               "--kv-canary-ring-capacity", self.ring_capacity, "an integer >= 1")  # fmt: skip
        _check(isinstance(self.verify_capacity, int) and self.verify_capacity >= 0,
               "--kv-canary-verify-capacity", self.verify_capacity,
               "an integer >= 0 (0 = automatic)")  # fmt: skip
        _check(self.backend in KERNEL_BACKENDS, "KVCANARY_KV_CANARY_KERNEL_BACKEND",
               self.backend, f"one of {KERNEL_BACKENDS}")  # fmt: skip
        _check(self.pump_delay_steps in (None, 0, 1), "pump_delay_steps",
               self.pump_delay_steps, "None (automatic), 0 or 1")  # fmt: skip
        intervals: tuple[tuple[str, Any], ...] = (
            ("--kv-canary-sweep-interval", self.sweep_interval),
            ("--kv-canary-stats-interval", self.stats_interval),
            ("--kv-canary-health-check-interval", self.health_check_interval),
            ("--kv-canary-swa-divergence-interval", self.swa_divergence_interval),
        )
        for flag, value in intervals:
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                   flag, value, "an integer >= 0 (0 = off)")  # fmt: skip
        if self.mode == "none":
            unset: tuple[tuple[str, Any, Any], ...] = (
                ("--kv-canary-real-data", self.real_data, "none"),
                ("--kv-canary-v-half", self.v_half, False),
                ("--kv-canary-verify-tokens", self.verify_tokens, False),
                ("--kv-canary-sweep-interval", self.sweep_interval, 0),
            )
            for flag, value, default in unset:
                _check(value == default, flag, value,
                       f"only {default!r} while --kv-canary is 'none' "
                       f"(pick a mode in {KV_CANARY_MODES[1:]})")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def real_kv_hash_mode(self) -> RealKvHashMode:
        return RealKvHashMode[self.real_data.upper()]

    @classmethod
    def from_engine_fields(cls, owner: Any) -> CanaryConfig:
        """The canary part of an ``EngineConfig`` (its ``kv_canary*`` fields)."""
        return cls(
            mode=owner.kv_canary,
            real_data=owner.kv_canary_real_data,
            real_data_layers=owner.kv_canary_real_data_layers,
            v_half=owner.kv_canary_v_half,
            verify_tokens=owner.kv_canary_verify_tokens,
            ring_capacity=owner.kv_canary_ring_capacity,
            verify_capacity=owner.kv_canary_verify_capacity,
            sweep_interval=owner.kv_canary_sweep_interval,
            stats_interval=owner.kv_canary_stats_interval,
            health_check_interval=owner.kv_canary_health_check_interval,
            swa_divergence_interval=owner.kv_canary_swa_divergence_interval,
        )
