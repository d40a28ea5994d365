"""load_model on checkpoint directories: errors that name the problem, sharded
checkpoints, tied embeddings, extra tensors, dtype; and preset determinism."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from dense_backend import DenseRunner
from hf_fixtures import EOS_ID, make_tiny_hf_checkpoint
from safetensors.torch import load_file, save_file

from kvcanary.model import HybridDecoder, ModelLoadError, load_model

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3_hybrid")


@pytest.fixture
def scratch(qwen3_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the qwen3_hybrid checkpoint that a test may damage."""
    return Path(shutil.copytree(qwen3_dir, tmp_path / "copy"))


def _edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _drop_tensor(path: Path, name: str) -> None:
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_not_a_directory_lists_presets(tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError,
        match=r"neither a builtin preset \(builtin:tiny-mha, builtin:tiny-swa, builtin:tiny-swa-all, "
        r"builtin:tiny-dsv4, builtin:qwen3-0.6b-shape\)",
    ):
        load_model(str(tmp_path / "nope"))


def test_missing_config_json(scratch: Path) -> None:
    (scratch / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(str(scratch))


def test_missing_safetensors(scratch: Path) -> None:
    (scratch / "model.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match=r"has no \*\.safetensors weights.*model\.safetensors\.index\.json"
    ):
        load_model(str(scratch))


def test_missing_tensor_is_named(scratch: Path) -> None:
    _drop_tensor(scratch, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(
        ModelLoadError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight$"
    ):
        load_model(str(scratch))


def test_wrong_shape_is_named(scratch: Path) -> None:
    _edit_config(scratch, lambda c: c.update(intermediate_size=96))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.layers\.0\.mlp\.down_proj\.weight .* shape \(64, 128\), expected \(64, 96\)",
    ):
        load_model(str(scratch))


def test_unsupported_architecture_in_directory(scratch: Path) -> None:
    _edit_config(scratch, lambda c: c.update(architectures=["FalconForCausalLM"]))
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported architecture \['FalconForCausalLM'\]; supported: .*Qwen3ForCausalLM",
    ):
        load_model(str(scratch))


def test_unsupported_rope_type_in_directory(scratch: Path) -> None:
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    _edit_config(scratch, lambda c: c.update(rope_parameters=rope))
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported rope_scaling type 'dynamic'; supported: default, linear, llama3, yarn",
    ):
        load_model(str(scratch))


def test_extra_tensors_are_ignored(scratch: Path, qwen3_dir: Path) -> None:
    tensors = load_file(scratch / "model.safetensors")
    tensors["model.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, scratch / "model.safetensors", metadata={"format": "pt"})
    expected = DenseRunner(load_model(str(qwen3_dir))[0]).extend(PROMPT)
    torch.testing.assert_close(
        DenseRunner(load_model(str(scratch))[0]).extend(PROMPT), expected, atol=0, rtol=0
    )


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path, qwen3_dir: Path) -> None:
    sharded = make_tiny_hf_checkpoint(tmp_path, "qwen3_hybrid", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    expected = DenseRunner(load_model(str(qwen3_dir))[0]).extend(PROMPT)
    torch.testing.assert_close(
        DenseRunner(load_model(str(sharded))[0]).extend(PROMPT), expected, atol=0, rtol=0
    )
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    with pytest.raises(ModelLoadError, match=r"names missing shard\(s\): \['model-00001-of-"):
        load_model(str(sharded))


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    model, _, config = load_model(str(make_tiny_hf_checkpoint(tmp_path, "llama")))
    assert config.tie_word_embeddings and model.lm_head is None
    hidden = torch.randn(3, config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.embed_tokens.weight.T)


def test_dtype_and_eos(qwen3_dir: Path) -> None:
    model, tokenizer, config = load_model(str(qwen3_dir), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos_cached.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    assert DenseRunner(model).extend(PROMPT).dtype == torch.float32  # logits always float32
    assert config.eos_token_ids == (EOS_ID,) and tokenizer.eos_token_ids == (EOS_ID,)


def _state(model: HybridDecoder) -> dict[str, torch.Tensor]:
    return model.state_dict()


@pytest.mark.parametrize("preset", ["builtin:tiny-mha", "builtin:tiny-swa"])
def test_preset_weights_are_seeded(preset: str) -> None:
    a, b, c = (_state(load_model(preset, seed=s)[0]) for s in (0, 0, 1))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    random_params = [k for k in a if not k.endswith("norm.weight")]
    assert all(not torch.equal(a[k], c[k]) for k in random_params)
    half = _state(load_model(preset, seed=0, dtype=torch.bfloat16)[0])
    assert all(torch.equal(half[k], a[k].to(torch.bfloat16)) for k in a)
