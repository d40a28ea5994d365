"""DeepSeek-V4 (transformers' ``DeepseekV4ForCausalLM``) over a paged KV memory.

Every layer attends over one shared latent KV head (K = V): a sliding window of the
per-token latents, plus, on compressed layers, entries that each summarise a window of
``ratio`` tokens::

    ratio 0    sliding window only
    ratio 4    CSA: + C4 entries (window w = tokens [4w, 4w+4) with the overlap of
               window w-1), restricted per query to the lightning indexer's top-k
    ratio 128  HCA: + every C128 entry (window w = tokens [128w, 128w+128))

A query at position t sees sliding keys ``(t - W, t]`` and compressed entries
``w < (t + 1) // ratio`` (windows it has completed), plus a per-head learned sink in the
softmax. The compressors never see a whole window at once in a paged engine: each token's
raw compressor state (its ``kv_proj`` output and ``gate_proj`` score plus the window
position bias) goes to a compress-state ring row as the token is processed, and the
forward that processes a window's last token gathers the window (for C4 also the window
before it) from the rows and this forward's fresh states, and writes the entry. Storage
and addressing are the engine's: the model talks to ``forward_batch.attn_backend``, a
:class:`DSV4Backend`, and does the math itself.

Module and parameter names equal Hugging Face's with the ``model.`` prefix dropped (the
loader relies on it); ``tid2eid`` (hash routing) and ``e_score_correction_bias`` are
checkpoint buffers.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from kvcanary.model.config import SLIDING_ATTENTION, DSV4Params, ModelConfig
from kvcanary.model.dsv4_layers import (
    DSV4RMSNorm,
    Experts,
    GroupedLinear,
    HyperConnection,
    HyperHead,
    InterleavedRope,
    MoE,
    Router,
    SharedExpert,
    apply_interleaved_rope,
    unweighted_rms_norm,
)
from kvcanary.model.tokenizer import ByteTokenizer

Device = torch.device | str | None
ARCHITECTURE = "DeepseekV4ForCausalLM"


class CompressWindows(NamedTuple):
    """The compression windows a forward completes (one per (request, window))."""

    states: torch.Tensor  # [num_windows, span, state_dim]: span = ratio (C128), 2*ratio (C4)
    start_positions: torch.Tensor  # int64 [num_windows]: first position of each window
    full_loc: torch.Tensor  # int64 [num_windows]: a full slot of the window (where it goes)


class DSV4Backend(Protocol):
    """What the model asks of the paged memory during one forward (the engine's
    ``DSV4AttentionBackend``). Queries are packed flat (``[num_tokens, ...]``); attention
    works on them padded per request (``[bs, max_q, ...]``)."""

    def pad(self, x: torch.Tensor) -> torch.Tensor: ...

    def unpad(self, x: torch.Tensor) -> torch.Tensor: ...

    def store_latent(self, layer_id: int, kv: torch.Tensor) -> None:
        """Store this forward's latent KV ``[num_tokens, head_dim]`` (SWA rows)."""
        ...

    def sliding_keys(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [bs, K, head_dim], visible bool [bs, max_q, K])`` of the window."""
        ...

    def compress_windows(
        self, layer_id: int, indexer: bool, states: torch.Tensor
    ) -> CompressWindows:
        """Write this forward's per-token states ``[num_tokens, state_dim]`` to the layer's
        ring (the indexer's with ``indexer``) and return the windows they complete."""
        ...

    def store_compressed(
        self, layer_id: int, indexer: bool, windows: CompressWindows, entries: torch.Tensor
    ) -> None: ...

    def compressed_keys(self, layer_id: int, indexer: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(entries [bs, T, dim], visible bool [bs, max_q, T])`` of each request."""
        ...


class _Step(NamedTuple):
    """Per-forward inputs every layer shares."""

    positions: torch.Tensor
    input_ids: torch.Tensor
    rope_main: tuple[torch.Tensor, torch.Tensor]
    rope_compress: tuple[torch.Tensor, torch.Tensor]
    compress_rope: InterleavedRope  # for window positions, known only per layer


class WindowCompressor(nn.Module):
    """Turns a window of per-token states into one entry: the score-softmax-weighted sum of
    the tokens' kv, RMS-normed, RoPE'd at the window's first position. With ``overlap``
    (C4) each token carries two series: Ca for the next window, Cb for its own."""

    def __init__(self, ratio: int, dim: int, hidden: int, eps: float, device: Device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.ratio, self.dim = ratio, dim
        self.overlap = ratio == 4
        width = (1 + self.overlap) * dim
        self.kv_proj = nn.Linear(hidden, width, False, device, dtype)
        self.gate_proj = nn.Linear(hidden, width, False, device, dtype)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, device=device))
        self.kv_norm = DSV4RMSNorm(dim, eps, device)

    def states(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[n, 2 * width]``: kv, then score (gate + the position-in-window bias)."""
        score = self.gate_proj(x) + self.position_bias[positions % self.ratio]
        return torch.cat([self.kv_proj(x).float(), score.float()], dim=-1)

    def compress(self, windows: CompressWindows, rope: InterleavedRope) -> torch.Tensor:
        st, d, r = windows.states, self.dim, self.ratio
        if self.overlap:  # slots [0, r): previous window's Ca, [r, 2r): this window's Cb
            kv = torch.cat([st[:, :r, :d], st[:, r:, d : 2 * d]], dim=1)
            score = torch.cat([st[:, :r, 2 * d : 3 * d], st[:, r:, 3 * d :]], dim=1)
        else:
            kv, score = st[..., :d], st[..., d:]
        entry = self.kv_norm((kv * score.softmax(dim=1, dtype=torch.float32)).sum(dim=1))
        return apply_interleaved_rope(entry, *rope.cos_sin(windows.start_positions))

    def run(self, layer_id: int, indexer: bool, x: torch.Tensor, step: _Step,
            be: DSV4Backend) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Ring writes, entries of the windows this forward completes, and every entry the
        batch's requests can see: ``(entries [bs, T, dim], visible [bs, max_q, T])``."""
        windows = be.compress_windows(layer_id, indexer, self.states(x, step.positions))
        if windows.states.shape[0]:
            be.store_compressed(layer_id, indexer, windows, self.compress(windows, step.compress_rope))
        return be.compressed_keys(layer_id, indexer)


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, False, device, dtype)


class Indexer(WindowCompressor):
    """The lightning indexer: its own C4 compressor (keys at ``index_head_dim``), queries
    from the attention's ``q_residual``; score ``sum_h w_h * relu(q_h . k)``; keeps the
    ``index_topk`` best visible entries per query."""

    def __init__(self, d: DSV4Params, hidden: int, eps: float, device: Device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__(4, d.index_head_dim, hidden, eps, device, dtype)
        self.num_heads, self.topk = d.index_n_heads, d.index_topk
        self.q_b_proj = nn.Linear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, False,
                                  device, dtype)  # fmt: skip
        self.scorer = IndexerScorer(hidden, d.index_n_heads, device, dtype)

    def select(self, layer_id: int, x: torch.Tensor, q_res: torch.Tensor, step: _Step,
               be: DSV4Backend) -> torch.Tensor:  # fmt: skip
        """bool ``[bs, max_q, T]``: the entries each query keeps."""
        keys, visible = self.run(layer_id, True, x, step, be)
        num_entries = keys.shape[1]
        if num_entries == 0:
            return visible
        q = self.q_b_proj(q_res).view(x.shape[0], self.num_heads, self.dim)
        q = apply_interleaved_rope(q, *step.rope_compress)
        weights = self.scorer.weights_proj(x).float() * self.num_heads**-0.5
        scores = torch.einsum("bqhd,btd->bqht", be.pad(q).float(), keys.float())
        scores = F.relu(scores) * self.dim**-0.5
        scores = (scores * be.pad(weights).unsqueeze(-1)).sum(dim=2)
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.topk, num_entries), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible


