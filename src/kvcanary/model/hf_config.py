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
DeepseekV4ForCausalLM   every layer slides (window ``sliding_window``, default 128);
                        ``layer_types`` (or legacy ``compress_ratios``) give each
                        layer's compressed branch, default 2 HCA then CSA/HCA
                        alternating (see :func:`parse_dsv4_config`)
======================  ==========================================================
"""

from __future__ import annotations

from typing import Any

from kvcanary.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DSV4Params,
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
    "DeepseekV4ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "deepseek_v4": "DeepseekV4ForCausalLM",
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
    if arch == "DeepseekV4ForCausalLM":
        return parse_dsv4_config(raw, generation)
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


# transformers' DeepseekV4Config defaults for the keys we read.
_DSV4_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
    num_experts_per_tok=6, n_routed_experts=256, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
    compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
    index_head_dim=128, index_topk=512, hidden_act="silu", rms_norm_eps=1e-6, bos_token_id=0,
    eos_token_id=1, tie_word_embeddings=False,
)  # fmt: skip
_DSV4_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4,
               "heavily_compressed_attention": 128}  # fmt: skip


def parse_dsv4_config(raw: dict[str, Any], generation: dict[str, Any] | None) -> ModelConfig:
    """``DeepseekV4ForCausalLM``'s ``config.json`` the way ``DeepseekV4Config`` reads it
    (its defaults, its legacy keys ``compress_ratios`` / ``num_hash_layers`` /
    ``qk_rope_head_dim``). Supported: compress rates 4 and 128, RoPE ``default`` (and
    ``yarn`` on compressed layers), no attention/MLP bias, silu, no tied embeddings."""
    cfg = {**_DSV4_DEFAULTS, **raw}
    n = int(cfg["num_hidden_layers"])
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates.update(cfg.get("compress_rates") or {})
    for key, legacy in (("compressed_sparse_attention", "compress_rate_csa"),
                        ("heavily_compressed_attention", "compress_rate_hca")):  # fmt: skip
        if cfg.get(legacy) is not None:
            rates[key] = cfg[legacy]
    if (rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]) != (4, 128):
        raise ModelLoadError(f"unsupported DeepSeek-V4 compress_rates {rates}; supported: 4 and 128")
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratios = [int(r) for r in cfg["compress_ratios"]]
    else:
        if types is None:
            types = ["heavily_compressed_attention"] * min(n, 2) + [
                "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                for i in range(max(n - 2, 0))
            ]
        bad = sorted(set(types) - set(_DSV4_RATIO))
        if bad:
            raise ModelLoadError(f"unsupported DeepSeek-V4 layer type(s) {bad}; supported: {list(_DSV4_RATIO)}")
        ratios = [_DSV4_RATIO[t] for t in types]
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        n_hash = cfg.get("num_hash_layers", 3)
        mlp = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    head_dim = int(cfg["head_dim"])
    legacy_rope_dim = cfg.get("qk_rope_head_dim")
    prf = cfg.get("partial_rotary_factor")
    if prf is None:
        prf = int(legacy_rope_dim) / head_dim if legacy_rope_dim is not None else 64 / 512
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if cfg.get(key):
            raise ModelLoadError(f"unsupported: DeepSeek-V4 {key}=true")
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise ModelLoadError(f"unsupported DeepSeek-V4 hidden_act {cfg['hidden_act']!r}; supported: silu")
    rope = cfg.get("rope_parameters") or {}
    main: dict[str, Any] = rope["main"] if isinstance(rope.get("main"), dict) else {}
    compress: dict[str, Any]
    if isinstance(rope.get("compress"), dict):
        compress = rope["compress"]
    else:  # flat (yarn) parameters apply to the compressed layers
        compress = {k: v for k, v in rope.items() if k not in ("main", "compress")}
        compress.setdefault("rope_type", "default")
        compress["rope_theta"] = cfg["compress_rope_theta"]
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    if main.get("rope_type", "default") != "default":
        raise ModelLoadError("unsupported: DeepSeek-V4 main rope type other than 'default'")
    max_pos = int(cfg["max_position_embeddings"])
    compress_theta, compress_scaling = parse_rope_parameters(
        {**compress, "partial_rotary_factor": 1.0}, max_pos, None
    )
    if compress_scaling is not None and compress_scaling.rope_type != "yarn":
        raise ModelLoadError(
            f"unsupported DeepSeek-V4 compress rope type {compress_scaling.rope_type!r}; "
            "supported: default, yarn"
        )
    eos = _as_ids(cfg.get("eos_token_id")) + _as_ids((generation or {}).get("eos_token_id"))
    dsv4 = DSV4Params(
        compress_ratios=tuple(ratios), hash_moe=tuple(t == "hash_moe" for t in mlp),
        q_lora_rank=int(cfg["q_lora_rank"]), o_groups=int(cfg["o_groups"]),
        o_lora_rank=int(cfg["o_lora_rank"]), rope_head_dim=int(head_dim * prf),
        compress_rope_theta=compress_theta, compress_rope_scaling=compress_scaling,
        index_n_heads=int(cfg["index_n_heads"]), index_head_dim=int(cfg["index_head_dim"]),
        index_topk=int(cfg["index_topk"]), n_routed_experts=int(cfg["n_routed_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]), scoring_func=cfg["scoring_func"],
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
        swiglu_limit=float(cfg["swiglu_limit"]), hc_mult=int(cfg["hc_mult"]),
        hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]), hc_eps=float(cfg["hc_eps"]),
    )  # fmt: skip
    return ModelConfig(
        architecture="DeepseekV4ForCausalLM", vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["moe_intermediate_size"]),
        num_hidden_layers=n, num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg["num_key_value_heads"]), head_dim=head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(main.get("rope_theta", cfg["rope_theta"])), rope_scaling=None,
        max_position_embeddings=max_pos, tie_word_embeddings=False,
        layer_types=(SLIDING_ATTENTION,) * n, sliding_window=int(cfg["sliding_window"]),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos)),
        pad_token_id=cfg.get("pad_token_id"), dsv4=dsv4,
    )  # fmt: skip


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
