"""CPU RMSNorm (:mod:`kvcanary.ops.cpu.rmsnorm`): one compiled pass must give exactly
``F.rms_norm``'s bits (torch's float32 sum tree included) for every row length, and the
model must keep the torch ops wherever the pass does not apply."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kvcanary.model.layers import RMSNorm
from kvcanary.ops.cpu import rmsnorm as norm_cpu
from kvcanary.ops.cpu import rope as rope_cpu

# Shorter than a vector, tails, ILP remainders, one and several cascade levels of 16.
LENGTHS = [*range(1, 41), 63, 64, 65, 127, 128, 129, 544, 1000, 1024, 3072, 4099, 16384, 40000]


def test_the_probe_finds_torchs_sum_width_here() -> None:
    # CI's machine: a width must be found, or the model silently runs the torch ops.
    assert norm_cpu.lanes() in (4, 8, 16)


@pytest.mark.parametrize("dim", LENGTHS)
def test_rms_norm_equals_torch_bit_for_bit(dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(5, dim, generator=gen) * torch.rand(5, 1, generator=gen) * 20
    y = torch.randn(5, dim, generator=gen)
    weight = torch.randn(dim, generator=gen)
    # The pass takes decode-sized inputs; larger ones only with threads to split them
    # among (the tests run torch on one: the torch ops, the same bits).
    assert norm_cpu.applies(x) == (x.numel() <= norm_cpu._MAX_ELEMENTS)
    for w in (weight, None):
        assert torch.equal(norm_cpu.rms_norm(x, w, 1e-6), F.rms_norm(x, (dim,), w, 1e-6))
    total, normed = norm_cpu.add_rms_norm(x, y, weight, 1e-5)
    assert torch.equal(total, x + y)
    assert torch.equal(normed, F.rms_norm(x + y, (dim,), weight, 1e-5))
    assert not norm_cpu.applies(x.clone().requires_grad_())  # autograd keeps the torch ops


def test_rms_norm_takes_any_layout_and_returns_the_input_shape() -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 6, 80, generator=gen)
    for x in (wide[:, :3, :64], wide.transpose(0, 1), wide[0]):  # strided, permuted, 2-D
        weight = torch.randn(x.shape[-1], generator=gen)
        got = norm_cpu.rms_norm(x, weight, 1e-6)
        assert got.shape == x.shape and torch.equal(got, F.rms_norm(x, (x.shape[-1],), weight, 1e-6))
        total, normed = norm_cpu.add_rms_norm(x, x * 0.5, weight, 1e-6)
        assert total.shape == x.shape and torch.equal(total, x + x * 0.5)
        assert torch.equal(normed, F.rms_norm(x + x * 0.5, (x.shape[-1],), weight, 1e-6))


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm_module_paths(offset: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's forward / add_forward equal the torch ops with the pass (no weight
    offset, float32), without it (no width found here), and with a Gemma weight offset."""
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(96, 1e-6, offset).requires_grad_(False)
    norm.weight.copy_(torch.randn(96, generator=gen))
    x, y = torch.randn(7, 96, generator=gen), torch.randn(7, 96, generator=gen)
    if offset:
        x32 = x + y
        want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + norm.weight)
    else:
        want = F.rms_norm(x + y, (96,), norm.weight, 1e-6)
    for width in (None, 0):  # the probed width, then none found: the torch path
        if width is not None:
            monkeypatch.setattr(norm_cpu, "_lanes", width)
            assert not norm_cpu.applies(x)
        total, normed = norm.add_forward(x, y)
        assert torch.equal(total, x + y) and torch.equal(normed, want)
        assert torch.equal(norm(x + y), want)


