"""``kvcanary run``: drive the engine over a synthetic workload and summarise it."""

from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.engine import Engine, RequestOutput
from kvcanary.engine.pool_check import check_engine_pools, check_workload
from kvcanary.engine.warmup import warm_engine
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import BaseSWAKVPool
from kvcanary.workload import WorkloadSpec, make_prompts


def run_workload(
    config: EngineConfig, spec: WorkloadSpec, progress: bool = True
) -> tuple[dict[str, Any], Engine]:
    """Run every request to completion; return the summary (stable JSON keys) and engine.

    The progress bar counts tokens (prompt tokens with KV + output tokens), so it moves
    with every forward rather than with each finished request. Before the engine starts,
    every kernel it will call is compiled (:func:`kvcanary.engine.warmup.warm_engine`: a bar of
    its own while anything compiles; nothing shown with a warm cache)."""
    check_workload(config, spec)
    warm = warm_engine(config, progress=progress)
    engine = Engine(config)
    prompts = make_prompts(spec, engine.runner.vocab_size)
    check_engine_pools(engine, map(len, prompts), spec.output_len)
    params = SamplingParams(max_new_tokens=spec.output_len, ignore_eos=True)
    total = sum(map(len, prompts)) + len(prompts) * spec.output_len
    bar = tqdm(total=total, desc="tokens", unit="tok", unit_scale=True, disable=not progress)
    num_finished_tokens = 0

    def on_step(done: list[RequestOutput]) -> None:
        nonlocal num_finished_tokens
        num_finished_tokens += sum(len(o.prompt_ids) + len(o.output_ids) for o in done)
        running = sum(r.kv_len for r in engine.running_requests())
        bar.update(max(0, min(total, num_finished_tokens + running) - bar.n))  # never backwards

    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, on_step=on_step)
    wall = time.perf_counter() - t0
    bar.update(total - bar.n)
    bar.close()
    engine.check_integrity()
    summary = summarize(engine, outs, wall)
    summary["warmup_s"] = warm.wall_s
    summary["warmup_kernels_compiled"] = warm.compiles.num_compiled
    return summary, engine


def summarize(engine: Engine, outs: list, wall_s: float) -> dict[str, Any]:
    st = engine.stats
    runner = engine.runner
    alloc = runner.allocator
    pool = runner.token_to_kv_pool
    is_swa = isinstance(alloc, SWAAllocator) and isinstance(pool, BaseSWAKVPool)
    full_size = alloc.size_full if isinstance(alloc, SWAAllocator) else alloc.size
    swa_size = alloc.size_swa if isinstance(alloc, SWAAllocator) else 0
    gathers = pool.translation_stats["gathers"] if is_swa and isinstance(pool, BaseSWAKVPool) else 0
    return {
        "model": engine.config.model,
        "page_size": engine.config.page_size,
        "sliding_window": runner.sliding_window,
        "kv_canary": engine.config.canary.mode,
        "requests": len(outs),
        "prompt_tokens": sum(len(o.prompt_ids) for o in outs),
        "output_tokens": sum(len(o.output_ids) for o in outs),
        "wall_time_s": wall_s,
        "prefill_tokens_per_s": st.num_prefill_tokens / st.prefill_time_s if st.prefill_time_s else 0.0,
        "decode_tokens_per_s": st.num_decode_tokens / st.decode_time_s if st.decode_time_s else 0.0,
        "forwards": st.num_forwards,
        "full_pool_tokens": full_size,
        "swa_pool_tokens": swa_size,
        "peak_full_used_tokens": st.peak_full_used,
        "peak_swa_used_tokens": st.peak_swa_used,
        "peak_full_active_tokens": st.peak_full_active,
        "peak_swa_active_tokens": st.peak_swa_active,
        "prefix_cache_hit_rate": (
            st.num_cached_prompt_tokens / st.num_prompt_tokens if st.num_prompt_tokens else 0.0
        ),
        "retractions": st.num_retractions,
        "swa_slots_evicted": st.num_swa_slots_evicted,
        "swa_slots_tombstoned": st.num_swa_slots_tombstoned,
        "suspected_leak_full_slots": st.num_leaked_full_slots,
        "suspected_leak_swa_slots": st.num_leaked_swa_slots,
        "swa_translation_gathers_per_forward": gathers / st.num_forwards if st.num_forwards else 0.0,
        "graph_replays": st.graph_replays,
        **spec_summary(engine),
        **canary_summary(engine),
    }


def spec_summary(engine: Engine) -> dict[str, Any]:
    """Speculative decoding: the method, draft tokens proposed and accepted, the acceptance
    rate and the drafts accepted per request and verify step (0 when off)."""
    st, spec = engine.stats, engine.config.speculative
    return {
        "speculative_method": spec.method,
        "spec_draft_tokens": st.spec_num_proposed,
        "spec_accepted_tokens": st.spec_num_accepted,
        "spec_acceptance_rate": st.spec_num_accepted / st.spec_num_proposed if st.spec_num_proposed else 0.0,
        "spec_mean_accepted_per_step": (
            st.spec_num_accepted / st.spec_num_drafted_reqs if st.spec_num_drafted_reqs else 0.0
        ),
    }


def written_by_group(write_entries_by_tag: dict[str, int]) -> dict[str, int]:
    """Records written per canary group (pool kind: FULL, SWA, C4, C4_STATE ...): its
    TAIL K writes, one per token (compressed groups: per block) stored in that sub-pool."""
    from kvcanary.canary.wire.constants import (
        CanaryLaunchTag,
        KvHalf,
        LaunchStage,
        split_launch_tag,
    )

    out: dict[str, int] = {}
    for name, count in write_entries_by_tag.items():
        kind, stage, half = split_launch_tag(CanaryLaunchTag[name])
        if stage == LaunchStage.TAIL and half == KvHalf.K:
            out[kind.name] = count
    return out


def canary_summary(engine: Engine) -> dict[str, Any]:
    """The canary's figures (zeros when it is off); see docs/CLI.md for the keys."""
    c = engine.canary.stats() if engine.canary is not None else {}
    d = engine.draft_canary.stats() if engine.draft_canary is not None else {}
    return {
        "kv_canary_real_data": engine.config.canary.real_data,
        "canary_protected_tokens": c.get("protected_tokens", 0),
        "canary_verify_entries": c.get("verify_entries", 0),
        "canary_write_entries": c.get("write_entries", 0),
        "canary_written_by_group": written_by_group(c.get("write_entries_by_tag", {})),
        "canary_violations": c.get("violations", 0),
        "canary_violations_by_tag": c.get("violations_by_tag", {}),
        "canary_violations_by_reason": c.get("violations_by_reason", {}),
        "canary_verify_overflow_steps": c.get("verify_overflow_steps", 0),
        "canary_aborted_requests": c.get("aborted_requests", 0),
        "canary_sweep_passes": c.get("sweep_passes", 0),
        "canary_launch_tags_active": (
            f"{len(c['launch_tags_active'])}/{c['launch_tags_defined']}" if c else "0/0"
        ),
        "canary_swa_divergence": c.get("swa_divergence", {}),
        # The draft model's canary (speculative decoding, --speculative-method draft).
        "canary_draft_verify_entries": d.get("verify_entries", 0),
        "canary_draft_write_entries": d.get("write_entries", 0),
        "canary_draft_violations": d.get("violations", 0),
        "canary_draft_violations_by_tag": d.get("violations_by_tag", {}),
        "canary_draft_violations_by_reason": d.get("violations_by_reason", {}),
    }
