"""The decoder: embeddings -> N x (attention, MLP) -> final norm -> lm_head.

Tokens of several sequences arrive packed flat (``[num_tokens]``) with their absolute
positions. Everything here is per-token except attention, which is delegated to
``forward_batch.attn_backend`` (see ``base.py``): the model never looks inside
``forward_batch`` beyond that attribute, so it is independent of how KV is stored.

Module and parameter names equal Hugging Face's with the ``model.`` prefix dropped
(``layers.3.self_attn.q_proj.weight``), which is what the loader relies on.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from kvcanary.model.base import AttentionLayerSpec
from kvcanary.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvcanary.model.layers import GatedMLP, RMSNorm, fuse_linears
from kvcanary.model.rope import RotaryEmbedding, apply_rope
from kvcanary.ops.cpu.gemm import PackedLinear

Device = torch.device | str | None
_NO_QK_NORM: tuple[None, None] = (None, None)


class Attention(nn.Module):
    """q/k/v projections (+ optional bias, optional per-head q/k RMSNorm), RoPE, backend, o_proj."""

    def __init__(
        self, config: ModelConfig, spec: AttentionLayerSpec, device: Device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.spec = spec
        hidden, head_dim = config.hidden_size, config.head_dim
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = config.qkv_bias
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias, device, dtype)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias, device, dtype)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias, device, dtype)
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_split = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, config.o_bias, device, dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            norm_args = (head_dim, config.rms_norm_eps, config.norm_weight_offset, device, dtype)
            self.q_norm, self.k_norm = RMSNorm(*norm_args), RMSNorm(*norm_args)
        self._qk_weight: tuple[tuple[Any, ...], torch.Tensor] | None = None  # _qk_norm_weight
        # _folded_qk_norm: None without q/k norms; else whether they fold into the rotation
        # in float32 (no weight offset, one eps: what _qk_norm checks, fixed at construction).
        self._qk_fold: bool | None = None
        if self.q_norm is not None and self.k_norm is not None:
            self._qk_fold = not (self.q_norm.weight_offset or self.k_norm.weight_offset) and (
                self.q_norm.eps == self.k_norm.eps
            )
        self._qkv, self._o = PackedLinear(), PackedLinear()

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: Any
    ) -> torch.Tensor:
        """``cos`` / ``sin``: :meth:`RotaryEmbedding.cos_sin`'s (``sin`` sign-folded)."""
        spec, num_tokens = self.spec, hidden.shape[0]
        qkv = self._qkv(hidden, self.qkv_weight, self.qkv_bias)
        backend = forward_batch.attn_backend
        # A backend may rotate, store and attend in one call (optional; base.AttentionBackend).
        rope_forward = getattr(backend, "rope_forward", None)
        if rope_forward is not None and (norm := self._folded_qk_norm(qkv.dtype)) is not None:
            out = rope_forward(qkv, *norm, cos, sin, spec, forward_batch)
            if out is not None:
                return self._o(out.view(num_tokens, -1), self.o_proj.weight, self.o_proj.bias)
        num_q, num_k = self.qkv_split[0], self.qkv_split[1]
        # q and k side by side (a view of the projection: the first num_q + num_k columns),
        # normed and rotated together: per element the same ops as q and k apart, so the
        # same bits, in about half the small ops (CPU decode is bound by their count).
        qk = qkv[:, : num_q + num_k].view(num_tokens, spec.num_heads + spec.num_kv_heads, spec.head_dim)
        v = qkv[:, num_q + num_k :].view(num_tokens, spec.num_kv_heads, spec.head_dim)
        weight, norm_eps = None, None
        if self.q_norm is not None and self.k_norm is not None:
            qk, weight, norm_eps = self._qk_norm(qk)
        qk = apply_rope(qk, cos, sin, weight, norm_eps)
        q, k = qk.split_with_sizes((spec.num_heads, spec.num_kv_heads), dim=1)  # (not Tensor.split's Python)
        out = backend.forward(q, k, v, spec, forward_batch)
        return self._o(out.reshape(num_tokens, -1), self.o_proj.weight, self.o_proj.bias)

    def _folded_qk_norm(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, float | None] | None:
        """``(weight, eps)`` as :meth:`_qk_norm` gives them to ``apply_rope`` when it folds the
        q/k norms into the rotation, ``(None, None)`` without q/k norms, or None when the
        norms must run apart (weight offset, two eps, not float32)."""
        if self._qk_fold is None:
            return _NO_QK_NORM
        if not self._qk_fold or dtype != torch.float32:
            return None
        return self._qk_norm_weight(dtype), cast(RMSNorm, self.q_norm).eps

    def _qk_norm(self, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
        """q_norm on the q heads and k_norm on the k heads of ``qk [tokens, q + k heads, dim]``,
        as (``qk`` normed, or still to norm; the per-head weights to multiply by, None: normed
        with them; the eps of the unweighted rms_norm ``apply_rope`` does first, or None).
        Float32 without weight offset (one eps): ``apply_rope`` norms q and k together and
        applies the weights (``rms_norm(x, w) == rms_norm(x) * w`` bit for bit; on the CPU in
        its one pass, :mod:`kvcanary.ops.cpu.rope`); else each norm on its heads here."""
        folded = self._folded_qk_norm(qk.dtype)
        if folded is not None:
            return qk, *folded
        q_norm, k_norm = cast(RMSNorm, self.q_norm), cast(RMSNorm, self.k_norm)
        num_q = self.spec.num_heads
        return torch.cat((q_norm(qk[:, :num_q]), k_norm(qk[:, num_q:])), dim=1), None, None

    def _qk_norm_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``[q heads + k heads, head_dim]``: q_norm's weight per q head, then k_norm's per k
        head; rebuilt when either weight changed (loaded, or edited in place)."""
        qw, kw = cast(RMSNorm, self.q_norm).weight, cast(RMSNorm, self.k_norm).weight
        key = (qw._version, kw._version, qw.data_ptr(), kw.data_ptr(), dtype)
        if self._qk_weight is None or self._qk_weight[0] != key:
            spec = self.spec
            weight = torch.cat((qw.expand(spec.num_heads, -1), kw.expand(spec.num_kv_heads, -1)))
            self._qk_weight = (key, weight.to(dtype))
        return self._qk_weight[1]


class DecoderLayer(nn.Module):
    """Pre-norm residual block; Gemma3 adds "sandwich" norms on each branch's output.

    Llama/Qwen/Mistral::

        h   = x + attn(input_layernorm(x))
        out = h + mlp(post_attention_layernorm(h))

    Gemma3 (``sandwich_norm``; HF reuses the name ``post_attention_layernorm``)::

        h   = x + post_attention_layernorm(attn(input_layernorm(x)))
        out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    """

    def __init__(
        self, config: ModelConfig, spec: AttentionLayerSpec, device: Device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_weight_offset
        norm_args = (config.hidden_size, eps, offset, device, dtype)
        self.self_attn = Attention(config, spec, device, dtype)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            config.mlp_bias,
            device,
            dtype,
        )
        self.input_layernorm = RMSNorm(*norm_args)
        self.post_attention_layernorm = RMSNorm(*norm_args)
        self.sandwich_norm = config.sandwich_norm
        if self.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(*norm_args)
            self.post_feedforward_layernorm = RMSNorm(*norm_args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: Any,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, mlp_out)``: this layer's output is ``h + mlp_out``, left unsummed so the
        next layer adds it in one pass with its input norm (:meth:`RMSNorm.add_forward`: the
        same bits as the add and the norm apart, one CPU call fewer a layer). ``residual``:
        the previous layer's ``mlp_out`` (None: ``x`` is the whole input)."""
        if residual is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_forward(x, residual)
        attn_out = self.self_attn(normed, cos, sin, forward_batch)
        if self.sandwich_norm:
            x = x + self.post_attention_layernorm(attn_out)
            return x, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x, normed = self.post_attention_layernorm.add_forward(x, attn_out)
        return x, self.mlp(normed)


class HybridDecoder(nn.Module):
    """A decoder whose layers are full or sliding-window attention per ``config.layer_types``.

    The engine reads ``config`` and ``attention_specs`` (one per layer; sliding layers
    carry their window) and calls :meth:`forward` then :meth:`compute_logits`.
    Inference only (``requires_grad`` is off). Parameters are allocated on ``device`` in
    ``dtype`` but hold no meaningful values until the loader or a preset fills them; the
    RoPE tables are ready on construction.
    """

    def __init__(
        self, config: ModelConfig, device: Device = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )
        self.attention_specs: list[AttentionLayerSpec] = [
            config.attention_spec(i) for i in range(config.num_hidden_layers)
        ]
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, device, dtype) for spec in self.attention_specs
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, config.norm_weight_offset, device, dtype
        )
        self.lm_head: nn.Linear | None = None  # None: tied to embed_tokens
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, False, device, dtype)
        # A tensor in the model dtype, as transformers rounds it (bf16: sqrt(3072) -> 55.5).
        self.embed_scale: torch.Tensor | None
        scale = (
            torch.tensor(config.embed_scale, device=device).to(dtype)
            if config.embed_scale != 1.0
            else None
        )
        self.register_buffer("embed_scale", scale, persistent=False)
        rope_len = config.max_position_embeddings
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, rope_len, device, dtype
        )
        self.local_rotary: RotaryEmbedding | None = None
        if config.local_rope_theta is not None and config.has_sliding:
            self.local_rotary = RotaryEmbedding(
                config.head_dim, config.local_rope_theta, None, rope_len, device, dtype
            )
        self._lm_head = PackedLinear()
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any
    ) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden_size]``.

        The result is after the final norm; pass the rows to sample from to
        :meth:`compute_logits`. Positions must be ``< config.max_position_embeddings``.
        """
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        full_rope = self.rotary.cos_sin(positions)
        rope = {FULL_ATTENTION: full_rope, SLIDING_ATTENTION: full_rope}
        if self.local_rotary is not None:
            rope[SLIDING_ATTENTION] = self.local_rotary.cos_sin(positions)
        residual = None  # the last layer's MLP output, still to add (DecoderLayer.forward)
        for layer, layer_type in zip(self.layers, self.config.layer_types, strict=True):
            hidden, residual = layer(hidden, *rope[layer_type], forward_batch, residual)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_forward(hidden, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> float32 logits ``[n, vocab_size]`` (softcapped if configured)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self._lm_head(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
