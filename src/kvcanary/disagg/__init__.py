"""Prefill/decode disaggregation: a prefill worker and a decode worker (separate processes
over torch.distributed, or one process for tests), the decode side's two-budget
pre-allocation with SWA tail allocation, and KV transfer through the pools' buf-infos (so
the canary's records travel with the KV and are verified on arrival).

    config.py    DisaggConfig, DisaggFaults
    prealloc.py  DecodePreallocQueue: budgets, admission, pre-allocation
    pages.py     which pages a transfer covers; gather/scatter through buf-infos
    transfer.py  TransferLink: InProcessLink, TorchDistLink (gloo / NCCL)
    protocol.py  the messages, DisaggOutput / DisaggError, what both workers share
    prefill_worker.py, decode_worker.py   the two workers (each an Engine)
    cluster.py   InProcessDisagg, DisaggCluster (two processes)
    bench.py     `kvcanary bench prealloc`
    cli_hooks.py flags and entry points for `kvcanary run --disagg` / `bench prealloc`
"""

from __future__ import annotations

from kvcanary.disagg.config import DisaggConfig, DisaggFaults

__all__ = ["DisaggConfig", "DisaggFaults"]