class Compressor(WindowCompressor):
    def __init__(self, ratio: int, d: DSV4Params, dim: int, hidden: int, eps: float,
                 device: Device, dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__(ratio, dim, hidden, eps, device, dtype)
        self.indexer = Indexer(d, hidden, eps, device, dtype) if ratio == 4 else None


class DSV4Attention(nn.Module):
    """Shared-KV MQA with a per-head sink, partial interleaved RoPE (undone on the output's
    rope channels at the query position) and the grouped low-rank output projection."""

    def __init__(self, config: ModelConfig, layer_id: int, device: Device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        d = _dsv4(config)
        self.layer_id, self.ratio = layer_id, d.compress_ratios[layer_id]
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.o_groups, self.eps = d.o_groups, config.rms_norm_eps
        hidden, heads_dim = config.hidden_size, config.num_attention_heads * config.head_dim
        self.q_a_proj = nn.Linear(hidden, d.q_lora_rank, False, device, dtype)
        self.q_a_norm = DSV4RMSNorm(d.q_lora_rank, self.eps, device)
        self.q_b_proj = nn.Linear(d.q_lora_rank, heads_dim, False, device, dtype)
        self.kv_proj = nn.Linear(hidden, config.head_dim, False, device, dtype)
        self.kv_norm = DSV4RMSNorm(config.head_dim, self.eps, device)
        self.o_a_proj = GroupedLinear(heads_dim // d.o_groups, d.o_groups * d.o_lora_rank,
                                      d.o_groups, device, dtype)  # fmt: skip
        self.o_b_proj = nn.Linear(d.o_groups * d.o_lora_rank, hidden, False, device, dtype)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, device=device))
        self.compressor = (
            Compressor(self.ratio, d, config.head_dim, hidden, self.eps, device, dtype)
            if self.ratio else None
        )  # fmt: skip

    def forward(self, x: torch.Tensor, step: _Step, be: DSV4Backend) -> torch.Tensor:
        n, lid = x.shape[0], self.layer_id
        cos, sin = step.rope_compress if self.ratio else step.rope_main
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(n, self.num_heads, self.head_dim), self.eps)
        q = apply_interleaved_rope(q, cos, sin)
        kv = apply_interleaved_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        be.store_latent(lid, kv)
        keys, visible = be.sliding_keys(lid)
        comp = self.compressor
        if comp is not None:
            entries, seen = comp.run(lid, False, x, step, be)
            if comp.indexer is not None:
                seen = comp.indexer.select(lid, x, q_res, step, be)
            keys, visible = torch.cat([keys, entries.to(keys.dtype)], 1), torch.cat([visible, seen], 2)
        out = be.unpad(self._attend(be.pad(q), keys, visible))
        out = apply_interleaved_rope(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.reshape(n, self.o_groups, -1)))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """``q [bs, max_q, H, D]``, ``keys`` (= values) ``[bs, K, D]`` -> ``[bs, max_q, H, D]``."""
        logits = torch.einsum("bqhd,bkd->bhqk", q, keys.to(q.dtype)) * self.head_dim**-0.5
        logits = logits.masked_fill(~visible[:, None], float("-inf"))
        sinks = self.sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.einsum("bhqk,bkd->bqhd", probs, keys.to(probs.dtype)).to(q.dtype)


