"""Per-token building blocks: RMSNorm and the gated (SwiGLU / GeGLU) MLP.

Both reproduce transformers' float32 upcasts and cast points, so bf16/fp16 results
round the way the reference does, not just fp32 ones.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from kvcanary.ops.cpu import rmsnorm as norm_cpu
from kvcanary.ops.cpu.gemm import PackedLinear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """``x / rms(x) * (weight_offset + weight)`` over the last dim, normalised in float32.

    ``weight_offset=0`` is Llama/Qwen (``weight * normed.to(dtype)``); ``weight_offset=1``
    is Gemma (``(normed * (1 + weight)).to(dtype)``, weights stored as deltas from 1).
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        weight_offset: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.full((dim,), 1.0 - weight_offset, device=device, dtype=dtype)
        )
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.weight_offset and x.dtype == torch.float32:
            # One pass instead of ~8 small ops, the same bits (CPU: :mod:`kvcanary.ops.cpu.rmsnorm`).
            if norm_cpu.applies(x):
                return norm_cpu.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (normed * (self.weight_offset + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + y, self(x + y))``: a residual add and this norm, in one CPU pass where
        :mod:`kvcanary.ops.cpu.rmsnorm` applies (the same bits as the two apart)."""
        if not self.weight_offset and x.dtype == torch.float32 and y.dtype == torch.float32 and (
            x.shape == y.shape and norm_cpu.applies(x)
        ):
            return norm_cpu.add_rms_norm(x, y, self.weight, self.eps)
        total = x + y
        return total, self(total)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with HF parameter names ``gate_proj/up_proj/down_proj``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={hidden_act!r}; allowed: {sorted(ACTIVATIONS)}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias, device, dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias, device, dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias, device, dtype)
        self.gate_up_weight, self.gate_up_bias = fuse_linears(self.gate_proj, self.up_proj)
        self.act_fn = ACTIVATIONS[hidden_act]
        self._gate_up, self._down = PackedLinear(), PackedLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        # act(gate) is a new tensor: multiplied in place, the same values as act(gate) * up
        # without a second output (on the CPU each small op's allocation is a few us).
        return self._down(self.act_fn(gate).mul_(up), self.down_proj.weight, self.down_proj.bias)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) tensor for several projections of the same input, with each
    linear's own parameter re-pointed to a *view* of it: loaders that ``copy_`` into the
    named (Hugging Face-compatible) parameters fill the fused tensor, and a forward does one
    GEMM instead of several. Build the model on its final device: ``.to()`` would re-allocate
    the parameters and break the views."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias
