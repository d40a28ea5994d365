"""CanaryConfig: what the canary checks and what it does on a violation (frozen).

``EngineConfig.canary`` holds one (default: mode ``none``). Each field's ``metadata`` names
its ``kvcanary run`` flag, help text and choices; :mod:`kvcanary.engine.args` builds the
``--kv-canary*`` flags from them, so this class is the one list of the canary's options.
Fields that are no flag say so (``"flag": None``). Validation errors name the flag (with its
argparse dest), the value and the allowed values. Environment variables only supply
defaults, through :mod:`kvcanary.envs`.

Modes (``--kv-canary``)::

    none   nothing is installed; the engine runs exactly as without the canary
    log    every violation is logged (one warning per row); serving goes on
    raise  every new violation is logged, then KVCanaryViolation is raised (once)
    abort  every violation is logged; the requests whose req->token rows reference the
           violating slots are aborted, those slots quarantined; serving goes on
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any

from kvcanary import envs
from kvcanary.canary.wire.constants import RealKvHashMode
from kvcanary.utils import show

KV_CANARY_MODES = ("none", "log", "raise", "abort")
REAL_DATA_MODES = ("none", "partial", "all")
REAL_DATA_LAYERS = ("first", "all")
KERNEL_BACKENDS = ("auto", "numba", "torch", "triton")


def _flag(flag: str, help: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A field's metadata: its command-line flag (see :func:`kvcanary.engine.args.add_dataclass_flags`)."""
    return {"flag": flag, "help": help, "choices": choices}


