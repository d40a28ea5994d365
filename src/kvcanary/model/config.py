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
class DSV4Params:
    """What a DeepSeek-V4 (``DeepseekV4ForCausalLM``) model adds to :class:`ModelConfig`.

    Every DSV4 layer has a sliding-window branch (so the enclosing config marks every layer
    ``sliding_attention`` with the model's window); ``compress_ratios[i]`` adds a
    compressed branch: 0 none, 4 compressed sparse attention (with the lightning indexer's
    top-k), 128 heavily compressed attention. Field names follow transformers'
    ``DeepseekV4Config``.
    """

    compress_ratios: tuple[int, ...]  # per layer: 0, 4 or 128
    hash_moe: tuple[bool, ...]  # per layer: hash-routed (True) or top-k routed MoE
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_head_dim: int  # trailing channels of each head that get RoPE (qk_rope_head_dim)
    compress_rope_theta: float  # RoPE base of CSA/HCA layers and their compressors
    compress_rope_scaling: RopeScaling | None  # yarn (attention_factor 1) or None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str  # sqrtsoftplus | softmax | sigmoid
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float

    def __post_init__(self) -> None:
        bad = [r for r in self.compress_ratios if r not in (0, 4, 128)]
        if bad:
            raise ModelLoadError(f"compress ratios {bad} unsupported; supported: 0, 4, 128")
        if len(self.hash_moe) != len(self.compress_ratios):
            raise ModelLoadError(
                f"mlp_layer_types has {len(self.hash_moe)} entries for "
                f"{len(self.compress_ratios)} layers"
            )
        if self.rope_head_dim % 2 or self.rope_head_dim > self.index_head_dim:
            raise ModelLoadError(
                f"qk_rope_head_dim={self.rope_head_dim}: must be even and <= "
                f"index_head_dim={self.index_head_dim}"
            )
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ModelLoadError(
                f"scoring_func={self.scoring_func!r}; supported: sqrtsoftplus, softmax, sigmoid"
            )


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
    dsv4: DSV4Params | None = None  # set: a DeepSeek-V4 model (every layer slides, see there)

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
        if self.dsv4 is not None:
            self._check_dsv4(self.dsv4)

    def _check_dsv4(self, d: DSV4Params) -> None:
        if len(d.compress_ratios) != self.num_hidden_layers:
            raise ModelLoadError(
                f"layer_types has {len(d.compress_ratios)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        if self.layer_types != (SLIDING_ATTENTION,) * self.num_hidden_layers:
            raise ModelLoadError("DeepSeek-V4: every layer has a sliding-window branch")
        # The C4 compressor reads the 7 tokens before the open window from the SWA pages'
        # compress-state rings: they must still be in the window.
        if 4 in d.compress_ratios and (self.sliding_window or 0) < 8:
            raise ModelLoadError(
                f"sliding_window={self.sliding_window}: DeepSeek-V4 with compress ratio 4 "
                "needs a window of at least 8"
            )
        if self.num_key_value_heads != 1:
            raise ModelLoadError("DeepSeek-V4 attention has one shared KV head")
        if (self.num_attention_heads * self.head_dim) % d.o_groups:
            raise ModelLoadError(
                f"o_groups={d.o_groups} does not divide num_attention_heads * head_dim "
                f"({self.num_attention_heads * self.head_dim})"
            )

    @property
    def min_page_size(self) -> int:
        """KV pages must be a multiple of this: every compression ratio in use (a compressed
        entry never straddles pages), else 1."""
        return max(self.compression_ratios + (1,))

    @property
    def compression_ratios(self) -> tuple[int, ...]:
        """Per layer: 0, 4 or 128 (DeepSeek-V4); all 0 for other models."""
        return self.dsv4.compress_ratios if self.dsv4 is not None else (0,) * self.num_hidden_layers

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
