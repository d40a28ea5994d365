"""The real-KV sources of a vLLM layer tensor (without vLLM): on the CPU layout the K
records fingerprint KV head 0's K (strided), the V records the last head's V; an ISA whose
layout the canary cannot describe, or a non-float cache, gets records only."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.canary.wire.constants import RealKvHashMode
from kvcanary.canary.wire.real_kv import RealKvSource, real_kv_hashes_t
from kvcanary.integrations.vllm.meta import GroupSpec
from kvcanary.integrations.vllm.pool import layer_sources

BLOCKS, HEADS, BS, DIM = 5, 2, 16, 32


def _kv(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=torch.Generator().manual_seed(2)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
def test_cpu_layout_k_records_fingerprint_k(dtype: torch.dtype, mode: RealKvHashMode) -> None:
    kv = _kv(dtype)
    k, v = layer_sources(kv, GroupSpec(0, ("l",), BS, HEADS, DIM), mode)
    assert k is not None and v is not None and k.strided and not v.strided
    es = kv.element_size()
    read = 16 if mode == RealKvHashMode.PARTIAL else DIM * es
    assert k.read_bytes == v.read_bytes == read
    # vLLM stores K of (block, head) as [head_size, block_size]: token t's K is K_t[:, t]
    k_tokens = kv[:, 0].reshape(BLOCKS, 2, DIM, BS)[:, 0].transpose(1, 2).contiguous()
    v_tokens = kv[:, HEADS - 1].reshape(BLOCKS, 2, BS, DIM)[:, 1].contiguous()
    slots = torch.arange(BLOCKS * BS)
    for source, tokens in ((k, k_tokens), (v, v_tokens)):
        copy = RealKvSource(tokens.view(BLOCKS, -1).view(torch.uint8), BS, DIM * es, read)
        assert torch.equal(real_kv_hashes_t([source], slots), real_kv_hashes_t([copy], slots))


@pytest.mark.parametrize(("isa", "dtype"), [("amx", torch.bfloat16), ("neon", torch.float32),
                                            ("unknown", torch.float32), ("vec", torch.uint8)])  # fmt: skip
def test_cpu_layout_the_canary_cannot_describe_gets_records_only(
        isa: str, dtype: torch.dtype, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    kv = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=dtype)
    spec = GroupSpec(0, ("l",), BS, HEADS, DIM, cpu_attn_isa=isa)
    assert layer_sources(kv, spec, RealKvHashMode.ALL) == (None, None)
    assert f"ISA {isa!r}" in caplog.text and "records only" in caplog.text
    for ok in ("vec", "vec16"):  # the same tensor under the plain layout is fingerprinted
        if dtype != torch.uint8:
            assert layer_sources(kv, GroupSpec(0, ("l",), BS, HEADS, DIM, cpu_attn_isa=ok),
                                 RealKvHashMode.ALL)[0] is not None  # fmt: skip
