"""``kvcanary selftest``: the fault-injection campaign behind the canary's detection matrix.

For every pool kind (``builtin:tiny-mha``: FULL group; ``builtin:tiny-swa``: FULL + SWA;
``builtin:tiny-swa-all``: every layer sliding, a records-only FULL group + SWA) and every
fault class that applies to it (byte-level classes once per group holding fingerprinted KV;
``swa_mapping`` and ``premature_window_eviction`` only with an SWA group), one fresh engine runs the same small workload with one injection::

    wave 1   2 requests sharing a prefix, finished   -> the prefix cache holds unlocked nodes
    wave 2   4 distinct requests of 40-56 prompt + 64 new tokens (the window is 32), chunked
             prefill, graph-padded decode, an SWA pool 3/16 of the full one (so the window
             slides and SWA slots stop mirroring full slots); the fault is injected
             WARMUP_STEPS forward steps into wave 2

A compressed model (DeepSeek-V4: ``builtin:tiny-dsv4``) needs pages of 128 and prompts that
close C128 windows, so it runs its own workload: wave 1 shares a 128-token prefix (one cached
page whose SWA part stays resident), wave 2 has 4 requests of 100-124 prompt + 40 new tokens
(each crosses a C128 boundary while decoding) in 37-token chunks (chunks that do not align
with the compression windows), and the fault lands in the first decode steps
(WARMUP_STEPS_COMPRESSED). Its byte-level classes run once per group holding KV bytes:
SWA, the C4 / C128 / indexer entries and the three compress-state rings.

``spec:builtin:tiny-mha`` is the speculative workload: the target with ``builtin:tiny-swa``
drafting (K = 4; another model, so most drafts are rejected and rolled back), pages of 4,
16-token prefill chunks (the draft's catch-up prefill crosses chunk boundaries), no token
oracle (no drafts under it), the same two waves. The speculative fault classes run only there
(``draft_position_shift`` and ``draft_chunk_rotation`` on the draft model's canary, the others
on the target's), every other class only on the plain pools; its clean runs count the rows of
both canaries.

The canary runs in log mode with everything a fault class needs (real-KV ``partial``, radix
sweep every 4 steps, token check, the token oracle's write-input assertion) and its
observability on (health check and SWA divergence every 8 steps). A class is *detected*
when a reported row carries the expected tag and reason (see
:mod:`kvcanary.canary.perturb.expectations`) after the injection. A clean run of each pool's
workload (no injection) counts false positives. Every seed draws other prompts (so other
chunk boundaries, cache hits, slots) and other injection targets; a class counts as detected
only if it is detected under every seed. Exit status 1 if a class is missed or a clean run
reports anything.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from kvcanary.canary.manager import CanaryManager
from kvcanary.canary.perturb import (
    PERTURB_MODES,
    PerturbConfig,
    applies_to,
    expected_detection,
    install_perturbation,
)
from kvcanary.canary.perturb.config import (
    BYTE_FLIP_MODES,
    DRAFT_POOL_MODES,
    SPEC_MODES,
    PerturbMode,
)
from kvcanary.canary.wire.constants import KvHalf, LaunchStage, PoolKind, launch_tag
from kvcanary.config import CanaryConfig, EngineConfig, SamplingParams, SpeculativeConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.warmup import warm_engine, watch_compiles
from kvcanary.model.loader import load_model_config
from kvcanary.utils import show

# ``spec:<target>``: the target with speculative decoding by a draft model (SPEC_DRAFT_MODEL)
SPEC_PREFIX = "spec:"
SPEC_DRAFT_MODEL = "builtin:tiny-swa"  # another model than the target: most drafts rejected
SPEC_MODEL = SPEC_PREFIX + "builtin:tiny-mha"
SELFTEST_MODELS = ("builtin:tiny-mha", "builtin:tiny-swa", "builtin:tiny-swa-all", SPEC_MODEL)
WARMUP_STEPS = 6  # forward steps into wave 2 (prefill done, decoding) before the injection
WARMUP_STEPS_COMPRESSED = 16  # the same on a compressed model's longer prompts (~13 chunks)
MAX_STEPS = 300  # per run; the workload needs ~70


def _speculative(model: str) -> bool:
    return model.startswith(SPEC_PREFIX)


def _target(model: str) -> str:
    """The model a pool entry runs (``spec:<target>``: the target)."""
    return model.removeprefix(SPEC_PREFIX)


def _compressed(model: str) -> bool:
    """DeepSeek-V4-style model: compressed KV (pages must hold whole compression windows)."""
    return load_model_config(_target(model)).min_page_size > 1


@dataclass(frozen=True)
class FaultCase:
    mode: str
    model: str
    target_group: str | None = None  # byte flips: the group kind, lower case (full, swa, c4, ...)

    @property
    def name(self) -> str:
        return f"{self.mode}[{self.target_group}]" if self.target_group else self.mode


def engine_config(model: str, seed: int = 0, graph_safe: bool = False) -> EngineConfig:
    """Log mode with every check a fault class needs (see the module doc); ``graph_safe``:
    decode forwards planned with static capacities (``--kv-canary-graph-safe``)."""
    canary = CanaryConfig(mode="log", real_data="partial", verify_tokens=True, sweep_interval=4,
                          health_check_interval=8, swa_divergence_interval=8,
                          graph_safe=graph_safe)  # fmt: skip
    if _speculative(model):  # drafts of another model, verified; no token oracle (no drafts
        # under it); prefill chunks of 16 (the draft's catch-up prefill crosses chunk boundaries)
        spec = SpeculativeConfig(method="draft", num_speculative_tokens=4, draft_model=SPEC_DRAFT_MODEL)
        return EngineConfig(
            model=_target(model), page_size=4, max_total_tokens=2048, max_context_len=512,
            chunked_prefill_size=16, seed=seed, speculative=spec, canary=canary,
        )  # fmt: skip
    min_page = load_model_config(model).min_page_size
    if min_page > 1:  # compressed (see _compressed)
        page = math.lcm(4, min_page)
        return EngineConfig(
            model=model, page_size=page, max_total_tokens=24 * page, swa_full_tokens_ratio=0.5,
            max_context_len=512, chunked_prefill_size=37, seed=seed, token_oracle=True,
            canary=canary,
        )  # fmt: skip
    return EngineConfig(
        model=model, page_size=4, max_total_tokens=2048, swa_full_tokens_ratio=0.1875,
        max_context_len=512, chunked_prefill_size=64, seed=seed, token_oracle=True, canary=canary,
    )  # fmt: skip


def workload(seed: int = 0, compressed: bool = False) -> list[tuple[list[list[int]], int]]:
    """``[(prompts, max_new_tokens)]`` per wave (see the module doc)."""
    rng = random.Random(seed)
    # compressed: wave 1 ends within one window of its first page's end, so the cached page
    # keeps its SWA part (the sweep's target); wave 2 crosses a C128 boundary while decoding
    shared_len, suffix, lens, new2 = ((128, (2, 6), (100, 124), 40) if compressed
                                      else (16, (8, 12), (40, 56), 64))  # fmt: skip
    shared = [rng.randrange(256) for _ in range(shared_len)]
    wave1 = [shared + [rng.randrange(256) for _ in range(rng.randint(*suffix))] for _ in range(2)]
    wave2 = [[rng.randrange(256) for _ in range(rng.randint(*lens))] for _ in range(4)]
    return [(wave1, 4), (wave2, new2)]


def cases_for(model: str, group_kinds: set[PoolKind], modes: list[str],
              byte_groups: set[str] | None = None, sweepable: set[str] | None = None,
              store_checked: set[str] | None = None) -> list[FaultCase]:  # fmt: skip
    """The fault classes of one model. ``byte_groups``: the groups (lower-case kind names)
    that hold fingerprinted KV bytes (None: every group present); the byte-level classes
    target only those (an all-sliding model's FULL group is records-only: no bytes to
    corrupt); ``real_kv_unused_cache`` only the ``sweepable`` ones among them and
    ``lost_kv_store`` only the ``store_checked`` ones (None: full and swa)."""
    present = {k.name.lower() for k in group_kinds}
    targets = present if byte_groups is None else present & byte_groups
    per_mode = {
        PerturbMode.REAL_KV_UNUSED_CACHE: targets & ({"full", "swa"} if sweepable is None else sweepable),
        PerturbMode.LOST_KV_STORE: targets & ({"full", "swa"} if store_checked is None else store_checked),
    }  # fmt: skip
    order = [k.name.lower() for k in sorted(group_kinds)]
    out = []
    for mode in modes:
        if (PerturbMode(mode) in SPEC_MODES) != _speculative(model):  # speculative workload only
            continue
        if not applies_to(mode, PoolKind.SWA in group_kinds, PoolKind.FULL in group_kinds):
            continue
        if mode in BYTE_FLIP_MODES:
            allowed = per_mode.get(PerturbMode(mode), targets)
            out += [FaultCase(mode, model, g) for g in order if g in allowed]
        else:
            out.append(FaultCase(mode, model))
    return out


def _canary(engine: Engine) -> CanaryManager:
    if engine.canary is None:  # engine_config always enables it
        raise RuntimeError("selftest: the engine has no canary installed")
    return engine.canary


def _injected_canary(engine: Engine, case: FaultCase) -> CanaryManager:
    """The canary a case's perturber attaches to (the draft model's for draft-pool modes)."""
    if PerturbMode(case.mode) in DRAFT_POOL_MODES and engine.draft_canary is not None:
        return engine.draft_canary
    return _canary(engine)


def run_case(model: str, case: FaultCase | None, seed: int = 0,
             graph_safe: bool = False) -> tuple[dict[str, Any], Engine]:  # fmt: skip
    """One run (``case`` None: the clean run); its result row and the engine."""
    engine = Engine(engine_config(model, seed, graph_safe))
    compressed = _compressed(model)
    (wave1, new1), (wave2, new2) = workload(seed, compressed)
    warmup = WARMUP_STEPS_COMPRESSED if compressed else WARMUP_STEPS
    engine.generate(wave1, SamplingParams(max_new_tokens=new1, ignore_eos=True))
    canary = _canary(engine) if case is None else _injected_canary(engine, case)
    first_row = 0 if case is None else len(canary.violations)
    clean_start = [len(c.violations) for c in engine.canaries]

    def rows_since() -> list[Any]:
        if case is not None:
            return canary.violations[first_row:]
        return [r for c, n in zip(engine.canaries, clean_start, strict=True) for r in c.violations[n:]]

    perturber = None
    if case is not None:
        config = PerturbConfig.single(case.mode, 1.0, target_group=case.target_group, seed=seed,
                                      warmup_steps=canary.step + warmup, max_injections=1)  # fmt: skip
        perturber = install_perturbation(engine, config)
        expected = expected_detection(case.mode, case.target_group)
    params = SamplingParams(max_new_tokens=new2, ignore_eos=True)
    for prompt in wave2:
        engine.add_request(prompt, params)
    error, detected_row, steps = None, None, 0
    try:
        while engine.has_unfinished() and steps < MAX_STEPS:
            engine.step()
            steps += 1
            if perturber is not None and perturber.injections and detected_row is None:
                injected_at = perturber.injections[0].step
                detected_row = next((r for r in rows_since() if r.step > injected_at
                                     and expected.matches(r.launch_tag, r.fail_reasons)), None)  # fmt: skip
                if detected_row is not None:
                    break  # the engine's state is corrupt on purpose: stop here
        for c in engine.canaries:
            c.flush()
    except Exception as e:  # a fault may break the engine's bookkeeping before detection
        error = f"{type(e).__name__}: {e}"
    rows = rows_since()
    common = {
        "model": model, "forwards": canary.step, "violations": len(rows),
        "tags_seen": sorted({r.launch_tag for r in rows}),
        "reasons_seen": sorted({x for r in rows for x in r.fail_reasons}), "error": error,
    }  # fmt: skip
    if case is None:
        stats = canary.stats()
        result = {**common, "seed": seed, "protected_tokens": stats["protected_tokens"],
                  "sweep_passes": stats["sweep_passes"], "swa_divergence": stats["swa_divergence"],
                  "ok": not rows and error is None}  # fmt: skip
        return result, engine
    assert perturber is not None
    injection = perturber.injections[0] if perturber.injections else None
    detection_step = None
    if detected_row is None and injection is not None:  # e.g. reported by the final flush
        detected_row = next((r for r in rows if r.step > injection.step
                             and expected.matches(r.launch_tag, r.fail_reasons)), None)  # fmt: skip
    if detected_row is not None:
        detection_step = detected_row.step - 1 - canary.pump.delay_steps  # forward that saw it
    result = {
        "fault": case.name, "mode": case.mode, "seed": seed, **common,
        "target_group": case.target_group,
        "injected": injection is not None,
        "injection_step": None if injection is None else injection.step,
        "injection": None if injection is None else injection.detail,
        "detected": detected_row is not None,
        "detection_step": detection_step,
        "steps_to_detection": (None if detection_step is None or injection is None
                               else detection_step - injection.step),  # fmt: skip
        "expected_tags": list(expected.tags), "expected_reasons": list(expected.reasons),
        "detected_tag": None if detected_row is None else detected_row.launch_tag,
        "detected_reasons": [] if detected_row is None else list(detected_row.fail_reasons),
    }  # fmt: skip
    result["ok"] = result["detected"]
    return result, engine


def _check_every_mode_applies(modes: tuple[str, ...] | list[str], models: tuple[str, ...] | list[str],
                              plans: list[tuple[FaultCase | None, str, int]]) -> None:  # fmt: skip
    """A fault class that applies to none of the chosen models would pass as ``0/0``: an error."""
    covered = {case.mode for case, _, _ in plans if case is not None}
    unapplied = [m for m in modes if m not in covered]
    if not unapplied:
        return
    needs_swa = all(applies_to(m, True) and not applies_to(m, False) for m in unapplied)
    needs_full = all(applies_to(m, True) and not applies_to(m, True, False) for m in unapplied)
    needs_spec = all(PerturbMode(m) in SPEC_MODES for m in unapplied)
    where = (f" (they need the speculative workload: {SPEC_MODEL})" if needs_spec else
             " (they need a model with sliding-window layers: builtin:tiny-swa or "
             "builtin:tiny-swa-all)" if needs_swa else
             " (they need a model with a FULL group: not builtin:tiny-dsv4)" if needs_full
             else "")  # fmt: skip
    raise ValueError(
        f"--faults={show(','.join(modes))} is invalid with --models={show(','.join(models))}: "
        f"{', '.join(unapplied)} apply to none of these models{where}"
    )


def run_selftest(
    models: tuple[str, ...] | list[str] = SELFTEST_MODELS,
    modes: tuple[str, ...] | list[str] | None = None,
    seeds: tuple[int, ...] | list[int] = (0, 1, 2),
    progress: bool = True,
    graph_safe: bool = False,
) -> dict[str, Any]:
    """The whole campaign; the summary (stable JSON keys, see docs/CLI.md). ``modes`` None: every
    fault class that applies to each model; given: each must apply to at least one."""
    t0 = time.perf_counter()
    explicit = modes is not None
    modes = PERTURB_MODES if modes is None else modes
    bad = [m for m in modes if m not in PERTURB_MODES]
    if bad or not modes:
        raise ValueError(
            f"--faults={show(','.join(modes))} is invalid: allowed a non-empty comma-separated "
            f"subset of {', '.join(PERTURB_MODES)}"
        )
    if not models:
        raise ValueError("--models='' is invalid: allowed a non-empty comma-separated list")
    if not seeds:
        raise ValueError("--num-seeds=0 is invalid: allowed an integer >= 1")
    plans: list[tuple[FaultCase | None, str, int]] = []
    for model in models:
        if _speculative(model) and _compressed(model):
            raise ValueError(f"--models={show(model)} is invalid: speculative decoding refuses "
                             "DeepSeek-V4 models; allowed spec:<a model with a FULL group>")  # fmt: skip
        canary = _canary(Engine(engine_config(model)))  # which classes apply
        groups, checker = canary.groups, canary.runtime.store_checker
        kinds = {g.kind for g in groups}
        byte_groups = {g.kind.name.lower() for g in groups if g.real_kv_sources_k}
        sweepable = {g.kind.name.lower() for g in groups if g.sweepable}
        store_checked = {g.kind.name.lower() for g in groups if checker is not None
                         and checker.watch_for(int(launch_tag(g.kind, LaunchStage.TAIL, KvHalf.K)))}  # fmt: skip
        cases = cases_for(model, kinds, list(modes), byte_groups, sweepable, store_checked)
        plans += [(None, model, seed) for seed in seeds]
        plans += [(case, model, seed) for case in cases for seed in seeds]
    if explicit:
        _check_every_mode_applies(modes, models, plans)
    # Compile ahead, with the warm-up's bar (and helper process), so the campaign's own bar
    # moves from its first run; what a fault's path alone calls still compiles in the
    # campaign, shown on a bar of its own.
    warm = {_target(m) for m in models} | ({SPEC_DRAFT_MODEL} if any(map(_speculative, models)) else set())
    warmup_s = sum(warm_engine(engine_config(model, graph_safe=graph_safe), progress=progress).wall_s
                   for model in sorted(warm))  # fmt: skip
    clean: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    with watch_compiles(progress=progress):
        for case, model, seed in tqdm(plans, desc="selftest", unit="run", disable=not progress):
            (clean if case is None else runs).append(run_case(model, case, seed, graph_safe)[0])
    matrix = _matrix(runs)
    missed = [f"{r['fault']}@{r['model']}" for r in matrix if not r["ok"]]
    return {
        "ok": not missed and all(r["ok"] for r in clean),
        "seeds": list(seeds),
        "models": list(models),
        "graph_safe": graph_safe,
        "fault_classes": len(matrix),
        "detected_classes": sum(r["ok"] for r in matrix),
        "missed": missed,
        "false_positives": sum(r["violations"] for r in clean),
        "wall_time_s": time.perf_counter() - t0,
        "warmup_s": warmup_s,
        "matrix": matrix,
        "fault_runs": runs,
        "clean_runs": clean,
    }


def _matrix(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (fault class, pool) over its seeds."""
    by_class: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        by_class.setdefault((r["fault"], r["model"]), []).append(r)
    out = []
    for (fault, model), rs in by_class.items():
        steps = [r["steps_to_detection"] for r in rs if r["steps_to_detection"] is not None]
        out.append({
            "fault": fault, "model": model, "target_group": rs[0]["target_group"],
            "runs": len(rs), "detected_runs": sum(r["detected"] for r in rs),
            "ok": all(r["detected"] for r in rs),
            "max_steps_to_detection": max(steps) if steps else None,
            "expected_tags": rs[0]["expected_tags"], "expected_reasons": rs[0]["expected_reasons"],
            "detected_tags": sorted({r["detected_tag"] for r in rs if r["detected_tag"]}),
            "detected_reasons": sorted({x for r in rs for x in r["detected_reasons"]}),
            "tags_seen": sorted({t for r in rs for t in r["tags_seen"]}),
            "reasons_seen": sorted({x for r in rs for x in r["reasons_seen"]}),
            "errors": sorted({r["error"] for r in rs if r["error"]}),
        })  # fmt: skip
    return out


