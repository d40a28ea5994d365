"""The numba kernels' memo of launch arguments lives with the violation ring, so with its
canary: once a canary is dropped nothing keeps its records or the KV pool its real-KV
sources view alive (a module-level memo once kept every pool a process had guarded: one
leaked KV cache per vLLM engine started in a process)."""

from __future__ import annotations

import gc
import weakref

import torch

from kvcanary.canary.kernels import numba_kernels
from kvcanary.canary.report.ring import ViolationRing
from kvcanary.canary.wire.real_kv import RealKvSource
from kvcanary.canary.wire.records import alloc_canary_buffer


def test_launch_memo_goes_with_the_ring() -> None:
    pool = torch.zeros(64, 256, dtype=torch.uint8)  # a KV pool: 64 slots of 256 bytes
    records, ring = alloc_canary_buffer(64, torch.device("cpu")), ViolationRing(8)
    sources = (RealKvSource(pool, 1, 256, 128),)
    first = numba_kernels._launch_args(records, sources, ring, None)
    assert numba_kernels._launch_args(records, sources, ring, None) is first  # memoised
    refs = [weakref.ref(t) for t in (pool, records)]
    del pool, records, sources, ring, first
    gc.collect()
    assert [r() for r in refs] == [None, None]
