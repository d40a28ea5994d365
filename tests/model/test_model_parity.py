"""Our decoder vs transformers on the same checkpoint: logits over every position of a
prompt longer than the window, greedy decoding, RoPE variants, and the presets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dense_backend import DenseForwardBatch, DenseRunner
from hf_fixtures import FAMILIES, VOCAB_SIZE, make_tiny_hf_checkpoint
from transformers import AutoModelForCausalLM

from kvcanary.model import HybridDecoder, load_model
from kvcanary.model.hf_export import to_hf_qwen3

PROMPT_LEN = 40  # > every fixture window (6 or 8)
NUM_NEW_TOKENS = 12


def _prompt(seed: int = 3, length: int = PROMPT_LEN, vocab: int = VOCAB_SIZE - 2) -> list[int]:
    return torch.randint(
        0, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def _hf(
    path: Path,
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation, dtype=dtype, **config_overrides
    ).eval()


@torch.no_grad()
def _hf_logits(hf: Any, ids: list[int], start_pos: int = 0) -> torch.Tensor:
    positions = torch.arange(start_pos, start_pos + len(ids))[None]
    return hf(torch.tensor([ids]), position_ids=positions).logits[0]


@torch.no_grad()
def _our_logits(model: HybridDecoder, ids: list[int], start_pos: int = 0) -> torch.Tensor:
    positions = torch.arange(start_pos, start_pos + len(ids))
    return model.compute_logits(model(torch.tensor(ids), positions, DenseForwardBatch()))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_tiny_hf_checkpoint(root, family) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(("attn_implementation", "atol"), [("eager", 1e-4), ("sdpa", 5e-4)])
def test_prefill_logits_match_transformers(
    checkpoints: dict[str, Path], family: str, attn_implementation: str, atol: float
) -> None:
    model, _, _ = load_model(str(checkpoints[family]))
    prompt = _prompt()
    expected = _hf_logits(_hf(checkpoints[family], attn_implementation), prompt)
    torch.testing.assert_close(_our_logits(model, prompt), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_decode_matches_transformers_generate(
    checkpoints: dict[str, Path], family: str
) -> None:
    model, _, config = load_model(str(checkpoints[family]))
    hf = _hf(checkpoints[family])
    prompt = _prompt(seed=11)
    with torch.no_grad():
        generated = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False
        )
    expected = generated[0, len(prompt) :].tolist()
    runner = DenseRunner(model)
    assert runner.greedy(prompt, NUM_NEW_TOKENS, config.eos_token_ids) == expected
    assert len(set(expected)) > 3  # the fixture's output depends on context
    # The incremental (cached) path gives the full-forward logits at every step.
    full = _hf_logits(hf, prompt + expected)
    decoded = DenseRunner(model)
    steps = [decoded.extend(prompt)] + [decoded.extend([t]) for t in expected[:-1]]
    # float32, cached vs full attention: other matmul shapes, other summation orders. The
    # difference scales with the logits (measured: 1.5e-4 on logits up to 41, i.e. 4e-6 of
    # the scale, on a CPU whose BLAS differs from the one a fixed 1e-4 was tuned on), so the
    # bound is relative to the logit scale; the full forward itself is exact (below).
    scale = float(full.abs().max())
    torch.testing.assert_close(torch.cat(steps), full[:-1], atol=1e-5 * scale, rtol=0)
    torch.testing.assert_close(_our_logits(model, prompt + expected), full, atol=1e-5, rtol=0)


# Families with sliding layers; a window longer than the prompt is their no-window variant
# (this keeps everything else, e.g. Gemma3's per-layer-type RoPE base, unchanged).
_SLIDING_FAMILIES = ["qwen3_hybrid", "qwen2", "mistral", "gemma3"]


@pytest.mark.parametrize("family", _SLIDING_FAMILIES)
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_transformers_really_applies_the_window(
    checkpoints: dict[str, Path], family: str, attn_implementation: str
) -> None:
    """Guards the parity tests: the reference must differ from its no-window variant
    exactly from position W on (query W is the first that loses key 0)."""
    _, _, config = load_model(str(checkpoints[family]))
    window = config.sliding_window
    assert window is not None and window < PROMPT_LEN
    prompt = _prompt()
    windowed = _hf_logits(_hf(checkpoints[family], attn_implementation), prompt)
    unwindowed = _hf_logits(
        _hf(checkpoints[family], attn_implementation, sliding_window=4096), prompt
    )
    torch.testing.assert_close(windowed[:window], unwindowed[:window], atol=5e-4, rtol=0)
    per_position = (windowed - unwindowed).abs().amax(dim=-1)
    assert per_position[window] > 1e-2
    assert bool((per_position[window:] > 1e-2).all())


_ROPE_VARIANTS = [
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0}}),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500_000.0,
            }
        },
    ),
    (
        "qwen3_hybrid",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e6,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    (
        "mistral",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 2.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 256,
                "beta_fast": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            }
        },
    ),
    (
        "gemma3",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        },
    ),
    # Numerics beyond the defaults: biases everywhere, Gemma's final logit softcap.
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
    ("qwen3_hybrid", {"attention_bias": True}),
    ("gemma3", {"final_logit_softcapping": 30.0}),
]


@pytest.mark.parametrize(("family", "overrides"), _ROPE_VARIANTS)
def test_variants_match_transformers_at_far_positions(
    tmp_path: Path, family: str, overrides: dict[str, Any]
) -> None:
    path = make_tiny_hf_checkpoint(tmp_path, family, **overrides)
    model, _, _ = load_model(str(path))
    prompt, start = _prompt(length=24), 400  # positions 400..423, past yarn/llama3 originals
    expected = _hf_logits(_hf(path), prompt, start_pos=start)
    torch.testing.assert_close(
        _our_logits(model, prompt, start_pos=start), expected, atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("preset", ["builtin:tiny-mha", "builtin:tiny-swa", "builtin:tiny-swa-all"])
def test_presets_are_exact_transformers_qwen3_models(preset: str) -> None:
    model, _, c = load_model(preset, seed=5)
    hf = to_hf_qwen3(model, c)
    prompt = _prompt(length=80, vocab=256)  # > the tiny-swa window of 32
    torch.testing.assert_close(
        _our_logits(model, prompt), _hf_logits(hf, prompt), atol=1e-4, rtol=0
    )


class _EagerLikeBackend:
    """One-shot prefill attention with transformers eager's precision: q·k and p·v in the
    input dtype, softmax in float32 cast back. Lets bf16 parity test the model's own
    cast points (the dense backend attends in float32, which eager does not)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any
    ) -> torch.Tensor:
        num_tokens, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [heads, tokens, head_dim]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        i, j = torch.arange(num_tokens)[:, None], torch.arange(num_tokens)[None, :]
        allowed = j <= i
        if layer.sliding_window is not None:
            allowed &= j > i - layer.sliding_window
        mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(
            ~allowed, torch.finfo(q.dtype).min
        )
        scores = torch.matmul(q, k.transpose(1, 2)) * layer.scaling + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).transpose(0, 1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_is_bit_exact_with_eager_precision_attention(
    checkpoints: dict[str, Path], family: str
) -> None:
    model, _, _ = load_model(str(checkpoints[family]), dtype=torch.bfloat16)
    # from_pretrained(dtype=...) keeps RoPE inv_freq in float32; .to(bfloat16) would not.
    hf = _hf(checkpoints[family], dtype=torch.bfloat16)
    prompt = _prompt()
    forward_batch = DenseForwardBatch(attn_backend=_EagerLikeBackend())  # type: ignore[arg-type]
    with torch.no_grad():
        ours = model.compute_logits(
            model(torch.tensor(prompt), torch.arange(len(prompt)), forward_batch)
        )
    torch.testing.assert_close(ours, _hf_logits(hf, prompt).float(), atol=0, rtol=0)
