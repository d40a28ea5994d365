"""config.json parsing: layer_types per convention (checked against transformers' own
config classes), RoPE parsing, ModelConfig invariants and the error messages."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from kvcanary.model import ModelConfig, ModelLoadError, RopeScaling, load_model_config
from kvcanary.model.hf_config import parse_hf_config

S, F = "sliding_attention", "full_attention"
_SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def _raw(arch: str, num_layers: int = 4, **extra: Any) -> dict[str, Any]:
    return {"architectures": [arch], **_SIZES, "num_hidden_layers": num_layers, **extra}


# (architecture, extra config keys, expected layer_types, expected window)
LAYER_TYPE_TABLE = [
    ("LlamaForCausalLM", {}, (F,) * 4, None),
    # Llama has no sliding attention whatever the keys say
    ("LlamaForCausalLM", {"sliding_window": 4, "layer_types": [S] * 4}, (F,) * 4, None),
    ("MistralForCausalLM", {"sliding_window": 4}, (S,) * 4, 4),
    ("MistralForCausalLM", {"sliding_window": None}, (F,) * 4, None),
    ("MistralForCausalLM", {}, (S,) * 4, 4096),  # transformers' default window
    # Mistral's modeling ignores layer_types: the global window applies to all layers
    ("MistralForCausalLM", {"sliding_window": 4, "layer_types": [F, S, F, S]}, (S,) * 4, 4),
    ("Qwen2ForCausalLM", {"sliding_window": 8}, (F,) * 4, None),  # use_sliding_window off
    (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
        (F, F, S, S),
        8,
    ),
    (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
        (S,) * 4,
        8,
    ),
    (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 28},
        (F,) * 4,
        None,
    ),
    (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "layer_types": [S, F, S, F]},
        (S, F, S, F),
        8,
    ),
    (
        "Gemma3ForCausalLM",
        {"sliding_window": 8},
        (S,) * 4,
        8,
    ),  # pattern 6: layer 5 is the first full
    ("Gemma3ForCausalLM", {"sliding_window": 8, "sliding_window_pattern": 2}, (S, F, S, F), 8),
    ("Gemma3ForCausalLM", {"sliding_window": 8, "layer_types": [F, S, S, F]}, (F, S, S, F), 8),
]
_HF_CONFIG = {
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
}


@pytest.mark.parametrize(("arch", "extra", "layer_types", "window"), LAYER_TYPE_TABLE)
def test_layer_types_per_convention(
    arch: str, extra: dict[str, Any], layer_types: tuple[str, ...], window: int | None
) -> None:
    config = parse_hf_config(_raw(arch, **extra))
    assert config.layer_types == layer_types
    assert config.sliding_window == window
    if arch in _HF_CONFIG:  # these families' modeling code reads config.layer_types
        hf = getattr(transformers, _HF_CONFIG[arch])(**_SIZES, num_hidden_layers=4, **extra)
        assert tuple(hf.layer_types) == layer_types


def test_gemma3_default_pattern_has_full_every_sixth_layer() -> None:
    config = parse_hf_config(_raw("Gemma3ForCausalLM", num_layers=12, sliding_window=16))
    assert config.full_layer_ids == (5, 11)
    assert config.swa_layer_ids == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert config.is_hybrid and config.has_sliding
    assert config.embed_scale == 32**0.5 and config.norm_weight_offset == 1.0
    assert config.attention_scaling == 256**-0.5  # query_pre_attn_scalar default
    assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 10_000.0)


def test_layer_id_helpers() -> None:
    config = parse_hf_config(
        _raw("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    )
    assert (config.full_layer_ids, config.swa_layer_ids) == ((0, 1), (2, 3))
    assert config.is_hybrid and config.has_sliding
    assert [config.window_of(i) for i in range(4)] == [None, None, 8, 8]
    full = parse_hf_config(_raw("LlamaForCausalLM"))
    assert not full.is_hybrid and not full.has_sliding and full.swa_layer_ids == ()
    mistral = parse_hf_config(_raw("MistralForCausalLM", sliding_window=4))
    assert mistral.has_sliding and not mistral.is_hybrid


def test_family_flags() -> None:
    qwen2 = parse_hf_config(_raw("Qwen2ForCausalLM"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    mistral = parse_hf_config(_raw("MistralForCausalLM", attention_bias=True))
    assert (mistral.qkv_bias, mistral.o_bias) == (False, False)  # MistralAttention ignores it
    qwen3 = parse_hf_config(_raw("Qwen3ForCausalLM", attention_bias=True))
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (True, True, True)
    llama = parse_hf_config(
        _raw("LlamaForCausalLM", mlp_bias=True, head_dim=None, eos_token_id=[7, 9])
    )
    assert (llama.mlp_bias, llama.head_dim, llama.eos_token_ids) == (True, 8, (7, 9))
    assert parse_hf_config(_raw("LlamaForCausalLM"), {"eos_token_id": [2, 5]}).eos_token_ids == (
        2,
        5,
    )


@pytest.mark.parametrize(
    ("extra", "theta", "scaling"),
    [
        ({}, 10_000.0, None),
        ({"rope_theta": 5e5}, 5e5, None),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6, None),
        (
            {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
            5e5,
            RopeScaling("linear", 2.0),
        ),
        (
            {
                "max_position_embeddings": 1024,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e4,
                    "original_max_position_embeddings": 256,
                },
            },
            1e4,
            RopeScaling("yarn", 4.0, 256),
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            10_000.0,
            RopeScaling("llama3", 8.0, 64, low_freq_factor=1.0, high_freq_factor=4.0),
        ),
    ],
)
def test_rope_parsing(extra: dict[str, Any], theta: float, scaling: RopeScaling | None) -> None:
    config = parse_hf_config(_raw("LlamaForCausalLM", **extra))
    assert (config.rope_theta, config.rope_scaling) == (theta, scaling)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "proportional"])
def test_unsupported_rope_type_is_named(rope_type: str) -> None:
    raw = _raw("LlamaForCausalLM", rope_scaling={"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(
        ModelLoadError, match=rf"rope_scaling type '{rope_type}'.*default, linear, llama3, yarn"
    ):
        parse_hf_config(raw)


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (
            _raw("GPT2LMHeadModel"),
            r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM.*Gemma3",
        ),
        (_raw("Gemma3ForConditionalGeneration"), r"unsupported architecture.*Gemma3ForCausalLM"),
        ({**_SIZES, "model_type": "phi"}, r"model_type='phi'.*Qwen3ForCausalLM"),
        (
            _raw("LlamaForCausalLM", hidden_act="gelu"),
            r"hidden_act 'gelu'.*silu, swish, gelu_pytorch_tanh",
        ),
        (
            _raw("Qwen3ForCausalLM", layer_types=[S, F, S, F]),
            r"sliding layers but the sliding window is null",
        ),
        (_raw("Gemma3ForCausalLM", attn_logit_softcapping=50.0), r"attn_logit_softcapping"),
        (
            _raw(
                "LlamaForCausalLM",
                rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
            ),
            r"partial_rotary_factor",
        ),
        (
            {"architectures": ["LlamaForCausalLM"], "vocab_size": 8},
            r"lacks required key.*hidden_size",
        ),
    ],
)
def test_config_errors_name_the_problem(raw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ModelLoadError, match=pattern):
        parse_hf_config(raw)


def test_model_config_invariants() -> None:
    base = load_model_config("builtin:tiny-swa")
    fields = {name: getattr(base, name) for name in ModelConfig.__slots__}
    with pytest.raises(ModelLoadError, match="sliding layers need a window"):
        ModelConfig(**{**fields, "sliding_window": None})
    with pytest.raises(ModelLoadError, match="layer_types has 2 entries"):
        ModelConfig(**{**fields, "layer_types": (S, F)})
    with pytest.raises(ModelLoadError, match="unsupported layer type"):
        ModelConfig(**{**fields, "layer_types": ("chunked_attention",) * 6})


def test_builtin_presets_and_bad_name() -> None:
    mha, swa = load_model_config("builtin:tiny-mha"), load_model_config("builtin:tiny-swa")
    assert mha.layer_types == (F,) * 4 and mha.sliding_window is None
    assert swa.layer_types == (S, S, F, S, S, F) and swa.sliding_window == 32
    assert swa.full_layer_ids == (2, 5) and swa.swa_layer_ids == (0, 1, 3, 4)
    swa_all = load_model_config("builtin:tiny-swa-all")  # Mistral-style: every layer slides
    assert swa_all.layer_types == (S,) * 4 and swa_all.sliding_window == 32
    assert swa_all.full_layer_ids == () and swa_all.has_sliding and not swa_all.is_hybrid
    with pytest.raises(ModelLoadError, match="builtin:tiny-mha, builtin:tiny-swa"):
        load_model_config("builtin:tiny-gqa")
