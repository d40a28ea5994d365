"""Tiny random DeepSeek-V4 checkpoints made by transformers (no network), for parity tests.

``make_tiny_dsv4_checkpoint(tmp_path, ratios=(0, 4, 128, 4), **overrides) -> Path`` writes a
float32 ``DeepseekV4ForCausalLM`` directory (``config.json`` + safetensors) whose weights
are re-drawn by :func:`kvcanary.model.deepseek_v4.init_dsv4_weights` (the preset's init:
peaky logits, sharp attention, random sinks / position biases / hash routing), so greedy
tokens do not flip on near-ties and every branch (window, C4 + indexer top-k, C128, MoE,
mHC) moves the logits. ``load_hf_dsv4(path)`` loads transformers' model (eager, fp32).

Shapes: vocab 300, hidden 64, 4 heads x 32 (8 RoPE channels), q rank 32, 2 output groups
of rank 16, indexer 16 heads x 16 keeping the top 8, 4 experts (top 2) of width 32 + a
shared one, 4 mHC streams, window 16, 1024 positions; layer 0 hash-routed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvcanary.model.deepseek_v4 import init_dsv4_weights
from kvcanary.model.loader import load_model_config

VOCAB_SIZE = 300
LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention",
              128: "heavily_compressed_attention"}  # fmt: skip


def dsv4_hf_config(ratios: tuple[int, ...] = (0, 4, 128, 4), **overrides: Any) -> Any:
    from transformers import DeepseekV4Config

    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, moe_intermediate_size=32,
        num_hidden_layers=len(ratios), num_attention_heads=4, head_dim=32, q_lora_rank=32,
        num_experts_per_tok=2, n_routed_experts=4, layer_types=[LAYER_TYPE[r] for r in ratios],
        mlp_layer_types=["hash_moe"] + ["moe"] * (len(ratios) - 1), sliding_window=16,
        o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=8,
        max_position_embeddings=1024, partial_rotary_factor=0.25, bos_token_id=VOCAB_SIZE - 2,
        eos_token_id=VOCAB_SIZE - 1,
    )  # fmt: skip
    kwargs.update(overrides)
    return DeepseekV4Config(**kwargs)


def make_tiny_dsv4_checkpoint(
    tmp_path: Path, ratios: tuple[int, ...] = (0, 4, 128, 4), *, seed: int = 0, **overrides: Any
) -> Path:
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM(dsv4_hf_config(ratios, **overrides)).eval()
    out = tmp_path / f"dsv4-{'-'.join(map(str, ratios))}-s{seed}"
    hf.save_pretrained(out)  # config.json first: our config drives the init below
    tensors = [(n.removeprefix("model."), t) for n, t in hf.state_dict(keep_vars=True).items()]
    # The eos row stays live in the lm_head, bos / eos are just ids; special rows at the end.
    init_dsv4_weights(tensors, load_model_config(str(out)), seed, VOCAB_SIZE - 2)
    hf.save_pretrained(out)
    return out


def load_hf_dsv4(path: Path) -> Any:
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                 dtype=torch.float32).eval()  # fmt: skip
