"""DeepSeek-V4's per-token building blocks (no KV cache involved): its RMSNorms, the
interleaved partial RoPE, the grouped output projection, manifold-constrained
hyper-connections (mHC) and the hash-routed / top-k routed MoE.

Numerics follow transformers' ``modeling_deepseek_v4`` (float32 norms, float32 mHC, the
same op order), so float32 results agree with it to rounding. Parameter names are the
Hugging Face ones (the loader relies on them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from kvcanary.model.config import RopeScaling
from kvcanary.model.rope import rope_inv_freq

Device = torch.device | str | None


class DSV4RMSNorm(nn.Module):
    """``weight * x / rms(x)``, all in float32, cast once at the end (float32 weight)."""

    def __init__(self, dim: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class InterleavedRope(nn.Module):
    """V4's interleaved RoPE on the trailing ``rope_dim`` channels of each head: one angle
    per channel pair. cos/sin are computed per call as transformers does (a table for a
    1M-token context would cost hundreds of MB)."""

    def __init__(
        self, rope_dim: int, theta: float, scaling: RopeScaling | None, device: Device = None
    ) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(rope_dim, theta, scaling)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, rope_dim]`` each, already expanded pairwise."""
        freqs = positions[:, None].float() * self.inv_freq
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``cos.shape[-1]`` channels of ``x`` (``[n, dim]`` or
    ``[n, heads, dim]``; ``cos``/``sin`` ``[n, rope_dim]``) pairwise, in float32."""
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + pairs.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class GroupedLinear(nn.Module):
    """Grouped output projection, first half (``o_a_proj``): each of ``n_groups`` slices of
    the concatenated heads projected on its own to ``out_per_group`` features."""

    def __init__(self, in_per_group: int, out_features: int, n_groups: int, device: Device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group, device=device, dtype=dtype))
        self.n_groups = n_groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, n_groups, in_per_group]`` -> ``[n, n_groups * out_per_group]``."""
        w = self.weight.view(self.n_groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)


class HyperConnection(nn.Module):
    """mHC weights for one block: ``pre`` collapses the ``hc`` residual streams into the
    block input, ``post`` expands the block output back, ``comb`` (Sinkhorn-projected to a
    doubly-stochastic matrix) mixes the streams into the residual."""

    def __init__(self, hc: int, hidden: int, iters: int, eps: float, norm_eps: float,
                 device: Device) -> None:  # fmt: skip
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        width = (2 + hc) * hc
        self.fn = nn.Parameter(torch.empty(width, hc * hidden, device=device))
        self.base = nn.Parameter(torch.empty(width, device=device))
        self.scale = nn.Parameter(torch.empty(3, device=device))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [n, hc, d]`` -> ``(post [n, hc], comb [n, hc, hc], collapsed [n, d])``."""
        hc = self.hc
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb_w = comb_w.view(-1, hc, hc)
        comb = torch.softmax(comb_w * comb_s + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """The final collapse of the ``hc`` streams (before the model's last norm)."""

    def __init__(self, hc: int, hidden: int, eps: float, norm_eps: float, device: Device) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * hidden, device=device))
        self.hc_base = nn.Parameter(torch.empty(hc, device=device))
        self.hc_scale = nn.Parameter(torch.empty(1, device=device))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float, device: Device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, False, device, dtype)
        self.up_proj = nn.Linear(hidden, inter, False, device, dtype)
        self.down_proj = nn.Linear(inter, hidden, False, device, dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Experts(nn.Module):
    """Routed experts as 3-D weights (``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``)."""

    def __init__(self, num: int, hidden: int, inter: int, limit: float, device: Device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter, device=device, dtype=dtype))
        self.limit = limit

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [n, d]``, ``indices``/``weights [n, k]`` (an expert picked twice counts twice)."""
        # One row per (token, pick), filled by unique-index assignment and summed over the
        # picks: index_add_ into [n, d] was ~50 ms a call on CPU.
        picks = torch.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype, device=x.device)
        for expert in torch.unique(indices).tolist():
            token, slot = torch.nonzero(indices == expert, as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[expert])
            picks[token, slot] = (y * weights[token, slot, None]).to(x.dtype)
        return picks.sum(dim=1)


_SCORE_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "sigmoid": torch.sigmoid,
}


class Router(nn.Module):
    """Expert choice and weights. Hash routing (``hash=True``) picks ``tid2eid[token]``;
    top-k routing picks the best ``scores + e_score_correction_bias``. Either way the
    weights are the picked scores, normalised, times ``routed_scaling_factor``."""

    tid2eid: torch.Tensor | None  # checkpoint buffers; the other one is None
    e_score_correction_bias: torch.Tensor | None

    def __init__(self, num: int, top_k: int, hidden: int, vocab: int, hash: bool,
                 scoring_func: str, scaling: float, device: Device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.top_k, self.hash, self.scaling = top_k, hash, scaling
        self.score_fn = _SCORE_FNS[scoring_func]
        self.weight = nn.Parameter(torch.empty(num, hidden, device=device, dtype=dtype))
        table = torch.zeros(vocab, top_k, dtype=torch.long, device=device)
        self.register_buffer("tid2eid", table if hash else None)
        self.register_buffer("e_score_correction_bias", None if hash else torch.zeros(num, device=device))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score_fn(F.linear(x, self.weight))
        if self.tid2eid is not None:
            indices = self.tid2eid[input_ids].long()
        else:
            assert self.e_score_correction_bias is not None  # registered when not hash
            biased = scores + self.e_score_correction_bias
            indices = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, weights * self.scaling


class MoE(nn.Module):
    """Routed experts plus one always-on shared expert."""

    def __init__(self, gate: Router, experts: Experts, shared: SharedExpert) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        indices, weights = self.gate(x, input_ids)
        return self.experts(x, indices, weights) + self.shared_experts(x)
