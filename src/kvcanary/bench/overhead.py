"""``kvcanary bench overhead``: what the KV canary costs, measured side by side in one run.

One engine per variant (canary none, log, log + real-data partial, log + real-data all), all
given the same seeded workload and stepped in lockstep: step ``i`` of every engine runs the
same batch (the canary never changes scheduling), back to back, in an order rotated every
step. Each step is timed (``Engine.step``: scheduling, forward with the canary, sampling)
and classified as prefill (extend) or decode. The overhead of a variant is the median over
steps of ``t_variant / t_none - 1`` (paired, so a burst of load from elsewhere hits both
sides of a pair and drops out of the median), and the figure reported is the median over
repeats; throughput is tokens / summed step time (median over repeats). Targets (SPEC §7):
log decode <= 3 %, prefill <= 5 %, real-data partial <= 2 % more.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.engine import Engine
from kvcanary.utils import show
from kvcanary.workload import WorkloadSpec, make_prompts

# CanaryConfig fields of each variant (the rest as the base config's canary).
VARIANTS: dict[str, dict[str, Any]] = {
    "none": dict(mode="none"),
    "log": dict(mode="log"),
    "log+partial": dict(mode="log", real_data="partial"),
    "log+all": dict(mode="log", real_data="all"),
    # Wider coverage, measured to choose defaults (not in the default --variants list).
    "log+tokens": dict(mode="log", verify_tokens=True),
    "log+partial+v": dict(mode="log", real_data="partial", v_half=True),
    "log+partial+layers": dict(mode="log", real_data="partial", real_data_layers="all"),
}
DEFAULT_VARIANTS = ("none", "log", "log+partial", "log+all")
BASELINE = "none"
PHASES = ("prefill", "decode")


def _lockstep(
    configs: dict[str, EngineConfig], prompts: list[list[int]], output_len: int
) -> dict[str, dict[str, Any]]:
    """Run every variant's engine over ``prompts`` step by step; per-variant step timings."""
    engines = {v: Engine(c) for v, c in configs.items()}
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    for engine in engines.values():
        for p in prompts:
            engine.add_request(p, params)
    names = list(engines)
    out: dict[str, dict[str, Any]] = {
        v: {"steps": {p: [] for p in PHASES}, "tokens": dict.fromkeys(PHASES, 0), "outputs": {}}
        for v in names
    }
    step = 0
    while any(e.has_unfinished() for e in engines.values()):
        order = names[step % len(names) :] + names[: step % len(names)]
        for v in order:
            engine, rec = engines[v], out[v]
            st = engine.stats
            decodes, decode_tokens, prefill_tokens = (
                st.num_decode_forwards, st.num_decode_tokens, st.num_prefill_tokens,
            )  # fmt: skip
            t0 = time.perf_counter()
            finished = engine.step()
            dt = time.perf_counter() - t0
            phase = "decode" if st.num_decode_forwards > decodes else "prefill"
            rec["steps"][phase].append(dt)
            rec["tokens"]["decode"] += st.num_decode_tokens - decode_tokens
            rec["tokens"]["prefill"] += st.num_prefill_tokens - prefill_tokens
            rec["outputs"].update({o.rid: o.output_ids for o in finished})
        step += 1
    for v, engine in engines.items():
        out[v]["violations"] = engine.canary.stats()["violations"] if engine.canary else 0
    return out


def bench_overhead(
    base: EngineConfig,
    spec: WorkloadSpec,
    *,
    repeats: int = 5,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the repeats; the summary (stable JSON keys, see README)."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or BASELINE not in variants or len(set(variants)) != len(variants):
        raise ValueError(
            f"--variants={show(','.join(variants))} is invalid: allowed a comma-separated subset of "
            f"{', '.join(VARIANTS)} that includes {show(BASELINE)}"
        )
    if repeats < 1:
        raise ValueError(f"--repeats={show(repeats)} is invalid: allowed an integer >= 1")
    configs = {v: replace(base, canary=replace(base.canary, **VARIANTS[v])) for v in variants}
    vocab_size = Engine(configs[BASELINE]).runner.vocab_size
    prompts = make_prompts(spec, vocab_size)
    _lockstep(configs, prompts[:2], min(spec.output_len, 4))  # warm-up: compile, fill caches
    runs = []
    for _ in tqdm(range(repeats), desc="bench overhead", unit="repeat", disable=not progress):
        runs.append(_lockstep(configs, prompts, spec.output_len))
    return _summarize(base, spec, runs)


def _summarize(base: EngineConfig, spec: WorkloadSpec,
               runs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:  # fmt: skip
    ref_outputs = runs[0][BASELINE]["outputs"]
    rows = []
    for v in runs[0]:
        row: dict[str, Any] = {"variant": v}
        for phase in PHASES:
            tps, overheads = [], []
            for run in runs:
                mine, ref = run[v]["steps"][phase], run[BASELINE]["steps"][phase]
                total = sum(mine)
                tps.append(run[v]["tokens"][phase] / total if total else 0.0)
                ratios = [m / r - 1.0 for m, r in zip(mine, ref, strict=True) if r > 0]
                overheads.append(statistics.median(ratios) if ratios else 0.0)
            row[f"{phase}_tokens_per_s"] = statistics.median(tps)
            row[f"{phase}_overhead_pct"] = 100.0 * statistics.median(overheads)
        row["violations"] = int(sum(run[v]["violations"] for run in runs))
        row["identical_outputs"] = all(run[v]["outputs"] == ref_outputs for run in runs)
        rows.append(row)
    first = runs[0][BASELINE]
    return {
        "model": base.model,
        "page_size": base.page_size,
        "requests": spec.num_requests,
        "input_len_max": spec.input_len,
        "output_len": spec.output_len,
        "shared_prefix_len": spec.shared_prefix_len,
        "repeats": len(runs),
        "prefill_steps": len(first["steps"]["prefill"]),
        "decode_steps": len(first["steps"]["decode"]),
        "torch_threads": torch.get_num_threads(),
        "variants": rows,
    }