class DSV4DecoderLayer(nn.Module):
    """Attention then MoE, each wrapped in an mHC: the ``hc`` residual streams are
    collapsed into the block input and the block output is expanded back and added to the
    Sinkhorn-mixed streams (``comb`` applied transposed, as transformers does)."""

    def __init__(self, config: ModelConfig, layer_id: int, device: Device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        d, hidden, eps = _dsv4(config), config.hidden_size, config.rms_norm_eps
        self.self_attn = DSV4Attention(config, layer_id, device, dtype)
        inter, limit = config.intermediate_size, d.swiglu_limit
        self.mlp = MoE(
            Router(d.n_routed_experts, d.num_experts_per_tok, hidden, config.vocab_size,
                   d.hash_moe[layer_id], d.scoring_func, d.routed_scaling_factor, device, dtype),
            Experts(d.n_routed_experts, hidden, inter, limit, device, dtype),
            SharedExpert(hidden, inter, limit, device, dtype),
        )  # fmt: skip
        self.input_layernorm = DSV4RMSNorm(hidden, eps, device)
        self.post_attention_layernorm = DSV4RMSNorm(hidden, eps, device)
        self.attn_hc = HyperConnection(d.hc_mult, hidden, d.hc_sinkhorn_iters, d.hc_eps, eps, device)
        self.ffn_hc = HyperConnection(d.hc_mult, hidden, d.hc_sinkhorn_iters, d.hc_eps, eps, device)

    def forward(self, h: torch.Tensor, step: _Step, be: DSV4Backend) -> torch.Tensor:
        dt = h.dtype
        post, comb, collapsed = self.attn_hc(h)
        out = self.self_attn(self.input_layernorm(collapsed), step, be)
        h = post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), h)
        post, comb, collapsed = self.ffn_hc(h)
        out = self.mlp(self.post_attention_layernorm(collapsed), step.input_ids)
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), h)


class DeepseekV4Decoder(nn.Module):
    """The model: embeddings -> ``hc`` streams -> layers -> mHC head -> norm -> lm_head.

    Same engine-facing surface as :class:`~kvcanary.model.decoder.HybridDecoder`
    (``config``, ``forward(input_ids, positions, forward_batch)``, ``compute_logits``);
    ``forward_batch.attn_backend`` must be a :class:`DSV4Backend`.
    """

    def __init__(self, config: ModelConfig, device: Device = None,
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        super().__init__()
        d = _dsv4(config)
        self.config, self.hc = config, d.hc_mult
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DSV4DecoderLayer(config, i, device, dtype) for i in range(config.num_hidden_layers)
        )
        eps = config.rms_norm_eps
        self.norm = DSV4RMSNorm(config.hidden_size, eps, device)
        self.hc_head = HyperHead(d.hc_mult, config.hidden_size, d.hc_eps, eps, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, False, device, dtype)
        self.rope_main = InterleavedRope(d.rope_head_dim, config.rope_theta, None, device)
        self.rope_compress = InterleavedRope(
            d.rope_head_dim, d.compress_rope_theta, d.compress_rope_scaling, device
        )
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        be: DSV4Backend = forward_batch.attn_backend
        step = _Step(positions, input_ids, self.rope_main.cos_sin(positions),
                     self.rope_compress.cos_sin(positions), self.rope_compress)  # fmt: skip
        emb = self.embed_tokens(input_ids)
        h = emb.unsqueeze(1).expand(-1, self.hc, -1).contiguous()
        for layer in self.layers:
            h = layer(h, step, be)
        return self.norm(self.hc_head(h))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _dsv4(config: ModelConfig) -> DSV4Params:
    if config.dsv4 is None:
        raise ValueError(f"{config.architecture}: not a DeepSeek-V4 config (config.dsv4 is None)")
    return config.dsv4


