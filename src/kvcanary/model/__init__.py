"""The model package: config, decoder, loader, tokenizers and presets.

Public entry points::

    from kvcanary.model import load_model, load_model_config
    model, tokenizer, config = load_model("builtin:tiny-swa", device="cpu")
    hidden = model(input_ids, positions, forward_batch)   # forward_batch.attn_backend does attention
    logits = model.compute_logits(hidden[last_rows])      # float32
"""

from __future__ import annotations

from kvcanary.model.base import AttentionBackend, AttentionLayerSpec
from kvcanary.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    ModelLoadError,
    RopeScaling,
)
from kvcanary.model.decoder import HybridDecoder
from kvcanary.model.hf_config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES
from kvcanary.model.loader import load_model, load_model_config
from kvcanary.model.presets import PRESETS
from kvcanary.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IdsOnlyTokenizer,
    Tokenizer,
    TokenizerUnavailableError,
)

__all__ = [
    "FULL_ATTENTION",
    "PRESETS",
    "SLIDING_ATTENTION",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "AttentionBackend",
    "AttentionLayerSpec",
    "ByteTokenizer",
    "HFTokenizer",
    "HybridDecoder",
    "IdsOnlyTokenizer",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "TokenizerUnavailableError",
    "load_model",
    "load_model_config",
]