def render_selftest(summary: dict[str, Any]) -> str:
    from tabulate import tabulate

    def short(model: str) -> str:
        return model.replace("builtin:", "")

    matrix = [
        [r["fault"], short(r["model"]), f"{r['detected_runs']}/{r['runs']}",
         r["max_steps_to_detection"] if r["max_steps_to_detection"] is not None else "-",
         f"{'|'.join(r['expected_tags'])} {'|'.join(r['expected_reasons'])}",
         f"{','.join(r['detected_tags']) or '-'} {','.join(r['detected_reasons']) or '-'}",
         ", ".join(r["tags_seen"]), "; ".join(r["errors"])]
        for r in summary["matrix"]
    ]  # fmt: skip
    clean = [
        [short(r["model"]), r["seed"], r["forwards"], r["protected_tokens"], r["sweep_passes"],
         r["swa_divergence"].get("swa_out_of_window_tokens", "-"),
         r["swa_divergence"].get("swa_full_idx_divergence", "-"),
         r["violations"], "ok" if r["ok"] else "FALSE POSITIVE", r["error"] or ""]
        for r in summary["clean_runs"]
    ]  # fmt: skip
    verdict = "PASS" if summary["ok"] else "FAIL"
    return "\n\n".join([
        "kvcanary selftest: injected faults (detected runs / seeds)\n" + tabulate(matrix, headers=[
            "fault", "pool", "detected", "max steps", "expected (tag reason)",
            "matched (tag reason)", "all tags seen", "errors"], tablefmt="simple"),
        "clean runs (same workloads, no injection)\n" + tabulate(clean, headers=[
            "pool", "seed", "forwards", "protected_tokens", "sweep_passes", "peak out-of-window",
            "peak swa!=full", "violations", "verdict", "error"], tablefmt="simple"),
        f"{verdict}: {summary['detected_classes']}/{summary['fault_classes']} fault classes "
        f"detected under {len(summary['seeds'])} seed(s), {summary['false_positives']} false "
        f"positive(s), {summary['wall_time_s']:.1f} s",
    ])  # fmt: skip
