"""Build the Hugging Face transformers twin of one of our models (same weights), for the
parity tests and ``kvcanary bench engine``. Needs ``transformers`` (the ``hf`` extra)."""

from __future__ import annotations

from typing import Any

from kvcanary.model.config import ModelConfig
from kvcanary.model.decoder import HybridDecoder
from kvcanary.model.loader import hf_parameter_name


def to_hf_qwen3(model: HybridDecoder, config: ModelConfig, attn_implementation: str = "eager") -> Any:
    """A ``Qwen3ForCausalLM`` holding ``model``'s weights (our presets are Qwen3-shaped)."""
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("transformers is not installed: pip install 'kvcanary[hf]'") from e
    c = config
    hf_config = Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        layer_types=list(c.layer_types),
        use_sliding_window=c.has_sliding,
        sliding_window=c.sliding_window,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )
    hf = Qwen3ForCausalLM._from_config(hf_config, attn_implementation=attn_implementation)
    hf = hf.to(dtype=next(model.parameters()).dtype).eval()
    state = {hf_parameter_name(name): p for name, p in model.state_dict().items()}
    hf.load_state_dict(state, strict=not c.tie_word_embeddings)
    return hf
