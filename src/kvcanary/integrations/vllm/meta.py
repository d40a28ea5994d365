"""Plain data that crosses from vLLM's scheduler to the worker-side canary (the connector
metadata) and vLLM's KV cache groups as the canary sees them.

Light on purpose (no numba, no vLLM): vLLM imports the connector module while it builds
its config, before its worker scans every loaded module to rebind Triton kernels
(``vllm/triton_utils/dispatcher.py::_rebind_kernels``), and that scan trips over
llvmlite's objects; the numba-backed canary loads only when the KV caches register.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcanary.canary.constants import PoolKind


@dataclass(frozen=True)
class GroupSpec:
    """One vLLM KV cache group, as the canary needs it."""

    index: int
    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None  # None: full attention

    @property
    def kind(self) -> PoolKind:
        return PoolKind.FULL if self.sliding_window is None else PoolKind.SWA


@dataclass
class StepRequest:
    """One scheduled request of a step, from the scheduler side (plain data: it travels in
    the connector metadata, pickled/msgpack'd between processes)."""

    req_id: str
    num_computed: int  # tokens already in the cache (vLLM's num_computed_tokens)
    num_scheduled: int
    token_start: int  # ``tokens`` are the ids of positions [token_start, token_start + len)
    tokens: list[int]  # -1: not known to the scheduler yet (async scheduling)
    first_slots: list[int]  # per group: slot of position num_computed, -1 when unallocated


@dataclass
class StepMeta:
    requests: list[StepRequest] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
