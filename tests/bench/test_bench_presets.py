"""builtin:qwen3-0.6b-shape: the shapes it states, seeded weights, and greedy decoding that
does not depend on the batching (no near-ties)."""

from __future__ import annotations

import torch

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.engine import Engine
from kvcanary.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from kvcanary.model.decoder import HybridDecoder
from kvcanary.model.presets import PRESETS, init_preset_weights, qwen3_0_6b_shape
from kvcanary.model.tokenizer import ByteTokenizer

S, F = SLIDING_ATTENTION, FULL_ATTENTION


def test_config_has_qwen3_0_6b_shapes_with_three_sliding_to_one_full() -> None:
    c = PRESETS["qwen3-0.6b-shape"]
    assert c == qwen3_0_6b_shape()
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.intermediate_size, c.rope_theta,
            c.max_position_embeddings, c.vocab_size) == (
        "Qwen3ForCausalLM", 1024, 28, 16, 8, 128, 3072, 1e6, 4096, 151_936)  # fmt: skip
    assert c.layer_types == (S, S, S, F) * 7 and c.sliding_window == 512
    assert c.qk_norm and not c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id) == (256, (257,), 258)
    assert qwen3_0_6b_shape(2).layer_types == (S, S)
    assert qwen3_0_6b_shape(4).num_hidden_layers == 4


def _reduced(seed: int) -> HybridDecoder:
    model = HybridDecoder(qwen3_0_6b_shape(2))
    init_preset_weights(model, seed)
    return model


def test_weights_are_seeded_and_non_bytes_never_win() -> None:
    a, b, other = _reduced(0), _reduced(0), _reduced(1)
    for (name, pa), pb, po in zip(a.named_parameters(), b.parameters(), other.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):  # norms are constants
            assert not torch.equal(pa, po), name
    head = a.lm_head.weight
    assert head[ByteTokenizer.num_bytes :].abs().sum() == 0  # 151680 rows that never win
    assert head[: ByteTokenizer.num_bytes].abs().min(dim=1).values.gt(0).all()


def test_real_preset_decodes_bytes_identically_alone_and_batched() -> None:
    """Builds the whole 0.75B-parameter preset once (about 20 s on 2 cores)."""
    engine = Engine(EngineConfig(model="builtin:qwen3-0.6b-shape", max_total_tokens=1024,
                                 swa_full_tokens_ratio=1.0, chunked_prefill_size=24))  # fmt: skip
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [list(b"the canary sings in the coal mine, "), list(b"kv cache pages 0, 1, 2 and ")]
    batched = [o.output_ids for o in engine.generate(prompts, params)]
    alone = [engine.generate([p], params)[0].output_ids for p in prompts]
    assert batched == alone  # chunked + batched vs whole + alone: no greedy near-tie flipped
    assert all(0 <= t < ByteTokenizer.num_bytes for out in batched for t in out)
    assert batched[0] != batched[1]  # the output depends on the prompt
    # Its first layers are the reduced config's (same draw order up to layer 1).
    reduced = _reduced(0)
    model = engine.runner.model
    for name, p in reduced.named_parameters():
        if name.startswith(("embed_tokens", "layers.0.", "layers.1.")):
            assert torch.equal(p, model.get_parameter(name)), name

