"""Built-in models with seeded random weights: tiny ones for tests (``builtin:tiny-mha``,
``builtin:tiny-swa``, ``builtin:tiny-swa-all``) and one with a real model's shapes for
benchmarks (``builtin:qwen3-0.6b-shape``).

All are Qwen3-shaped (GQA, per-head q/k RMSNorm, untied lm_head) with a byte-level
tokenizer; the engine's default dtype (float32) builds them::

    tiny-*   hidden 128 | 4 q heads, 2 kv heads, head_dim 32 | MLP 256 | vocab 259 | 4096 positions
    tiny-mha      4 layers   F F F F
    tiny-swa      6 layers   S S F S S F   (S: sliding, window 32)
    tiny-swa-all  4 layers   S S S S       (every layer sliding, window 32: Mistral-style;
                                            the full KV sub-pool has no layer)

    qwen3-0.6b-shape  Qwen3-0.6B's shapes: hidden 1024 | 16 q heads, 8 kv heads, head_dim 128
                      | MLP 3072 | vocab 151936 | rope theta 1e6 | 4096 positions
                      28 layers  (S S S F) x 7   (3 sliding : 1 full, window 512)

``qwen3-0.6b-shape`` keeps Qwen3's vocab (151936), not the tokenizer's 259: the lm_head
matmul (151936 x 1024, a quarter of a decode token's FLOPs) and the 0.6 GB embedding cost
what they cost in the real model, so a canary's overhead is measured against a realistic
forward. Its rows past the 256 bytes are zero, so greedy decoding still emits only bytes
and the byte tokenizer decodes every output. Qwen3-0.6B has no sliding layers; the 3:1 mix
makes the benchmark exercise both KV sub-pools, as the hybrid models the canary targets do.
Its lm_head is untied like every preset's (Qwen3-0.6B ties it): the same FLOPs, 0.6 GB more
memory (0.75B parameters, 3 GB in float32; building the weights takes ~20 s on 2 cores).
Float32 because bf16 matmuls are slow on CPUs without AMX; ``--dtype`` still applies.

The weights are drawn from a CPU ``torch.Generator`` seeded with ``seed`` in parameter
order, so a seed gives identical weights on every device. They are scaled for *peaky*
next-token distributions: engine tests compare greedy tokens across numerically
different paths (chunked vs unchunked prefill, batchings), which must not flip on
near-ties, so the lm_head is large (top-1 vs top-2 logit gap is ~10 on average) and
non-byte tokens never win greedy decoding (their lm_head rows are zero).
"""

from __future__ import annotations

import torch

from kvcanary.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, ModelLoadError
from kvcanary.model.decoder import HybridDecoder
from kvcanary.model.deepseek_v4 import tiny_dsv4_config
from kvcanary.model.tokenizer import ByteTokenizer
from kvcanary.utils import show

BUILTIN_PREFIX = "builtin:"
_F, _S = FULL_ATTENTION, SLIDING_ATTENTION
# Std of each logit (any hidden size: the final RMSNorm makes the hidden state unit-RMS):
# with 256 byte candidates the top-1/top-2 gap is roughly
# LOGIT_STD / 3.3 on average, so near-ties (< 1e-3) are ~1e-4 rare.
LOGIT_STD = 32.0
# q_norm/k_norm weight: attention scores have std ~QK_NORM_GAIN**2, sharp enough that
# the output depends on which earlier tokens are attended, not just the current one.
QK_NORM_GAIN = 1.5


# Qwen3-0.6B's vocab size (its tokenizer's 151669 tokens padded for the matmul).
QWEN3_VOCAB_SIZE = 151_936
# 3 sliding : 1 full, 28 layers (Qwen3-0.6B's depth).
QWEN3_0_6B_LAYER_TYPES = (_S, _S, _S, _F) * 7
QWEN3_0_6B_WINDOW = 512


def qwen3_0_6b_shape(num_layers: int = len(QWEN3_0_6B_LAYER_TYPES)) -> ModelConfig:
    """``builtin:qwen3-0.6b-shape``'s config; ``num_layers`` < 28 keeps its first layers
    (same shapes, fewer layers: tests that need not build 0.6B weights)."""
    return _qwen3(
        QWEN3_0_6B_LAYER_TYPES[:num_layers],
        QWEN3_0_6B_WINDOW,
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=1024,
        intermediate_size=3072,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
    )


def _qwen3(
    layer_types: tuple[str, ...],
    sliding_window: int | None,
    *,
    vocab_size: int = ByteTokenizer().vocab_size,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    rope_theta: float = 10_000.0,
) -> ModelConfig:
    """A Qwen3-architecture config with the byte tokenizer's specials (defaults: tiny-*)."""
    tok = ByteTokenizer()
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        layer_types=layer_types,
        sliding_window=sliding_window,
        qk_norm=True,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
        pad_token_id=tok.pad_token_id,
    )


PRESETS: dict[str, ModelConfig] = {
    "tiny-mha": _qwen3((_F,) * 4, None),
    "tiny-swa": _qwen3((_S, _S, _F) * 2, 32),
    # 4 layers, not 6: --kv-canary-real-data-layers=all fingerprints at most 4 per half.
    "tiny-swa-all": _qwen3((_S,) * 4, 32),
    "tiny-dsv4": tiny_dsv4_config(),  # DeepSeek-V4 (kvcanary.model.deepseek_v4)
    "qwen3-0.6b-shape": qwen3_0_6b_shape(),
}


def preset_config(model: str) -> ModelConfig:
    """``"builtin:<name>"`` -> its config; unknown names raise listing the presets."""
    name = model.removeprefix(BUILTIN_PREFIX)
    if name not in PRESETS:
        choices = ", ".join(BUILTIN_PREFIX + n for n in PRESETS)
        raise ModelLoadError(f"unknown builtin model {show(model)}; available presets: {choices}")
    return PRESETS[name]


@torch.no_grad()
def init_preset_weights(model: HybridDecoder, seed: int) -> None:
    """Overwrite every parameter of ``model`` from a CPU generator seeded with ``seed``.

    Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1 (q/k norms
    ``QK_NORM_GAIN``), biases 0, lm_head ~ N(0, LOGIT_STD^2 / hidden) with the special
    tokens' rows zeroed.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            value = torch.full(param.shape, QK_NORM_GAIN)
        elif name.endswith("norm.weight"):
            value = torch.ones(param.shape)
        elif name.endswith("bias"):
            value = torch.zeros(param.shape)
        elif name == "embed_tokens.weight":
            value = torch.randn(param.shape, generator=gen)
        elif name == "lm_head.weight":
            value = torch.randn(param.shape, generator=gen) * (LOGIT_STD / hidden**0.5)
            value[ByteTokenizer.num_bytes :] = 0.0
        else:
            value = torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5
        param.copy_(value)
