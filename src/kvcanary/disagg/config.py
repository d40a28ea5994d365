"""Frozen configuration of prefill/decode disaggregation (one source of truth for the
``kvcanary run --disagg`` / ``kvcanary bench prealloc`` defaults).

Each side runs its own :class:`~kvcanary.config.EngineConfig` (same model and seed, so the
same weights; pool sizes may differ); :class:`DisaggConfig` holds what the two sides agree
on and the decode side's admission policy. :class:`DisaggFaults` are test hooks that break
one thing on purpose (the canary and the failure handling must notice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcanary.utils import show

TRANSFER_BACKENDS = ("torch", "inproc")
DIST_BACKENDS = ("auto", "gloo", "nccl")


def _check(ok: bool, flag: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{flag}={show(value)} is invalid: allowed {allowed}")


@dataclass(frozen=True)
class DisaggConfig:
    # "torch": two processes over torch.distributed point-to-point; "inproc": both workers
    # in this process over an in-memory link (tests, benchmarks).
    transfer_backend: str = "torch"
    # torch.distributed backend of the KV data channel; auto: gloo on CPU, nccl on CUDA.
    # Control messages always travel over gloo.
    dist_backend: str = "auto"
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port
    # A request that has not received its KV and first token this long after the decode
    # side sent its page ids fails (its pre-allocated memory is freed).
    transfer_timeout_s: float = 60.0
    # Worker start-up (model load + rendezvous) and shutdown limits.
    connect_timeout_s: float = 120.0
    # Decode admission: tokens reserved per active request for decode growth (SGLang's
    # num_reserved_decode_tokens), and the cap on max_new_tokens used in the estimates.
    num_reserved_decode_tokens: int = 8
    clip_max_new_tokens: int = 4096
    # Pre-allocate only the page-aligned window tail of the SWA pool (SWA pools, page > 1).
    swa_tail_prealloc: bool = True
    # torch threads per worker process; 0: half the CPUs (two workers share the machine).
    threads_per_worker: int = 0

    def __post_init__(self) -> None:
        _check(self.transfer_backend in TRANSFER_BACKENDS, "--disagg-transfer-backend",
               self.transfer_backend, f"one of {show(TRANSFER_BACKENDS)}")  # fmt: skip
        _check(self.dist_backend in DIST_BACKENDS, "--disagg-dist-backend",
               self.dist_backend, f"one of {show(DIST_BACKENDS)}")  # fmt: skip
        _check(0 <= self.master_port <= 65535, "--disagg-master-port", self.master_port,
               "an integer in [0, 65535] (0 = pick a free port)")  # fmt: skip
        _check(self.transfer_timeout_s > 0, "--disagg-transfer-timeout", self.transfer_timeout_s,
               "a number of seconds > 0")  # fmt: skip
        _check(self.connect_timeout_s > 0, "--disagg-connect-timeout", self.connect_timeout_s,
               "a number of seconds > 0")  # fmt: skip
        _check(self.num_reserved_decode_tokens >= 0, "--num-reserved-decode-tokens",
               self.num_reserved_decode_tokens, "an integer >= 0")  # fmt: skip
        _check(self.clip_max_new_tokens >= 1, "--clip-max-new-tokens",
               self.clip_max_new_tokens, "an integer >= 1")  # fmt: skip
        _check(self.threads_per_worker >= 0, "--disagg-threads-per-worker",
               self.threads_per_worker, "an integer >= 0 (0 = half the CPUs)")  # fmt: skip


@dataclass(frozen=True)
class DisaggFaults:
    """Deliberate faults (tests and self-tests only; all off by default)."""

    # Decode side: every received page lands this many pages off its destination (models
    # a page-table bug in a transfer engine). The canary reports it on the first forward.
    page_offset: int = 0
    # Prefill side: the canary's ``real_kv_post_forward`` perturbation on every forward (a
    # byte flip in one slot the forward wrote, full-attention group; needs the canary with
    # real data). The prefill side never reads it again; the decode side must report it.
    real_kv_post_forward: bool = False
    # Prefill side: exit the process abruptly on receiving this many prefill requests.
    crash_prefill_on_request: int = 0
    # Prefill side: never send the KV of these request ids (the decode side times out).
    drop_transfer_rids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(self.crash_prefill_on_request >= 0, "crash_prefill_on_request",
               self.crash_prefill_on_request, "an integer >= 0 (0 = off)")  # fmt: skip
        object.__setattr__(self, "drop_transfer_rids", tuple(self.drop_transfer_rids))
