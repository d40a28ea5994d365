"""``kvcanary bench engine``: our engine vs transformers ``generate`` vs vLLM's CPU build on
the same checkpoint and prompts (batched, greedy), measured side by side in one run.

The checkpoint: ``--model`` (a builtin preset or a Qwen3 checkpoint directory) as our engine
loads it, exported with :func:`~kvcanary.model.hf_export.to_hf_qwen3` (transformers, sdpa
attention, in this process) and saved to a temporary directory for vLLM, which runs in its
own venv as :mod:`.vllm_peer` (started once; without its interpreter vLLM is skipped, and
the summary says so in ``vllm``).

For each batch size b (``--batches``): b prompts of ``[input_len/2, input_len]`` tokens,
``--output-len`` new tokens each (no early stop). Prefill goes in forwards of at most
``--prefill-tokens`` tokens in ours and in vLLM (default 4096, vLLM's CPU default for its
``LLM`` class; transformers prefills each batch in one forward). An untimed warm-up round (every system
at every batch size, prompts cut to 8 tokens: first calls at a shape allocate, compile and
pack weights), then ``--repeats`` rounds, each running every system once per batch size,
alternating (ours, transformers, vLLM, ours, ...), so drifting machine load hits all alike. Timed: the generate
call only. Tokens/s = b x output_len / seconds, median over rounds; ``mismatches`` = prompts
whose tokens differ from transformers' in any round.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kvcanary
from kvcanary.bench.engines import fit_pools
from kvcanary.bench.vllm_peer import VllmPeer
from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.engine import Engine
from kvcanary.engine.pool_check import check_workload
from kvcanary.model.decoder import HybridDecoder
from kvcanary.model.hf_export import to_hf_qwen3
from kvcanary.model.loader import load_model_config
from kvcanary.utils import show
from kvcanary.workload import WorkloadSpec, make_prompts

OURS, HF, VLLM = "kvcanary", "transformers", "vllm"
WARMUP_PROMPT_LEN = 8
# <checkout>/.venv-vllm/bin/python for an editable install (`make test-vllm` builds it).
DEFAULT_VLLM_PYTHON = str(Path(kvcanary.__file__).resolve().parents[2] / ".venv-vllm/bin/python")

# prompts -> (seconds of the generate call, new tokens per prompt)
Generate = Callable[[list[list[int]]], tuple[float, list[list[int]]]]


@dataclass(frozen=True)
class EngineBenchSpec:
    """What ``bench engine`` runs (the CLI's defaults are read from here)."""

    model: str = "builtin:tiny-swa"
    batches: tuple[int, ...] = (1, 16, 64)
    input_len: int = 128
    output_len: int = 64
    repeats: int = 3
    page_size: int = 4
    # Tokens per prefill forward, ours (chunked_prefill_size) and vLLM's
    # (max_num_batched_tokens): vLLM's CPU default for its LLM class; transformers prefills a
    # batch in one forward.
    prefill_tokens: int = 4096
    seed: int = 0
    vllm_python: str = DEFAULT_VLLM_PYTHON

    def __post_init__(self) -> None:
        """Bad values raise ``ValueError`` naming the flag, the value and what is allowed."""
        ok_batches = (bool(self.batches) and all(b >= 1 for b in self.batches)
                      and len(set(self.batches)) == len(self.batches))  # fmt: skip
        for ok, flag, value, allowed in (
            (ok_batches, "--batches", ",".join(map(str, self.batches)),
             "comma-separated distinct integers >= 1"),
            (self.input_len >= 1, "--input-len", self.input_len, "an integer >= 1"),
            (self.output_len >= 1, "--output-len", self.output_len, "an integer >= 1"),
            (self.repeats >= 1, "--repeats", self.repeats, "an integer >= 1"),
            (self.page_size >= 1, "--page-size", self.page_size, "an integer >= 1"),
            (not ok_batches or self.prefill_tokens >= max(self.batches), "--prefill-tokens",
             self.prefill_tokens, "an integer >= the largest batch size (vLLM schedules a "
             "decode token per request in one forward)"),
        ):  # fmt: skip
            if not ok:
                raise ValueError(f"{flag}={show(value)} is invalid: allowed {allowed}")


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


def bench_engine(spec: EngineBenchSpec, threads: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Run the comparison (module doc); the summary (stable JSON keys, see docs/CLI.md).
    ``threads``: vLLM's, as torch's were set in this process (None: each its own choice)."""
    prompts = {b: make_prompts(WorkloadSpec(b, spec.input_len, spec.output_len, 0, spec.seed), 256)
               for b in spec.batches}  # fmt: skip
    mc = load_model_config(spec.model)
    if mc.architecture != "Qwen3ForCausalLM":
        raise ValueError(f"--model={show(spec.model)} is invalid: allowed a Qwen3-architecture model "
                         f"(builtin presets are; this one is {mc.architecture})")  # fmt: skip
    config = EngineConfig(model=spec.model, page_size=spec.page_size, enable_prefix_cache=False,
                          chunked_prefill_size=spec.prefill_tokens, seed=spec.seed)  # fmt: skip
    check_workload(config, WorkloadSpec(1, spec.input_len, spec.output_len, 0))
    engine = Engine(fit_pools(config, mc.sliding_window,
                              [([spec.input_len] * b, spec.output_len) for b in spec.batches]))  # fmt: skip
    model = engine.runner.model
    if not isinstance(model, HybridDecoder):
        raise ValueError(f"--model={show(spec.model)} is invalid: allowed a Qwen3-architecture model")
    hf = to_hf_qwen3(model, mc, attn_implementation="sdpa")
    params = SamplingParams(max_new_tokens=spec.output_len, ignore_eos=True)
    systems: dict[str, Generate] = {
        OURS: _timed(lambda ps: [o.output_ids for o in engine.generate(ps, params)]),
        HF: _timed(lambda ps: _hf_generate(hf, ps, spec.output_len, mc.vocab_size - 1)),
    }
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-engine-") as tmp:
        peer, vllm_note = _start_vllm(spec, hf, Path(tmp), threads, progress)
        try:
            if peer is not None:  # timed inside the worker: its generate call only
                systems[VLLM] = lambda ps: peer.generate(ps, spec.output_len)
            results = _rounds(spec, prompts, systems, progress)
        finally:
            if peer is not None:
                peer.close()
    return _summarize(spec, results, vllm_note)


def _start_vllm(spec: EngineBenchSpec, hf: Any, tmp: Path, threads: int | None,
                progress: bool) -> tuple[VllmPeer | None, str]:  # fmt: skip
    """The vLLM worker on the exported checkpoint, or None and why it was skipped."""
    if not Path(spec.vllm_python).is_file():
        return None, (f"skipped: {spec.vllm_python} not found (`make test-vllm` builds "
                      ".venv-vllm; or pass --vllm-python)")  # fmt: skip
    if progress:
        print(f"bench engine: starting vLLM ({spec.vllm_python})", file=sys.stderr, flush=True)
    hf.save_pretrained(tmp / "checkpoint")
    peer = VllmPeer(spec.vllm_python, str(tmp / "checkpoint"),
                    max_model_len=spec.input_len + spec.output_len + 8,
                    max_num_seqs=max(spec.batches), max_num_batched_tokens=spec.prefill_tokens,
                    threads=threads)  # fmt: skip
    return peer, f"vLLM {peer.version} (CPU, torch threads {peer.threads}), {spec.vllm_python}"


def _timed(generate: Callable[[list[list[int]]], list[list[int]]]) -> Generate:
    def run(prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outputs = generate(prompts)
        return time.perf_counter() - t0, outputs

    return run


def _rounds(spec: EngineBenchSpec, prompts: dict[int, list[list[int]]], systems: dict[str, Generate],
            progress: bool) -> dict[tuple[int, str], tuple[list[float], list[list[list[int]]]]]:  # fmt: skip
    """(batch, system) -> (seconds of each round, outputs of each round)."""
    # Warm-up, untimed: each system at each batch size once, prompts cut to WARMUP_PROMPT_LEN
    # tokens (first calls at a shape allocate, compile, and pack weights for oneDNN: ours
    # packs a big weight the first time a forward's row count is in the packed range).
    for b in spec.batches:
        for generate in systems.values():
            generate([p[:WARMUP_PROMPT_LEN] for p in prompts[b]])
    results: dict[tuple[int, str], tuple[list[float], list[list[list[int]]]]] = {
        (b, s): ([], []) for b in spec.batches for s in systems
    }
    total = spec.repeats * len(spec.batches) * len(systems)
    with tqdm(total=total, desc="bench engine", unit="run", disable=not progress) as bar:
        for _ in range(spec.repeats):
            for b in spec.batches:
                for name, generate in systems.items():
                    bar.set_postfix_str(f"batch {b} {name}")
                    seconds, outputs = generate(prompts[b])
                    results[b, name][0].append(seconds)
                    results[b, name][1].append(outputs)
                    bar.update(1)
    return results


def _summarize(spec: EngineBenchSpec,
               results: dict[tuple[int, str], tuple[list[float], list[list[list[int]]]]],
               vllm_note: str) -> dict[str, Any]:  # fmt: skip
    rows = []
    for b in spec.batches:
        ref_seconds, ref_outputs = results[b, HF]
        ref_tps = _tokens_per_s(b, spec.output_len, ref_seconds)
        for name in (OURS, HF, VLLM):
            if (b, name) not in results:
                continue
            seconds, outputs = results[b, name]
            tps = _tokens_per_s(b, spec.output_len, seconds)
            differ = {i for got, ref in zip(outputs, ref_outputs, strict=True)
                      for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r}  # fmt: skip
            rows.append({
                "batch": b,
                "system": name,
                "tokens_per_s": tps,
                "vs_transformers": tps / ref_tps if ref_tps else 0.0,
                "mismatches": f"{len(differ)}/{b}",
            })  # fmt: skip
    return {
        "model": spec.model,
        "batches": list(spec.batches),
        "input_len_max": spec.input_len,
        "output_len": spec.output_len,
        "prefill_tokens": spec.prefill_tokens,
        "repeats": spec.repeats,
        "torch_threads": torch.get_num_threads(),
        "vllm": vllm_note,
        "rows": rows,
    }


def _tokens_per_s(batch: int, output_len: int, seconds: Sequence[float]) -> float:
    return batch * output_len / statistics.median(seconds)
