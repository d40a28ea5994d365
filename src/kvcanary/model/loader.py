"""``load_model(model)`` for ``builtin:*`` presets and Hugging Face checkpoint directories.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` plus its shards (any other ``*.safetensors`` files are
read as a fallback). Tensors use Hugging Face names (``model.layers.N.self_attn.q_proj.weight``,
``lm_head.weight`` absent when tied); every parameter must be present, extra tensors
(e.g. rotary ``inv_freq``) are ignored. Checkpoint buffers a model declares persistent
(DeepSeek-V4's hash-routing table ``tid2eid`` and ``e_score_correction_bias``) are loaded
like parameters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvcanary.model.config import ModelConfig, ModelLoadError
from kvcanary.model.decoder import HybridDecoder
from kvcanary.model.deepseek_v4 import DeepseekV4Decoder, init_preset_dsv4
from kvcanary.model.dsv4_checkpoint import checkpoint_target, expected_labels, label
from kvcanary.model.hf_config import parse_hf_config
from kvcanary.model.presets import BUILTIN_PREFIX, PRESETS, init_preset_weights, preset_config
from kvcanary.model.tokenizer import ByteTokenizer, Tokenizer, load_hf_tokenizer
from kvcanary.utils import show

INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_SHOWN = 8
Decoder = HybridDecoder | DeepseekV4Decoder


def load_model_config(model: str) -> ModelConfig:
    """The config of ``model``: ``"builtin:<preset>"`` or a checkpoint directory path."""
    if model.startswith(BUILTIN_PREFIX):
        return preset_config(model)
    model_dir = Path(model)
    if not model_dir.is_dir():
        presets = ", ".join(BUILTIN_PREFIX + name for name in PRESETS)
        raise ModelLoadError(
            f"model {show(model)} is neither a builtin preset ({presets}) nor an existing directory"
        )
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no config.json (a checkpoint directory needs config.json and "
            f"model.safetensors or {INDEX_FILE} with its shards)"
        )
    generation_path = model_dir / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    return parse_hf_config(_read_json(config_path), generation)


def load_model(
    model: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[Decoder, Tokenizer, ModelConfig]:
    """Build the decoder (a :class:`DeepseekV4Decoder` for DeepSeek-V4 configs) on
    ``device`` in ``dtype`` with its weights and tokenizer.

    Presets get seeded random weights (``seed``) and a :class:`ByteTokenizer`; checkpoint
    directories get their safetensors weights (``seed`` unused) and their own tokenizer.
    """
    config = load_model_config(model)
    decoder: Decoder
    if config.dsv4 is not None:
        decoder = DeepseekV4Decoder(config, device=device, dtype=dtype)
    else:
        decoder = HybridDecoder(config, device=device, dtype=dtype)
    tokenizer: Tokenizer
    if model.startswith(BUILTIN_PREFIX):
        if isinstance(decoder, DeepseekV4Decoder):
            init_preset_dsv4(decoder, seed)
        else:
            init_preset_weights(decoder, seed)
        tokenizer = ByteTokenizer()
    else:
        load_safetensors_weights(decoder, Path(model))
        tokenizer = load_hf_tokenizer(Path(model), config.vocab_size, config.eos_token_ids)
    return decoder.eval(), tokenizer, config


def hf_parameter_name(name: str) -> str:
    """Our parameter name -> the Hugging Face checkpoint tensor name."""
    return name if name.startswith("lm_head.") else "model." + name


@torch.no_grad()
def load_safetensors_weights(decoder: Decoder, model_dir: Path) -> None:
    """Copy every parameter and persistent buffer of ``decoder`` from the checkpoint (cast
    to its dtype/device). DeepSeek-V4 checkpoints use DeepSeek's tensor names and
    per-expert tensors (:mod:`~kvcanary.model.dsv4_checkpoint` maps them)."""
    params = {hf_parameter_name(n): p for n, p in decoder.state_dict(keep_vars=True).items()}
    dsv4 = isinstance(decoder, DeepseekV4Decoder)
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 -- safe_open is not a Mapping
                name, part = checkpoint_target(key) if dsv4 else (key, None)
                param, what = params.get(name), label(name, part)
                if param is None or what in loaded:
                    continue
                dest = param if part is None else part.view(param)
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"tensor {key} in {path.name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)} from config.json"
                    )
                dest.copy_(tensor)
                loaded.add(what)
    expected = [x for n, p in params.items() for x in expected_labels(n, p)]
    missing = sorted(set(expected) - loaded, key=_natural_key)
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_SHOWN])
        more = (
            f" and {len(missing) - _MAX_NAMES_SHOWN} more"
            if len(missing) > _MAX_NAMES_SHOWN
            else ""
        )
        raise ModelLoadError(
            f"checkpoint {model_dir} is missing {len(missing)} tensor(s): {shown}{more}"
        )


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read, from the index when there is one."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        shards = sorted(set(_read_json(index_path).get("weight_map", {}).values()))
        absent = [name for name in shards if not (model_dir / name).is_file()]
        if absent:
            raise ModelLoadError(f"{INDEX_FILE} in {model_dir} names missing shard(s): {absent}")
        return [model_dir / name for name in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir} has no *.safetensors weights (expected model.safetensors or "
            f"{INDEX_FILE} with its shards)"
        )
    return files


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _natural_key(name: str) -> list[tuple[int, str]]:
    """Sort ``layers.10`` after ``layers.2``."""
    return [(int(part), "") if part.isdigit() else (-1, part) for part in name.split(".")]
