"""The one typed registry of ``KVCANARY_*`` environment variables.

Environment variables only supply *defaults*; explicit configuration (dataclass fields, CLI
flags) always wins. Read a value with ``envs.KVCANARY_KV_CANARY_RING_CAPACITY.get()``; a
malformed value raises ``ValueError`` naming the variable, the value and what is allowed.
Nothing else in the package reads ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvcanary.utils import show

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    allowed: str
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError:
            raise ValueError(f"{self.name}={show(raw)} is invalid: allowed {self.allowed}") from None


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < lo:
            raise ValueError(raw)
        return value

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ValueError(raw)
        return value

    return parse


KVCANARY_KV_CANARY_RING_CAPACITY: EnvVar[int] = EnvVar(
    "KVCANARY_KV_CANARY_RING_CAPACITY", 1024, _int_at_least(1), "an integer >= 1",
    "violation ring rows (violations beyond it are counted, not stored)",
)  # fmt: skip
KVCANARY_KV_CANARY_VERIFY_CAPACITY_FACTOR: EnvVar[int] = EnvVar(
    "KVCANARY_KV_CANARY_VERIFY_CAPACITY_FACTOR", 3, _int_at_least(1), "an integer >= 1",
    "default per-forward verify capacity = factor x slots of the group's pool "
    "(radix sharing lets the sum of prefix lengths exceed the pool)",
)  # fmt: skip
KVCANARY_KV_CANARY_KERNEL_BACKEND: EnvVar[str] = EnvVar(
    "KVCANARY_KV_CANARY_KERNEL_BACKEND", "auto", _choice("auto", "numba", "torch", "triton"),
    "one of auto, numba, torch, triton",
    "canary kernels: auto = numba on CPU, Triton on CUDA when installed, torch elsewhere",
)  # fmt: skip

KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS: EnvVar[str] = EnvVar(
    "KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS", "auto", _choice("auto", "on", "off"),
    "one of auto, on, off",
    "graph-safe decode plans (--kv-canary-graph-safe) built through torch.compile: auto = on "
    "CUDA with triton installed (a few fused kernels in each captured graph instead of ~90)",
)  # fmt: skip

KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL: EnvVar[int] = EnvVar(
    "KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL", 0, _int_at_least(0), "an integer >= 0",
    "default of --kv-canary-swa-divergence-interval: log kv_canary_swa_divergence= every N "
    "forward steps (0 = off; SGLang: SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL)",
)  # fmt: skip

KVCANARY_CPU_GEMM: EnvVar[str] = EnvVar(
    "KVCANARY_CPU_GEMM", "auto", _choice("auto", "onednn", "torch"),
    "one of auto, onednn, torch",
    "the model's linear layers on the CPU: auto = oneDNN with weights packed once where that "
    "is faster (weights >= 1 MiB; smaller ones for 512+ rows) (it keeps a second copy of those "
    "weights, only while a tenth of memory stays available), onednn = packed for every weight and "
    "batch, torch = F.linear",
)  # fmt: skip

KVCANARY_CPU_DECODE: EnvVar[str] = EnvVar(
    "KVCANARY_CPU_DECODE", "compiled", _choice("compiled", "eager"),
    "one of compiled, eager",
    "a CPU decode forward of a plain float32 decoder: compiled = every layer in one numba call "
    "(ops/cpu/decode.py; where it applies), eager = module by module",
)  # fmt: skip

KVCANARY_WARMUP_HELPER: EnvVar[str] = EnvVar(
    "KVCANARY_WARMUP_HELPER", "auto", _choice("auto", "off"),
    "one of auto, off",
    "the warm-up's helper process (kvcanary/warmup.py): auto = with an empty cache, on two "
    "cores or more, a second process compiles the model's kernels while this one compiles the "
    "canary's (it loads the model once more meanwhile), off = one process compiles all",
)  # fmt: skip

ALL_ENV_VARS: tuple[EnvVar, ...] = (
    KVCANARY_KV_CANARY_RING_CAPACITY,
    KVCANARY_KV_CANARY_VERIFY_CAPACITY_FACTOR,
    KVCANARY_KV_CANARY_KERNEL_BACKEND,
    KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS,
    KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL,
    KVCANARY_CPU_GEMM,
    KVCANARY_CPU_DECODE,
    KVCANARY_WARMUP_HELPER,
)


def check_all() -> None:
    """Read every variable: a malformed one raises its ``ValueError`` (commands call this
    first, so a bad variable is one clean line whatever the command touches)."""
    for var in ALL_ENV_VARS:
        var.get()
