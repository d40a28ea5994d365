"""The oneDNN packed-weight linear (ops/cpu/gemm.py): same results as F.linear up to float
rounding, the packed copy follows in-place weight writes, the auto policy packs only big
weights at the row counts where it pays, and the engine's greedy tokens do not change."""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy_outputs, make_prompts, tiny_engine
from torch.nn import functional as F

from kvcanary.ops.cpu import gemm
from kvcanary.ops.cpu.gemm import MIN_PACKED_BYTES, PACKED_ROWS, SMALL_PACKED_ROWS, PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                 reason="oneDNN is not built into this torch")  # fmt: skip


@pytest.fixture
def gemm_mode(monkeypatch: pytest.MonkeyPatch):
    def set_mode(mode: str) -> None:
        monkeypatch.setenv("KVCANARY_CPU_GEMM", mode)
        gemm.cpu_gemm_mode.cache_clear()

    yield set_mode
    gemm.cpu_gemm_mode.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear(gemm_mode, dtype: torch.dtype) -> None:
    gemm_mode("onednn")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 48, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    linear = PackedLinear()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    wide = torch.randn(7, 80, generator=gen).to(dtype)
    for x in (torch.randn(5, 48, generator=gen).to(dtype),
              wide[:, 16:64],  # a non-contiguous view
              torch.randn(2, 3, 48, generator=gen).to(dtype)):  # fmt: skip
        for b in (bias, None):
            got = linear(x, weight, b)
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=tol, atol=tol)
    # It took the packed path, unless oneDNN cannot pack the dtype on this CPU (bfloat16
    # without AVX-512 BW/VL/DQ or AVX-NE-CONVERT), where it must fall back, not fail.
    assert (linear._packed is not None) == gemm.packable(dtype)
    assert gemm.packable(torch.float32)


def test_packed_copy_follows_in_place_weight_writes(gemm_mode) -> None:
    gemm_mode("onednn")
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(64, 32, generator=gen)
    view = fused[32:]  # a fused weight's part, as loaders copy_ into it
    x = torch.randn(4, 32, generator=gen)
    linear = PackedLinear()
    before = linear(x, fused)
    view.copy_(torch.randn(32, 32, generator=gen))
    after = linear(x, fused)
    torch.testing.assert_close(after, F.linear(x, fused))
    assert not torch.allclose(after[:, 32:], before[:, 32:])
    torch.testing.assert_close(after[:, :32], before[:, :32])
    replaced = torch.randn(64, 32, generator=gen)
    torch.testing.assert_close(linear(x, replaced), F.linear(x, replaced))


def test_auto_policy_packs_in_the_winning_row_ranges(gemm_mode) -> None:
    """Weights of at least MIN_PACKED_BYTES packed from PACKED_ROWS' first row count (one
    byte less: only from SMALL_PACKED_ROWS' first row count, a prefill chunk's); no rows, no
    packing."""
    gemm_mode("auto")
    lo = PACKED_ROWS[torch.float32][0]
    small_lo = SMALL_PACKED_ROWS[torch.float32][0]
    big = torch.randn(MIN_PACKED_BYTES // 4 // 256, 256)  # exactly MIN_PACKED_BYTES
    small = torch.randn(big.shape[0] - 1, 256)
    for weight, rows, packed in ((big, lo, True), (big, small_lo + 1, True), (big, 0, False),
                                 (small, lo, False), (small, small_lo - 1, False),
                                 (small, small_lo, True)):  # fmt: skip
        linear = PackedLinear()
        x = torch.randn(rows, 256)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)
        assert (linear._packed is not None) == packed, (tuple(weight.shape), rows)


def test_torch_mode_never_packs(gemm_mode) -> None:
    gemm_mode("torch")
    linear = PackedLinear()
    weight = torch.randn(MIN_PACKED_BYTES // 4 // 128, 128)
    x = torch.randn(16, 128)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert linear._packed is None


def test_bad_mode_is_one_clear_error(gemm_mode) -> None:
    gemm_mode("mkl")
    with pytest.raises(
        ValueError, match=r'KVCANARY_CPU_GEMM="mkl" is invalid: allowed one of auto, onednn, torch'
    ):
        PackedLinear()(torch.randn(2, 4), torch.randn(3, 4))


def test_engine_greedy_tokens_equal_with_packed_weights(gemm_mode) -> None:
    """Every linear of the engine's model (qkv, o, gate_up, down, lm_head) packed, batches of
    1..12 rows in prefill chunks and decode: the same greedy tokens as F.linear."""
    prompts = make_prompts(12, 5, 40, seed=3)
    outputs = {}
    for mode in ("torch", "onednn"):
        gemm_mode(mode)
        engine = tiny_engine(chunked_prefill_size=64)
        outputs[mode] = greedy_outputs(engine, prompts, max_new_tokens=12)
        packed = [
            m._qkv._packed is not None
            for m in (layer.self_attn for layer in engine.runner.model.layers)
        ]
        assert all(packed) == (mode == "onednn")
    assert outputs["onednn"] == outputs["torch"]


def test_inference_tensor_weights_are_not_packed(gemm_mode) -> None:
    """An inference tensor keeps no version counter, so a packed copy could go stale
    unnoticed: such weights go to F.linear."""
    gemm_mode("onednn")
    with torch.inference_mode():
        weight = torch.randn(8, 4)
    x = torch.randn(3, 4)
    linear = PackedLinear()
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert linear._packed is None


def test_weights_are_not_packed_when_the_copy_would_exhaust_memory(gemm_mode, monkeypatch) -> None:
    gemm_mode("onednn")
    weight, x = torch.randn(64, 32), torch.randn(4, 32)
    total = 64 << 30
    monkeypatch.setattr(gemm, "memory_info", lambda: (gemm.MIN_FREE_BYTES + 64 * 32 * 4 - 1, total))
    monkeypatch.setattr(gemm, "MIN_FREE_FRACTION", 0.0)
    linear = PackedLinear()
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert linear._packed is None and linear._rows is None  # decided once: never retried
    monkeypatch.setattr(gemm, "memory_info", lambda: (gemm.MIN_FREE_BYTES + 64 * 32 * 4, total))
    linear = PackedLinear()
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
    assert linear._packed is not None
    assert gemm.memory_info() is not None  # this machine has /proc/meminfo
