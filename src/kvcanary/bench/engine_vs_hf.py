"""``kvcanary bench engine``: our engine vs Hugging Face transformers ``generate`` on the
same weights and prompts (batched, greedy), measured side by side in one run."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.engine import Engine
from kvcanary.model.decoder import HybridDecoder
from kvcanary.model.hf_export import to_hf_qwen3
from kvcanary.workload import WorkloadSpec, make_prompts


def _hf_generate(hf: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    """Left-padded batched greedy generation; returns the new tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad_id, eos_token_id=None,
        )
    return out[:, width:].tolist()


def bench_engine(
    model: str = "builtin:tiny-swa",
    spec: WorkloadSpec | None = None,
    repeats: int = 3,
    page_size: int = 4,
    progress: bool = True,
) -> dict[str, Any]:
    spec = spec or WorkloadSpec(num_requests=16, input_len=128, output_len=64, shared_prefix_len=0)
    engine = Engine(EngineConfig(model=model, page_size=page_size, enable_prefix_cache=False))
    runner = engine.runner
    if not isinstance(runner.model, HybridDecoder):
        raise ValueError(
            f"--model {model}: bench engine exports Qwen3-architecture models to transformers; "
            f"got {runner.model_config.architecture}"
        )
    hf = to_hf_qwen3(runner.model, runner.model_config, attn_implementation="sdpa")
    prompts = make_prompts(spec, runner.vocab_size)
    params = SamplingParams(max_new_tokens=spec.output_len, ignore_eos=True)
    pad_id = runner.vocab_size - 1
    num_out = spec.num_requests * spec.output_len
    ours_tps, hf_tps = [], []
    ours_out: list[list[int]] = []
    hf_out: list[list[int]] = []
    for _ in tqdm(range(repeats), desc="bench engine", disable=not progress):
        # Interleaved so drifting machine load hits both sides alike.
        t0 = time.perf_counter()
        ours_out = [o.output_ids for o in engine.generate(prompts, params)]
        ours_tps.append(num_out / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        hf_out = _hf_generate(hf, prompts, spec.output_len, pad_id)
        hf_tps.append(num_out / (time.perf_counter() - t0))
    same = sum(a == b for a, b in zip(ours_out, hf_out, strict=True))
    ours, theirs = statistics.median(ours_tps), statistics.median(hf_tps)
    return {
        "model": model,
        "requests": spec.num_requests,
        "input_len_max": spec.input_len,
        "output_len": spec.output_len,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "kvcanary_tokens_per_s": ours,
        "transformers_tokens_per_s": theirs,
        "speedup": ours / theirs if theirs else 0.0,
        "identical_outputs": f"{same}/{len(prompts)}",
    }
