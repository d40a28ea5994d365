"""Hugging Face ``config.json`` -> :class:`ModelConfig`, matching transformers 5.x exactly.

Each supported architecture reads the keys its transformers config class reads, with
that class's defaults for absent keys, and derives ``layer_types`` the way its modeling
code does:

======================  ==========================================================
LlamaForCausalLM        all full (Llama has no sliding window)
MistralForCausalLM      all sliding when ``sliding_window`` is set, else all full
                        (the global window applies to every layer; ``layer_types``
                        is ignored, as in ``MistralModel``)
Qwen2/Qwen3ForCausalLM  window = ``sliding_window`` if ``use_sliding_window`` else None;
                        ``layer_types`` when present, else layer i slides iff the
                        window is set and ``i >= max_window_layers``
Gemma3ForCausalLM       ``layer_types`` when present, else layer i slides iff
                        ``(i + 1) % sliding_window_pattern != 0`` (pattern 6)
======================  ==========================================================
"""

from __future__ import annotations

from typing import Any

from kvcanary.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    ModelLoadError,
    RopeScaling,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")

# transformers' class defaults for the keys we read (size keys are required instead).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "MistralForCausalLM": dict(
        num_key_value_heads=8,
        max_position_embeddings=131072,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=4096,
    ),
    "Qwen2ForCausalLM": dict(
        num_key_value_heads=32,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
    ),
    "Qwen3ForCausalLM": dict(
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
    ),
    "Gemma3ForCausalLM": dict(
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=True,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
    ),
}
_READS_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def resolve_architecture(raw: dict[str, Any]) -> str:
    """The supported architecture ``raw`` declares, or :class:`ModelLoadError` listing them."""
    declared = list(raw.get("architectures") or [])
    if not declared and raw.get("model_type") in _ARCH_BY_MODEL_TYPE:
        declared = [_ARCH_BY_MODEL_TYPE[raw["model_type"]]]
    for arch in declared:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = declared or f"model_type={raw.get('model_type')!r}"
    raise ModelLoadError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def parse_hf_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed ``config.json`` (+ ``generation_config.json``).

    EOS ids are the union of both files' ``eos_token_id`` (config.json first, order kept).
    """
    arch = resolve_architecture(raw)
    cfg = {**_DEFAULTS[arch], **raw}
    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise ModelLoadError(f"config.json lacks required key(s) {missing} for {arch}")
    num_layers = int(cfg["num_hidden_layers"])
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    is_gemma = arch == "Gemma3ForCausalLM"

    act = cfg.get("hidden_activation" if is_gemma else "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported hidden_act {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if is_gemma:
        if cfg.get("attn_logit_softcapping") is not None:
            raise ModelLoadError("unsupported: Gemma3 attn_logit_softcapping (must be null)")
        if cfg.get("use_bidirectional_attention"):
            raise ModelLoadError("unsupported: Gemma3 use_bidirectional_attention=true")

    window, layer_types = _layer_types(arch, cfg, num_layers)
    # Qwen2 hard-codes q/k/v bias and Mistral no bias; the others read attention_bias.
    attention_bias = arch in _READS_ATTENTION_BIAS and bool(cfg.get("attention_bias", False))
    rope_theta, rope_scaling, local_theta = _rope(arch, cfg)
    eos = _as_ids(cfg.get("eos_token_id")) + _as_ids((generation or {}).get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_types=layer_types,
        sliding_window=window,
        hidden_act=act,
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        norm_weight_offset=1.0 if is_gemma else 0.0,
        sandwich_norm=is_gemma,
        embed_scale=hidden**0.5 if is_gemma else 1.0,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if is_gemma else None,
        local_rope_theta=local_theta,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if is_gemma else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        pad_token_id=cfg.get("pad_token_id"),
    )


def _layer_types(
    arch: str, cfg: dict[str, Any], num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)``; the window is ``None`` when no layer slides."""
    window: int | None = cfg.get("sliding_window")
    explicit = cfg.get("layer_types")
    if arch == "LlamaForCausalLM":
        types = [FULL_ATTENTION] * num_layers
    elif arch == "MistralForCausalLM":
        types = [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * num_layers
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = window if cfg.get("use_sliding_window") else None
        first_sliding = int(cfg.get("max_window_layers", 28))
        types = (
            list(explicit)
            if explicit is not None
            else [
                SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
                for i in range(num_layers)
            ]
        )
    else:  # Gemma3
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = (
            list(explicit)
            if explicit is not None
            else [
                SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                for i in range(num_layers)
            ]
        )
    if SLIDING_ATTENTION in types and window is None:
        raise ModelLoadError(
            f"{arch}: layer_types has sliding layers but the sliding window is null "
            "(Qwen2/Qwen3 need use_sliding_window=true and sliding_window set)"
        )
    return (window if SLIDING_ATTENTION in types else None), tuple(types)


def _rope(arch: str, cfg: dict[str, Any]) -> tuple[float, RopeScaling | None, float | None]:
    """``(rope_theta, rope_scaling, local_rope_theta)`` as transformers standardizes them."""
    max_pos = int(cfg["max_position_embeddings"])
    if arch != "Gemma3ForCausalLM":
        params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10_000.0))
        theta, scaling = parse_rope_parameters(
            params, max_pos, cfg.get("original_max_position_embeddings")
        )
        return theta, scaling, None
    nested = cfg.get("rope_parameters") or {}
    full = dict(nested.get(FULL_ATTENTION) or {"rope_type": "default"})
    full.update(cfg.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local = dict(nested.get(SLIDING_ATTENTION) or {"rope_type": "default"})
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    theta, scaling = parse_rope_parameters(
        full, max_pos, cfg.get("original_max_position_embeddings")
    )
    local_theta, local_scaling = parse_rope_parameters(local, max_pos, None)
    if local_scaling is not None:
        raise ModelLoadError(
            f"unsupported rope type {local_scaling.rope_type!r} on Gemma3 sliding layers; "
            "supported there: default"
        )
    return theta, scaling, local_theta


def parse_rope_parameters(
    params: dict[str, Any], max_position_embeddings: int, top_level_original_max: int | None
) -> tuple[float, RopeScaling | None]:
    """One flat ``rope_parameters`` dict -> ``(theta, scaling or None for default)``."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("unsupported: partial_rotary_factor != 1.0 (partial RoPE)")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return theta, None
    original = (
        top_level_original_max
        or params.get("original_max_position_embeddings")
        or max_position_embeddings
    )
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_position_embeddings / original
    if factor is None:
        raise ModelLoadError(f"rope type {rope_type!r} needs 'factor' in rope_parameters")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if params.get(key) is None:
                raise ModelLoadError(f"rope type 'llama3' needs {key!r} in rope_parameters")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=int(original) if rope_type != "linear" else None,
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
        attention_factor=params.get("attention_factor"),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