@dataclass(frozen=True, kw_only=True)
class CanaryConfig:
    mode: str = field(default="none", metadata=_flag(
        "--kv-canary", choices=KV_CANARY_MODES,
        help="KV-canary mode: none installs nothing; log warns and goes on; raise fails on "
             "the first violation; abort aborts only the implicated requests "
             "(default: %(default)s)"))  # fmt: skip
    # Real-KV fingerprint (record field 3): none | partial (first 16 bytes of each slot) | all.
    real_data: str = field(default="none", metadata=_flag(
        "--kv-canary-real-data", choices=REAL_DATA_MODES,
        help="fingerprint the real KV bytes of each slot: none, partial (first 16 bytes) or "
             "all (default: %(default)s)"))  # fmt: skip
    # Which layers of each sub-pool are fingerprinted: first (SGLang's layer 0) | all (<= 4).
    real_data_layers: str = field(default="first", metadata=_flag(
        "--kv-canary-real-data-layers", choices=REAL_DATA_LAYERS,
        help="layers fingerprinted per sub-pool: first (layer 0) or all (<= 4) "
             "(default: %(default)s)"))  # fmt: skip
    # Also run the V-half canaries (SGLang: SGLANG_KV_CANARY_ENABLE_MHA_V; K only by default).
    v_half: bool = field(default=False, metadata=_flag(
        "--kv-canary-v-half", help="also run the V-half canaries (default: K only)"))
    # Check each verified slot's token against the request's prompt + output ids.
    verify_tokens: bool = field(default=False, metadata=_flag(
        "--kv-canary-verify-tokens",
        help="check every verified slot's token against the request's prompt + output ids"))
    ring_capacity: int = field(default_factory=envs.KVCANARY_KV_CANARY_RING_CAPACITY.get,
                               metadata=_flag(
        "--kv-canary-ring-capacity",
        help="violation rows kept (more are counted, not stored) (default: %(default)s, from "
             "KVCANARY_KV_CANARY_RING_CAPACITY)"))  # fmt: skip
    # Most verify entries per group per forward; more => verify skipped that step with a
    # warning. 0: KVCANARY_KV_CANARY_VERIFY_CAPACITY_FACTOR x the group's slots.
    verify_capacity: int = field(default=0, metadata=_flag(
        "--kv-canary-verify-capacity",
        help="most verify entries per group per forward, 0 = 3 x pool slots; more skips "
             "verify that step with a warning (default: %(default)s)"))  # fmt: skip
    # Canary kernels: auto = numba on CPU, triton on CUDA when installed, torch elsewhere;
    # triton needs the `gpu` extra. Not a flag: set through the environment.
    backend: str = field(default_factory=envs.KVCANARY_KV_CANARY_KERNEL_BACKEND.get,
                         metadata={"flag": None, "env": "KVCANARY_KV_CANARY_KERNEL_BACKEND"})
    # Decode forwards planned with static capacities on the device (:mod:`.static_plan`): no
    # host read in the canary's part of the forward, so the GraphRunner can capture decode
    # with the canary on (CUDA); on the CPU the same plans run eagerly.
    graph_safe: bool = field(default=False, metadata=_flag(
        "--kv-canary-graph-safe",
        help="plan decode forwards with static capacities on the device (no host read in "
             "the forward): decode with the canary on can be captured in CUDA graphs; on "
             "the CPU the same path runs eagerly"))  # fmt: skip
    # Steps between a violation and its report. None: 1 on accelerators (the device->host
    # copy of the ring counter is staged and read one step later: no host sync on the
    # forward path), 0 on CPU (reading host memory costs nothing). Internal, not a flag.
    pump_delay_steps: int | None = field(default=None, metadata={"flag": None})
    # Every N forward steps verify every slot the radix prefix cache holds (0 = off).
    sweep_interval: int = field(default=0, metadata=_flag(
        "--kv-canary-sweep-interval",
        help="every N forward steps, verify every slot the prefix cache holds; 0 = off; "
             "needs --kv-canary log|raise|abort (default: %(default)s)"))  # fmt: skip
    # Every N forward steps log the `[canary] step=... protected_tokens=...` line (0 = off).
    stats_interval: int = field(default=100, metadata=_flag(
        "--kv-canary-stats-interval",
        help="every N forward steps log `[canary] step=... protected_tokens=...` (INFO); "
             "0 = off (default: %(default)s)"))  # fmt: skip
    # Every N forward steps (from step N on) check that every launch tag expected to run
    # since the last check did run; raises KVCanaryHealthError otherwise (0 = off).
    health_check_interval: int = field(default=100, metadata=_flag(
        "--kv-canary-health-check-interval",
        help="every N forward steps check that every expected launch tag ran since the last "
             "check, else fail; 0 = off (default: %(default)s)"))  # fmt: skip
    # Every N forward steps log `kv_canary_swa_divergence={...}` (0 = off): coverage
    # telemetry of the sliding-window path, never a check.
    swa_divergence_interval: int = field(
        default_factory=envs.KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL.get, metadata=_flag(
        "--kv-canary-swa-divergence-interval",
        help="every N forward steps log `kv_canary_swa_divergence={...}` (INFO): proof the "
             "SWA path was exercised; 0 = off (default: %(default)s, from "
             "KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL)"))  # fmt: skip

    def __post_init__(self) -> None:
        _check(self.mode in KV_CANARY_MODES, "mode", self.mode, f"one of {show(KV_CANARY_MODES)}")
        _check(self.real_data in REAL_DATA_MODES, "real_data", self.real_data,
               f"one of {show(REAL_DATA_MODES)}")  # fmt: skip
        _check(self.real_data_layers in REAL_DATA_LAYERS, "real_data_layers",
               self.real_data_layers, f"one of {show(REAL_DATA_LAYERS)}")  # fmt: skip
        _check(_is_int(self.ring_capacity) and self.ring_capacity >= 1, "ring_capacity",
               self.ring_capacity, "an integer >= 1")  # fmt: skip
        _check(_is_int(self.verify_capacity) and self.verify_capacity >= 0, "verify_capacity",
               self.verify_capacity, "an integer >= 0 (0 = automatic)")  # fmt: skip
        _check(self.backend in KERNEL_BACKENDS, "backend", self.backend,
               f"one of {show(KERNEL_BACKENDS)}")  # fmt: skip
        if self.backend == "triton":
            from kvcanary.canary.kernels.dispatch import TRITON_MISSING, triton_installed

            if not triton_installed():
                env = _FIELDS["backend"].metadata["env"]
                raise ValueError(f"{env}={show(self.backend)} {TRITON_MISSING}")
        _check(self.pump_delay_steps in (None, 0, 1), "pump_delay_steps",
               self.pump_delay_steps, "None (automatic), 0 or 1")  # fmt: skip
        for name in ("sweep_interval", "stats_interval", "health_check_interval",
                     "swa_divergence_interval"):  # fmt: skip
            value = getattr(self, name)
            _check(_is_int(value) and value >= 0, name, value, "an integer >= 0 (0 = off)")
        if self.mode == "none":  # options that only mean something with a mode
            for name in ("real_data", "v_half", "verify_tokens", "sweep_interval", "graph_safe"):
                value, default = getattr(self, name), _FIELDS[name].default
                _check(value == default, name, value,
                       f"only {show(default)} while {_FIELDS['mode'].metadata['flag']} is \"none\" "
                       f"(pick a mode in {show(KV_CANARY_MODES[1:])})")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def real_kv_hash_mode(self) -> RealKvHashMode:
        return RealKvHashMode[self.real_data.upper()]


_FIELDS: dict[str, Field[Any]] = {f.name: f for f in fields(CanaryConfig)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    """Errors name the field's flag and its argparse dest (``--kv-canary (kv_canary)='x'
    ...``), or its environment variable, or (internal fields) its name."""
    if ok:
        return
    meta = _FIELDS[name].metadata
    flag = meta["flag"]
    label = f"{flag} ({flag[2:].replace('-', '_')})" if flag else meta.get("env", name)
    raise ValueError(f"{label}={show(value)} is invalid: allowed {allowed}")
