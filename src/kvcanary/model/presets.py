"""Built-in tiny models with seeded random weights (``builtin:tiny-mha``, ``builtin:tiny-swa``,
``builtin:tiny-swa-all``).

All are Qwen3-shaped (GQA, per-head q/k RMSNorm, untied lm_head), byte-level vocab,
float32::

    hidden 128 | 4 q heads, 2 kv heads, head_dim 32 | MLP 256 | vocab 259 | 4096 positions
    tiny-mha      4 layers   F F F F
    tiny-swa      6 layers   S S F S S F   (S: sliding, window 32)
    tiny-swa-all  4 layers   S S S S       (every layer sliding, window 32: Mistral-style;
                                            the full KV sub-pool has no layer)

The weights are drawn from a CPU ``torch.Generator`` seeded with ``seed`` in parameter
order, so a seed gives identical weights on every device. They are scaled for *peaky*
next-token distributions: engine tests compare greedy tokens across numerically
different paths (chunked vs unchunked prefill, batchings), which must not flip on
near-ties, so the lm_head is large (top-1 vs top-2 logit gap is ~10 on average) and
special tokens never win greedy decoding (their lm_head rows are zero).
"""

from __future__ import annotations

import torch

from kvcanary.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, ModelLoadError
from kvcanary.model.decoder import HybridDecoder
from kvcanary.model.tokenizer import ByteTokenizer
from kvcanary.utils import show

BUILTIN_PREFIX = "builtin:"
_F, _S = FULL_ATTENTION, SLIDING_ATTENTION
# Std of each logit: with 256 byte candidates the top-1/top-2 gap is roughly
# LOGIT_STD / 3.3 on average, so near-ties (< 1e-3) are ~1e-4 rare.
LOGIT_STD = 32.0
# q_norm/k_norm weight: attention scores have std ~QK_NORM_GAIN**2, sharp enough that
# the output depends on which earlier tokens are attended, not just the current one.
QK_NORM_GAIN = 1.5


def _tiny(layer_types: tuple[str, ...], sliding_window: int | None) -> ModelConfig:
    tok = ByteTokenizer()
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=tok.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
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
    "tiny-mha": _tiny((_F,) * 4, None),
    "tiny-swa": _tiny((_S, _S, _F) * 2, 32),
    # 4 layers, not 6: --kv-canary-real-data-layers=all fingerprints at most 4 per half.
    "tiny-swa-all": _tiny((_S,) * 4, 32),
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
