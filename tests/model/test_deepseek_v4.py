"""DeepSeek-V4: config parsing, checkpoint loading (DeepSeek tensor names, per-expert
tensors), the ``builtin:tiny-dsv4`` preset. Forward parity with transformers runs through
the engine's paged memory: tests/engine/test_dsv4_engine.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dsv4_fixtures import load_hf_dsv4, make_tiny_dsv4_checkpoint
from safetensors.torch import load_file, save_file

from kvcanary.model import ModelLoadError, load_model, load_model_config
from kvcanary.model.deepseek_v4 import DeepseekV4Decoder
from kvcanary.model.dsv4_checkpoint import checkpoint_target
from kvcanary.model.hf_config import parse_hf_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dsv4_checkpoint(tmp_path_factory.mktemp("dsv4"), (128, 4, 0), seed=1)


def test_config_from_transformers(ckpt: Path) -> None:
    c = load_model_config(str(ckpt))
    assert c.architecture == "DeepseekV4ForCausalLM" and c.dsv4 is not None
    assert c.compression_ratios == (128, 4, 0)
    assert c.dsv4.hash_moe == (True, False, False)
    assert c.dsv4.rope_head_dim == 8 and c.dsv4.index_topk == 8
    assert c.layer_types == ("sliding_attention",) * 3 and c.sliding_window == 16
    assert (c.num_key_value_heads, c.head_dim, c.intermediate_size) == (1, 32, 32)
    assert c.min_page_size == 128


@pytest.mark.parametrize(
    ("extra", "ratios", "hash_moe", "rope_dim"),
    [
        ({}, (128, 128, 128, 4), (True, True, True, False), 64),  # transformers' defaults
        ({"compress_ratios": [0, 4, 4, 128], "num_hash_layers": 1, "qk_rope_head_dim": 16},
         (0, 4, 4, 128), (True, False, False, False), 16),  # legacy keys
    ],
)  # fmt: skip
def test_config_defaults_and_legacy_keys(
    extra: dict, ratios: tuple[int, ...], hash_moe: tuple[bool, ...], rope_dim: int
) -> None:
    raw = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 4, **extra}
    c = parse_hf_config(raw)
    assert c.dsv4 is not None
    assert (c.compression_ratios, c.dsv4.hash_moe, c.dsv4.rope_head_dim) == (ratios, hash_moe, rope_dim)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"compress_rates": {"compressed_sparse_attention": 8}}, "compress_rates"),
        ({"layer_types": ["full_attention"]}, "layer type"),
        ({"sliding_window": 4, "layer_types": ["compressed_sparse_attention"]}, "window of at least 8"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ],
)
def test_unsupported_configs_are_refused(extra: dict, match: str) -> None:
    raw = {"model_type": "deepseek_v4", "num_hidden_layers": 1, **extra}
    with pytest.raises(ModelLoadError, match=match):
        parse_hf_config(raw)


def test_checkpoint_tensors_land_where_transformers_puts_them(ckpt: Path) -> None:
    """Every tensor of our model equals transformers' (loaded from the same directory,
    which stores DeepSeek's names and per-expert w1/w2/w3)."""
    stored = load_file(str(ckpt / "model.safetensors"))
    assert "model.layers.1.ffn.experts.3.w2.weight" in stored  # DeepSeek names on disk
    ours, _, _ = load_model(str(ckpt))
    assert isinstance(ours, DeepseekV4Decoder)
    theirs = load_hf_dsv4(ckpt).state_dict()
    mine = ours.state_dict()
    assert len(mine) == len(theirs)
    for name, tensor in mine.items():
        ref = theirs[name if name.startswith("lm_head.") else "model." + name]
        assert torch.equal(tensor, ref), name


@pytest.mark.parametrize(
    ("key", "name", "part"),
    [
        ("layers.2.attn.indexer.compressor.ape", "model.layers.2.self_attn.compressor.indexer.position_bias", None),
        ("layers.2.attn.indexer.wq_b.weight", "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight", None),
        ("model.layers.0.attn.norm.weight", "model.layers.0.self_attn.kv_norm.weight", None),
        ("layers.5.ffn.gate.bias", "model.layers.5.mlp.gate.e_score_correction_bias", None),
        ("layers.1.ffn.experts.7.w3.weight", "model.layers.1.mlp.experts.gate_up_proj", (7, "up")),
        ("layers.1.ffn.experts.7.w2.weight", "model.layers.1.mlp.experts.down_proj", (7, "down")),
        ("head.weight", "lm_head.weight", None),
        ("hc_head_fn", "model.hc_head.hc_fn", None),
        ("norm.weight", "model.norm.weight", None),
        ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_proj.weight", None),
    ],
)  # fmt: skip
def test_checkpoint_names(key: str, name: str, part: tuple[int, str] | None) -> None:
    got, got_part = checkpoint_target(key)
    assert got == name
    assert (tuple(got_part) if got_part is not None else None) == part


def test_a_missing_expert_is_named(ckpt: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.ffn.experts.2.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*experts.gate_up_proj\[2.up\]"):
        load_model(str(broken))


def test_preset_is_seeded_and_peaky() -> None:
    a, tok, config = load_model("builtin:tiny-dsv4", seed=0)
    b, _, _ = load_model("builtin:tiny-dsv4", seed=0)
    c, _, _ = load_model("builtin:tiny-dsv4", seed=1)
    assert isinstance(a, DeepseekV4Decoder) and config.compression_ratios == (0, 4, 128, 4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.1.self_attn.compressor.position_bias"],
                           sc["layers.1.self_attn.compressor.position_bias"])  # fmt: skip
    assert sorted(sa["layers.0.mlp.gate.tid2eid"][5].tolist()) != [0, 0]  # distinct experts
    # Logit spread of the lm_head on a unit-RMS hidden state: peaky, non-byte rows dead.
    logits = a.compute_logits(torch.nn.functional.normalize(torch.randn(64, 64), dim=-1) * 8)
    assert float(logits[:, :256].std()) > 10
    assert torch.all(logits[:, 256:] == 0)
    assert json.dumps(config.eos_token_ids) and tok.vocab_size == config.vocab_size