def test_the_probe_refuses_a_torch_whose_sums_it_cannot_reproduce(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch whose rms_norm adds in another order (here: in float64, rounded once) finds
    no width: the model keeps the torch ops rather than drift from them."""

    torch_rms_norm = F.rms_norm

    def other_order(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
                    eps: float) -> torch.Tensor:  # fmt: skip
        out = torch_rms_norm(x.double(), shape, None if weight is None else weight.double(), eps)
        return out.float()

    monkeypatch.setattr(norm_cpu.F, "rms_norm", other_order)
    assert norm_cpu._probe() == 0


@pytest.mark.parametrize("dim", [8, 32, 64, 128])
def test_rope_pass_norms_first_bit_for_bit(dim: int) -> None:
    """Qwen3's q/k norm folded into the compiled rope pass equals rms_norm, then the weight,
    then the rotation, as separate torch ops (q and k as a strided view of the projection)."""
    gen = torch.Generator().manual_seed(dim)
    wide = torch.randn(9, 7, dim, generator=gen) * 4
    x = wide[:, :5]
    cos, sin = torch.randn(9, 1, dim, generator=gen), torch.randn(9, 1, dim, generator=gen)
    weight = torch.randn(5, dim, generator=gen)
    for w in (weight, None):
        got = rope_cpu.rope(x, cos, sin, w, 1e-6)
        y = F.rms_norm(x, (dim,), None, 1e-6)
        y = y * w if w is not None else y
        half = dim // 2
        want = y * cos + torch.cat((y[..., half:], y[..., :half]), dim=-1) * sin
        assert torch.equal(got, want)


def test_rope_pass_rereads_tables_that_changed() -> None:
    """The pass keeps the last (cos, sin) views for the next layer of a forward: the same
    tensors again give the same rotation, the same tensors written in place or new ones (in
    inference mode too, a forward's) the new one, each time the torch ops' bits."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 16, generator=gen)
    cos, sin = torch.randn(6, 1, 16, generator=gen), torch.randn(6, 1, 16, generator=gen)

    def want(c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * c + torch.cat((x[..., 8:], x[..., :8]), dim=-1) * s

    assert torch.equal(rope_cpu.rope(x, cos, sin), want(cos, sin))
    assert torch.equal(rope_cpu.rope(x, cos, sin), want(cos, sin))
    cos.mul_(-0.5)  # the same tensor, new contents
    assert torch.equal(rope_cpu.rope(x, cos, sin), want(cos, sin))
    with torch.inference_mode():
        for scale in (2.0, 3.0):  # a forward's new tables each time
            c, s = cos * scale, sin * scale
            assert torch.equal(rope_cpu.rope(x, c, s), want(c, s))
            assert torch.equal(rope_cpu.rope(x, c, s), want(c, s))


@pytest.mark.parametrize("shape", [(300, 128), (2048, 96), (64, 1031), (5, 40000), (64, 128),
                                   (16, 128), (20, 6)])  # fmt: skip
def test_large_inputs_run_the_parallel_passes_bit_for_bit(
    shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On two torch threads, rms_norm, add_rms_norm and the rope pass (q/k norm included)
    split rows / tokens among them from ``_PARALLEL_MIN_*`` on (a big decode batch, a
    prefill), and give the torch ops' bits either way; on one thread the norm leaves rows
    past ``_MAX_ELEMENTS`` to torch."""
    from kvcanary.jit import parallel as numba_parallel

    calls: list[str] = []
    run = numba_parallel.run_parallel

    def spy(kernel, *args):  # type: ignore[no-untyped-def]
        calls.append(kernel.py_func.__name__)
        return run(kernel, *args)

    monkeypatch.setattr(numba_parallel, "run_parallel", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if numba_parallel.parallel_threads() < 2:
            pytest.fail("numba has one thread here: NUMBA_NUM_THREADS must allow two")
        gen = torch.Generator().manual_seed(shape[0])
        x = torch.randn(*shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 20
        y, weight = torch.randn(*shape, generator=gen), torch.randn(shape[1], generator=gen)
        assert norm_cpu.applies(x)
        for w in (weight, None):
            assert torch.equal(norm_cpu.rms_norm(x, w, 1e-6), F.rms_norm(x, (shape[1],), w, 1e-6))
        total, normed = norm_cpu.add_rms_norm(x, y, weight, 1e-5)
        assert torch.equal(total, x + y)
        assert torch.equal(normed, F.rms_norm(x + y, (shape[1],), weight, 1e-5))
        split = x.numel() > norm_cpu._MAX_ELEMENTS or (
            shape[0] >= norm_cpu._PARALLEL_MIN_ROWS and x.numel() >= norm_cpu._PARALLEL_MIN_ELEMENTS)
        assert calls == (["_rms_rows_parallel"] * 2 + ["_add_rms_rows_parallel"] if split else [])
        if shape[1] % 2 == 0:  # rope: x [tokens, heads, dim] a strided view, as q / k come
            dim = 32
            wide = torch.randn(shape[0], 7, dim, generator=gen) * 4
            qk = wide[:, :5]
            cos, sin = torch.randn(shape[0], 1, dim, generator=gen), torch.randn(shape[0], 1, dim, generator=gen)
            w5 = torch.randn(5, dim, generator=gen)
            want = F.rms_norm(qk, (dim,), None, 1e-6) * w5
            half = dim // 2
            want = want * cos + torch.cat((want[..., half:], want[..., :half]), dim=-1) * sin
            calls.clear()
            assert torch.equal(rope_cpu.rope(qk, cos, sin, w5, 1e-6), want)
            assert calls == (["_rope_parallel"] if shape[0] >= rope_cpu._PARALLEL_MIN_TOKENS else [])
    finally:
        torch.set_num_threads(threads)
    assert norm_cpu.applies(x) == (x.numel() <= norm_cpu._MAX_ELEMENTS)  # one thread
