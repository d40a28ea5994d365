"""The model's shape, as one frozen dataclass.

A :class:`ModelConfig` is the single source of truth the decoder, the loader and the
KV memory system read: which layers slide (``layer_types``), the window, head counts
and head_dim (the KV page geometry), and the numerics a family needs to match Hugging
Face exactly (norm offset, embedding scale, attention scaling, RoPE).

It is built either from a preset (``builtin:*``, see ``presets.py``) or from a Hugging
Face ``config.json`` (see ``hf_config.py``); nothing else constructs one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.model.base import AttentionLayerSpec

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


class ModelLoadError(ValueError):
    """A model could not be configured or loaded.

    The message names what is missing (a file, a tensor) or unsupported (an
    architecture, a rope type, an activation) and lists what is supported.
    """


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Parsed non-default RoPE scaling; field meanings follow Hugging Face ``rope_parameters``.

    ``rope_type`` is one of ``linear``, ``llama3``, ``yarn`` (``default`` is ``None`` on the
    config instead of a ``RopeScaling``). Fields a type does not use keep their defaults.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama/Qwen/Mistral/Gemma3-style decoder.

    Invariants (checked in ``__post_init__``):
      * ``len(layer_types) == num_hidden_layers``; each entry is in ``LAYER_TYPES``.
      * ``sliding_window`` is set iff at least one layer is ``sliding_attention``.
      * ``num_attention_heads`` is a multiple of ``num_key_value_heads`` (GQA groups).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    hidden_act: str = "silu"
    qk_norm: bool = False  # Qwen3/Gemma3: per-head RMSNorm on q and k before RoPE
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama/Qwen3 attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama/Qwen3/Gemma3 attention_bias, not Qwen2)
    mlp_bias: bool = False  # Llama mlp_bias
    # Gemma3 numerics; the defaults are the Llama/Qwen behaviour.
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + weight)
    sandwich_norm: bool = False  # extra norms after attention and after the MLP
    embed_scale: float = 1.0  # embeddings are multiplied by this
    query_pre_attn_scalar: float | None = None  # attention scaling is this**-0.5 when set
    local_rope_theta: float | None = None  # sliding layers use default RoPE with this base
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelLoadError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ModelLoadError(f"unsupported layer type(s) {bad}; supported: {list(LAYER_TYPES)}")
        if self.has_sliding != (self.sliding_window is not None):
            raise ModelLoadError(
                f"sliding_window={self.sliding_window} does not match layer_types "
                f"(sliding layers: {list(self.swa_layer_ids)}); sliding layers need a window "
                "and a window needs sliding layers"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ModelLoadError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        """Global ids of sliding-window layers, ascending."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """Global ids of full-attention layers, ascending."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def has_sliding(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    @property
    def is_hybrid(self) -> bool:
        """Both sliding and full layers are present."""
        return self.has_sliding and FULL_ATTENTION in self.layer_types

    @property
    def attention_scaling(self) -> float:
        """Factor multiplied into q·k before softmax."""
        scalar = self.query_pre_attn_scalar
        return (scalar if scalar is not None else self.head_dim) ** -0.5

    def window_of(self, layer_id: int) -> int | None:
        """The window of layer ``layer_id``; ``None`` for full attention."""
        return self.sliding_window if self.layer_types[layer_id] == SLIDING_ATTENTION else None

    def attention_spec(self, layer_id: int) -> AttentionLayerSpec:
        """What the attention backend is told about layer ``layer_id``."""
        return AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            scaling=self.attention_scaling,
            sliding_window=self.window_of(layer_id),
        )
