"""Rotary position embeddings: ``default``, ``linear``, ``llama3`` and ``yarn``.

The inverse frequencies are computed with the same float32 torch ops as transformers'
``modeling_rope_utils`` so that cos/sin agree to the last bit on the same device.
``dynamic`` (NTK) is deliberately unsupported: transformers recomputes its frequencies
from the longest sequence in each forward, so a token's rotation would depend on what it
is batched with, which a paged engine cannot reproduce.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from kvcanary.model.config import RopeScaling
from kvcanary.ops.cpu import rmsnorm as norm_cpu
from kvcanary.ops.cpu import rope as rope_cpu


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32 on CPU, attention_scaling applied to cos/sin)``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"rope_type={scaling.rope_type!r}; allowed: linear, llama3, yarn")


def _required(value: float | int | None, name: str) -> float:
    if value is None:
        raise ValueError(f"RopeScaling.{name} is required for this rope type")
    return value


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context_len = _required(
        s.original_max_position_embeddings, "original_max_position_embeddings"
    )
    low_freq_factor = _required(s.low_freq_factor, "low_freq_factor")
    high_freq_factor = _required(s.high_freq_factor, "high_freq_factor")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    original = _required(s.original_max_position_embeddings, "original_max_position_embeddings")
    factor = s.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, max_positions)``, indexed by token position.

    Buffers (not saved in state dicts) hold ``[max_positions, head_dim // 2]`` in the
    model dtype, computed in float32 first as transformers does. Positions passed to
    :meth:`cos_sin` must be ``< max_positions``.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        max_positions: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, device=device).float()
        freqs = positions[:, None] * inv_freq.to(device=device)[None, :]
        freqs = torch.cat((freqs, freqs), dim=-1)  # full head_dim, as transformers caches it
        self.cos_cached: torch.Tensor
        self.sin_cached: torch.Tensor
        self.register_buffer(
            "cos_cached", (freqs.cos() * attention_scaling).to(dtype), persistent=False
        )
        self.register_buffer(
            "sin_cached", (freqs.sin() * attention_scaling).to(dtype), persistent=False
        )
        half = head_dim // 2
        self.sin_signed: torch.Tensor  # sin with its first half negated (apply_rope's)
        self.register_buffer(
            "sin_signed", torch.cat((-self.sin_cached[:, :half], self.sin_cached[:, half:]), dim=-1),
            persistent=False,
        )  # fmt: skip

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[num_tokens, 1, head_dim]`` (broadcast over heads); ``sin``'s
        first half negated, as :func:`apply_rope` takes it."""
        return self.cos_cached[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               weight: torch.Tensor | None = None, norm_eps: float | None = None) -> torch.Tensor:  # fmt: skip
    """Rotate ``x [num_tokens, num_heads, head_dim]`` (halves layout), times ``weight
    [num_heads, head_dim]`` first when given, after an unweighted rms_norm over ``head_dim``
    (eps ``norm_eps``) first when given: transformers' ``x * cos + rotate_half(x) * sin``
    with ``rotate_half(x) = cat(-x2, x1)``, the sign folded into ``sin`` (``sin_signed =
    cat(-sin1, sin2)``, exact: ``-a * b == a * -b``), so four ops instead of seven. CPU
    float32: one compiled pass with the same float32 operations (:mod:`kvcanary.ops.cpu.rope`)."""
    cpu = rope_cpu.applies(x, cos)
    if norm_eps is not None and not (cpu and norm_cpu.applies(x)):  # the norm apart
        x, norm_eps = F.rms_norm(x, (x.shape[-1],), None, norm_eps), None
    if cpu:
        return rope_cpu.rope(x, cos, sin, weight, norm_eps)
    if weight is not None:
        x = x * weight
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
