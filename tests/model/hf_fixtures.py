"""Tiny random Hugging Face checkpoints for parity tests (needs transformers; no network).

``make_tiny_hf_checkpoint(tmp_path, family, **overrides) -> Path`` writes a float32
checkpoint directory (``config.json``, ``generation_config.json``, safetensors) built by
transformers itself and returns it. Stable contract (engine tests reuse it):

==============  ====================================================================
family          attention layout (4 layers, hidden 64, 4 q / 2 kv heads, head_dim 16)
==============  ====================================================================
qwen3_hybrid    Qwen3, explicit ``layer_types`` S F S F, window 8, untied lm_head
llama           Llama, all full, tied embeddings
qwen2           Qwen2 (q/k/v bias), ``use_sliding_window`` + ``max_window_layers=2``:
                layers 0-1 full, 2-3 sliding, window 8
mistral         Mistral, every layer sliding, window 6
gemma3          Gemma3ForCausalLM, ``layer_types`` S S F S, window 8, sandwich norms,
                (1 + w) RMSNorm, embed scaling, query_pre_attn_scalar 24, local RoPE base
==============  ====================================================================

``overrides`` are config kwargs applied on top (e.g. ``sliding_window=16``,
``num_hidden_layers=6`` -- then also pass ``layer_types`` for qwen3_hybrid/gemma3).
Keyword-only: ``seed`` (weights), ``max_shard_size`` (e.g. ``"40KB"`` to write a sharded
checkpoint with ``model.safetensors.index.json``).

Weights are re-drawn from a seeded generator so that every parameter matters (norm
weights and biases are random, not 1/0) and greedy output depends on the context: over
12-token continuations of random 40-token prompts, each family emits 7-12 distinct
tokens, and the top-1/top-2 logit gap has a median of ~2 (logits span about +-35).
Positions up to ``max_position_embeddings = 512``. Vocab is 320: ``bos = 318``,
``eos = 319``; the eos rows of the embedding and lm_head are scaled by 1e-3, so greedy
decoding practically never emits eos.

Load the transformers reference with ``attn_implementation="eager"`` (bit-exact with our
decoder in float32); ``"sdpa"`` also applies the window but differs by up to ~1e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 320
BOS_ID, EOS_ID = VOCAB_SIZE - 2, VOCAB_SIZE - 1
S, F = "sliding_attention", "full_attention"
# Init gains that make greedy output depend on context, not just on the current token:
# sharper attention (q/k projections or q/k norms), branch outputs that outweigh the token
# embedding (o/down), Gemma3's post-branch norms at ~8x (its embeddings are scaled by 8).
QK_GAIN, BRANCH_GAIN, GEMMA_POST_NORM_GAIN = 2.0, 3.0, 8.0

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=None,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_hybrid": (
        "Qwen3",
        dict(
            layer_types=[S, F, S, F],
            use_sliding_window=True,
            sliding_window=8,
            tie_word_embeddings=False,
        ),
    ),
    "llama": ("Llama", dict(tie_word_embeddings=True)),
    "qwen2": (
        "Qwen2",
        dict(
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
            tie_word_embeddings=False,
        ),
    ),
    "mistral": ("Mistral", dict(sliding_window=6, tie_word_embeddings=False)),
    "gemma3": (
        "Gemma3Text",
        dict(
            layer_types=[S, S, F, S],
            sliding_window=8,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
        ),
    ),
}
_CAUSAL_LM = {
    "Qwen3": "Qwen3ForCausalLM",
    "Llama": "LlamaForCausalLM",
    "Qwen2": "Qwen2ForCausalLM",
    "Mistral": "MistralForCausalLM",
    "Gemma3Text": "Gemma3ForCausalLM",
}


def make_hf_model(family: str, *, seed: int = 0, **overrides: Any) -> Any:
    """The transformers model (float32, eval, re-initialised) for ``family``."""
    import transformers

    prefix, family_kwargs = FAMILIES[family]
    config_cls = getattr(transformers, f"{prefix}Config")
    config = config_cls(**{**_COMMON, **family_kwargs, **overrides})
    torch.manual_seed(seed)  # transformers' own init; overwritten below
    model = getattr(transformers, _CAUSAL_LM[prefix])(config).float().eval()
    _reinit(model, seed, gemma=family == "gemma3")
    return model


def make_tiny_hf_checkpoint(
    tmp_path: Path,
    family: str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write the ``family`` checkpoint under ``tmp_path`` (a fresh subdirectory); return it."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}; allowed: {sorted(FAMILIES)}")
    model = make_hf_model(family, seed=seed, **overrides)
    out = Path(tmp_path) / family
    suffix = 0
    while out.exists():
        suffix += 1
        out = Path(tmp_path) / f"{family}-{suffix}"
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int, gemma: bool) -> None:
    """Re-draw every parameter in name order from a generator seeded with ``seed``.

    The final norm's weight is N(0, 1) (signs included): with tied embeddings an
    all-positive final norm makes ``logits ~ E @ e_current`` and greedy decoding just
    repeats the current token.
    """
    gen = torch.Generator().manual_seed(seed)
    offset = 1.0 if gemma else 0.0  # Gemma stores RMSNorm weights as deltas from 1
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen)
        if name == "model.norm.weight":
            value = noise - offset
        elif "norm" in name:
            value = _norm_gain(name, gemma) - offset + 0.2 * noise
        elif name.endswith("bias"):
            value = 0.2 * noise
        elif "embed_tokens" in name or "lm_head" in name:
            value = noise
            value[EOS_ID] *= 1e-3
        else:
            value = noise * _gain(name) / param.shape[1] ** 0.5
        param.copy_(value)


def _norm_gain(name: str, gemma: bool) -> float:
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return QK_GAIN
    return GEMMA_POST_NORM_GAIN if gemma and ".post_" in name else 1.0


def _gain(name: str) -> float:
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return QK_GAIN
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return BRANCH_GAIN
    return 1.0