# ---------------------------------------------------------------------- preset
# Std of each logit (the final norm makes the hidden state unit-RMS), as presets.py's
# LOGIT_STD: greedy decoding must not flip on near-ties between numerically different paths.
LOGIT_STD = 32.0
# kv_norm / q_a_norm gain: attention scores with std ~KV_NORM_GAIN, so which earlier
# tokens (and which compressed entries) are attended matters.
KV_NORM_GAIN = 2.0


def tiny_dsv4_config(
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4),
    *,
    vocab_size: int = ByteTokenizer().vocab_size,
    sliding_window: int = 16,
    index_topk: int = 8,
    max_position_embeddings: int = 4096,
) -> ModelConfig:
    """``builtin:tiny-dsv4``: hidden 64, 4 heads of 32 (8 RoPE channels), one shared KV
    head, q rank 32, 2 output groups of rank 16, indexer 16 heads x 16 (top-8), MoE of 4
    experts (top-2, 32 wide) + 1 shared, mHC with 4 streams; layer 0 hash-routed."""
    tok = ByteTokenizer()
    n = len(compress_ratios)
    dsv4 = DSV4Params(
        compress_ratios=compress_ratios, hash_moe=tuple(i == 0 for i in range(n)),
        q_lora_rank=32, o_groups=2, o_lora_rank=16, rope_head_dim=8,
        compress_rope_theta=160000.0, compress_rope_scaling=None, index_n_heads=16,
        index_head_dim=16, index_topk=index_topk, n_routed_experts=4, num_experts_per_tok=2,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6,
    )  # fmt: skip
    return ModelConfig(
        architecture=ARCHITECTURE, vocab_size=vocab_size, hidden_size=64, intermediate_size=32,
        num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
        layer_types=(SLIDING_ATTENTION,) * n, sliding_window=sliding_window,
        bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids,
        pad_token_id=tok.pad_token_id, dsv4=dsv4,
    )  # fmt: skip


@torch.no_grad()
def init_dsv4_weights(
    tensors: list[tuple[str, torch.Tensor]], config: ModelConfig, seed: int, num_live_tokens: int
) -> None:
    """Overwrite DSV4 parameters and checkpoint buffers (named as Hugging Face names them,
    ``model.`` prefix dropped; a transformers model's tensors work too) from a CPU
    generator seeded with ``seed``, in list order. Scaled for peaky greedy distributions:
    lm_head rows past ``num_live_tokens`` are zero, the rest ~N(0, LOGIT_STD^2 / hidden);
    linears ~N(0, 1/fan_in); norms 1 (kv / q norms KV_NORM_GAIN); sinks, position biases,
    mHC biases ~N(0, 1); hash routing a random distinct top-k per token."""
    gen = torch.Generator().manual_seed(seed)
    d = _dsv4(config)

    def randn(shape: torch.Size, std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    for name, t in tensors:
        shape = t.shape
        if name.endswith("tid2eid"):
            value = torch.rand(shape[0], d.n_routed_experts, generator=gen).argsort(-1)[:, : shape[1]]
        elif name.endswith(("kv_norm.weight", "q_a_norm.weight")):
            value = torch.full(shape, KV_NORM_GAIN)
        elif name.endswith("norm.weight"):
            value = torch.ones(shape)
        elif name.endswith(("sinks", "position_bias", ".base", "hc_base", "e_score_correction_bias")):
            value = randn(shape)
        elif name.endswith((".scale", "hc_scale")):
            value = torch.ones(shape)
        elif name.endswith("embed_tokens.weight"):
            value = randn(shape)
        elif name.endswith("lm_head.weight"):
            value = randn(shape, LOGIT_STD / config.hidden_size**0.5)
            value[num_live_tokens:] = 0.0
        else:
            value = randn(shape, shape[-1] ** -0.5)
        t.copy_(value)


def init_preset_dsv4(model: DeepseekV4Decoder, seed: int) -> None:
    """Seeded random weights for a ``builtin:`` DSV4 preset (byte tokenizer)."""
    init_dsv4_weights(list(model.state_dict(keep_vars=True).items()), model.config, seed,
                      ByteTokenizer.num_bytes)  # fmt: skip
