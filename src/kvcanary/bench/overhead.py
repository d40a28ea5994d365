"""``kvcanary bench overhead``: what the KV canary costs, measured side by side in one run.

Cases, per model (``--model``, comma-separated)::

    decode b   for each b of --batches: b prompts of [input_len/2, input_len] tokens, each
               generating --output-len tokens; its rows report the decode forwards (the
               whole batch, one new token per request)
    prefill    one prompt of exactly --prefill-len tokens (in --chunked-prefill-size chunks),
               one new token; its rows report those prefill forwards (0: no such case)

One engine per variant (canary none, log, log + real-data partial, log + real-data all). Per
model they are built once, share one decoder (identical seeded weights) and run every case
in lockstep: step ``i`` of every engine runs the same batch (the canary never changes
scheduling), back to back, in an order rotated every step (``--schedule blocks``: each engine
runs the whole case before the next starts, the order rotated every repeat; its pairs are
further apart in time, but each step finds the caches as its own engine left them, as an
engine serving alone does: the four engines of lockstep evict each other's records and
code between two steps of one). Each step is timed
(``Engine.step``: scheduling, forward with the canary, sampling). Every repeat draws new
prompts, so no case is served by the prefix cache from an earlier one. The overhead of a
variant is the median, over the case's paired steps of every repeat, of ``t_variant /
t_none - 1`` (paired, so a burst of load from elsewhere hits both sides of a pair and drops
out of the median); throughput is the case's tokens / summed step time (median over
repeats).

Bytes per forward (:mod:`.traffic`, from each forward's batch shape, mean over the case's
forwards): the canary's record and fingerprint bytes against the KV bytes attention reads.
Their ratio is the overhead a forward bound by KV traffic would see: how far the measured
overhead is from the memory-traffic bound. Targets (SPEC §7): tiny-swa decode <= 2 % (log),
<= 3 % (log + real-data partial), prefill <= 2 %; the realistic preset <= 0.5 % decode and
<= 1 % prefill.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from kvcanary.bench.engines import fit_pools, random_prompt, record_forward_shapes, shared_decoder
from kvcanary.bench.traffic import StepShape, canary_bytes, canary_groups, kv_read_bytes
from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.args import default_page_size
from kvcanary.engine.engine import Engine
from kvcanary.engine.pool_check import check_workload
from kvcanary.model.loader import load_model_config
from kvcanary.utils import cdiv, show
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
    "log+graph-safe": dict(mode="log", graph_safe=True),  # static decode plans (graphs)
}
DEFAULT_VARIANTS = ("none", "log", "log+partial", "log+all")
BASELINE = "none"
DECODE, PREFILL = "decode", "prefill"
SCHEDULES = ("lockstep", "blocks")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class OverheadSpec:
    """What ``bench overhead`` runs (the CLI's defaults are read from here). Defaults take
    a few minutes on 2 cores, most of it the 0.6B preset at batch 32."""

    models: tuple[str, ...] = ("builtin:tiny-swa", "builtin:qwen3-0.6b-shape")
    batches: tuple[int, ...] = (1, 8, 32)
    input_len: int = 64
    output_len: int = 6
    shared_prefix_len: int = 0
    prefill_len: int = 1024
    repeats: int = 3
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    # Time the canary calls the engine makes in each step (rows gain
    # canary_host_us_per_forward and canary_host_pct; time_canary_calls); the timers add
    # ~0.3-1 us a call to the canary variants' steps.
    time_canary: bool = False
    # How the variants' engines take turns (module doc): "lockstep" (step by step, order
    # rotated every step) or "blocks" (each runs a whole case alone, order rotated every
    # repeat: the caches hold one engine's state, as in a deployment).
    schedule: str = "lockstep"

    def __post_init__(self) -> None:
        """Bad values raise ``ValueError`` naming the flag, the value and what is allowed."""
        _check(bool(self.models) and all(self.models), "--model", ",".join(self.models),
               "a comma-separated list of models")  # fmt: skip
        _check(bool(self.batches) and all(b >= 1 for b in self.batches)
               and len(set(self.batches)) == len(self.batches), "--batches",
               ",".join(map(str, self.batches)), "comma-separated distinct integers >= 1")  # fmt: skip
        _check(self.output_len >= 2, "--output-len", self.output_len,
               "an integer >= 2 (one decode forward at least)")  # fmt: skip
        _check(self.prefill_len >= 0, "--prefill-len", self.prefill_len,
               "an integer >= 0 (0: no long-prompt case)")  # fmt: skip
        _check(self.repeats >= 1, "--repeats", self.repeats, "an integer >= 1")
        unknown = [v for v in self.variants if v not in VARIANTS]
        _check(not unknown and BASELINE in self.variants
               and len(set(self.variants)) == len(self.variants), "--variants",
               ",".join(self.variants),
               f"a comma-separated subset of {', '.join(VARIANTS)} that includes {show(BASELINE)}")  # fmt: skip
        _check(self.schedule in SCHEDULES, "--schedule", self.schedule,
               " | ".join(SCHEDULES))  # fmt: skip
        # input_len and shared_prefix_len: WorkloadSpec's checks.
        self.workload(1, 0)

    def workload(self, batch: int, seed: int) -> WorkloadSpec:
        return WorkloadSpec(batch, self.input_len, self.output_len, self.shared_prefix_len, seed)


def _check(ok: bool, flag: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{flag}={show(value)} is invalid: allowed {allowed}")


class Case(NamedTuple):
    phase: str  # the phase whose forwards its rows report
    batch: int
    output_len: int


class _Step(NamedTuple):
    phase: str
    seconds: float
    shapes: list[StepShape]  # the step's forwards
    canary_seconds: float  # in the canary's host calls (--time-canary; else 0)


class _Run(NamedTuple):
    """One variant's engine over one case in one repeat."""

    steps: list[_Step]
    outputs: dict[int, list[int]]
    violations: int


def cases_of(spec: OverheadSpec) -> list[Case]:
    cases = [Case(DECODE, b, spec.output_len) for b in spec.batches]
    return cases + ([Case(PREFILL, 1, 1)] if spec.prefill_len else [])


def case_prompts(spec: OverheadSpec, case: Case, seed: int) -> list[list[int]]:
    if case.phase == PREFILL:
        return [random_prompt(spec.prefill_len, seed)]
    return make_prompts(spec.workload(case.batch, seed), vocab_size=256)


def check_models(base: EngineConfig, spec: OverheadSpec) -> None:
    """Every case fits every model's context (before any engine starts)."""
    for model in spec.models:
        config = replace(base, model=model)
        check_workload(config, spec.workload(1, 0))
        limit = config.max_context_len or load_model_config(model).max_position_embeddings
        _check(spec.prefill_len + 1 <= limit, "--prefill-len", spec.prefill_len,
               f"--prefill-len + 1 <= {limit} (the context length of {model})")  # fmt: skip


def bench_overhead(
    base: EngineConfig,
    spec: OverheadSpec,
    *,
    fit: tuple[str, ...] = ("max_total_tokens", "swa_full_tokens_ratio"),
    page_size: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every model's cases (module doc); the summary (stable JSON keys, see docs/CLI.md).

    ``fit``: the EngineConfig pool fields sized per model to its largest case (the rest as
    in ``base``). ``page_size``: None gives each model its default (``--page-size``)."""
    check_models(base, spec)
    cases = cases_of(spec)
    rows: list[dict[str, Any]] = []
    total = sum(_estimated_steps(base, spec, c) for c in cases) * len(spec.models)
    with tqdm(total=total * spec.repeats * len(spec.variants), desc="bench overhead",
              unit="step", disable=not progress) as bar:  # fmt: skip
        for model in spec.models:
            config = replace(base, model=model,
                             page_size=page_size or default_page_size(model))  # fmt: skip
            rows += _bench_model(_model_config(config, spec, cases, fit), spec, cases, bar)
        bar.total = bar.n
        bar.refresh()
    return {
        "models": list(spec.models),
        "variants": list(spec.variants),
        "batches": list(spec.batches),
        "input_len_max": spec.input_len,
        "output_len": spec.output_len,
        "shared_prefix_len": spec.shared_prefix_len,
        "prefill_len": spec.prefill_len,
        "repeats": spec.repeats,
        "schedule": spec.schedule,
        "chunked_prefill_size": base.chunked_prefill_size,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }


def _model_config(config: EngineConfig, spec: OverheadSpec, cases: list[Case],
                  fit: tuple[str, ...]) -> EngineConfig:  # fmt: skip
    batches = [([spec.prefill_len if c.phase == PREFILL else spec.input_len] * c.batch, c.output_len)
               for c in cases]  # fmt: skip
    fitted = fit_pools(config, load_model_config(config.model).sliding_window, batches)
    return replace(config, **{f: getattr(fitted, f) for f in fit})


def _estimated_steps(base: EngineConfig, spec: OverheadSpec, case: Case) -> int:
    """Steps per engine (for the progress bar): prefill chunks + decode forwards."""
    prompt_tokens = spec.prefill_len if case.phase == PREFILL else case.batch * (spec.input_len * 3 // 4)
    chunk = base.chunked_prefill_size if base.chunked_prefill_size > 0 else prompt_tokens
    return cdiv(prompt_tokens, chunk) + case.output_len - 1


def _bench_model(config: EngineConfig, spec: OverheadSpec, cases: list[Case], bar: tqdm) -> list[dict[str, Any]]:
    model = config.model
    bar.set_postfix_str(f"{model}: building engines")
    with shared_decoder():
        engines = {v: Engine(replace(config, canary=replace(config.canary, **VARIANTS[v])))
                   for v in spec.variants}  # fmt: skip
    shapes = {v: record_forward_shapes(e) for v, e in engines.items()}
    clocks = {v: time_canary_calls(e) if spec.time_canary else [0.0] for v, e in engines.items()}
    bar.set_postfix_str(f"{model}: warm-up")
    warm = [random_prompt(spec.input_len, config.seed - k) for k in (1, 2)]
    _run_case(engines, shapes, clocks, warm, min(spec.output_len, 4), lambda: None)  # compile, fill caches
    blocks = spec.schedule == "blocks"
    runs: list[list[dict[str, _Run]]] = [[] for _ in cases]  # [case][repeat][variant]
    for repeat in range(spec.repeats):
        for i, case in enumerate(cases):
            bar.set_postfix_str(f"{model}: {case.phase} batch {case.batch}")
            prompts = case_prompts(spec, case, config.seed + 1 + repeat * len(cases) + i)
            runs[i].append(_run_case(engines, shapes, clocks, prompts, case.output_len,
                                     lambda: bar.update(1), repeat if blocks else None))  # fmt: skip
    mc = engines[spec.variants[0]].runner.model_config
    dtype_bytes = _DTYPE_BYTES[config.dtype]
    kv_of = None if mc.dsv4 else partial(kv_read_bytes, model=mc, dtype_bytes=dtype_bytes)
    rows = []
    for case, case_runs in zip(cases, runs, strict=True):
        for v in spec.variants:
            canary_of = None
            if kv_of is not None:  # the bytes model covers MHA and SWA pools
                groups = canary_groups(mc, replace(config.canary, **VARIANTS[v]), dtype_bytes)
                canary_of = partial(canary_bytes, groups=groups)
            rows.append(_row(model, case, v, case_runs, canary_of, kv_of, spec.time_canary))
    return rows


def time_canary_calls(engine: Engine, graph_parts: bool | None = None) -> list[float]:
    """Wrap ``engine``'s canary host calls with timers; returns the accumulator
    ``[seconds]``. Timed: what the engine calls, ``before_forward`` / ``after_forward``
    (``begin_forward`` + ``head``, ``tail`` + ``end_forward``), on CUDA also
    ``begin_forward`` / ``end_forward`` (a graph replay calls them around HEAD / TAIL
    recorded in the graph; ``graph_parts`` overrides), and the store check's per-layer
    ``observe`` / ``observe_rows`` inside attention; only the outermost of nested calls is timed (one timer per
    call the engine makes: each adds ~0.3-1 us of its own, counted in). On the CPU that is
    all of the canary's work; on an accelerator its host work and launches (not the device
    time, nor HEAD / TAIL replayed inside a captured graph)."""
    clock = [0.0]
    canary = engine.canary
    if canary is None:
        return clock
    depth = [0]

    def timed(obj: Any, name: str) -> None:
        call = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:  # inside a timed call: counted there
                return call(*args, **kwargs)
            depth[0] = 1
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - t0
                depth[0] = 0

        setattr(obj, name, wrapper)

    names = ["before_forward", "after_forward"]
    if engine.runner.device.type == "cuda" if graph_parts is None else graph_parts:
        names += ["begin_forward", "end_forward"]
    for name in names:
        timed(canary, name)
    if canary.runtime.store_checker is not None:
        timed(canary.runtime.store_checker, "observe")
        timed(canary.runtime.store_checker, "observe_rows")
    return clock


def _run_case(engines: dict[str, Engine], shapes: dict[str, list[StepShape]],
              clocks: dict[str, list[float]], prompts: list[list[int]], output_len: int,
              on_step: Callable[[], None], block_turn: int | None = None) -> dict[str, _Run]:  # fmt: skip
    """Every variant's engine over ``prompts``: in lockstep, step by step (module doc); with
    ``block_turn`` each engine runs them to the end before the next starts, the order rotated
    by ``block_turn`` (``--schedule blocks``)."""
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    rids: dict[str, list[int]] = {v: [e.add_request(p, params) for p in prompts] for v, e in engines.items()}
    violations = {v: _violations(e) for v, e in engines.items()}
    names = list(engines)
    steps: dict[str, list[_Step]] = {v: [] for v in names}
    outputs: dict[str, dict[int, list[int]]] = {v: {} for v in names}

    def step_once(v: str) -> None:
        engine = engines[v]
        decodes, first_shape, canary_t0 = engine.stats.num_decode_forwards, len(shapes[v]), clocks[v][0]
        t0 = time.perf_counter()
        finished = engine.step()
        dt = time.perf_counter() - t0
        phase = DECODE if engine.stats.num_decode_forwards > decodes else PREFILL
        steps[v].append(_Step(phase, dt, shapes[v][first_shape:], clocks[v][0] - canary_t0))
        outputs[v].update({rids[v].index(o.rid): o.output_ids for o in finished})
        on_step()

    if block_turn is not None:
        turn = block_turn % len(names)
        for v in names[turn:] + names[:turn]:
            while engines[v].has_unfinished():
                step_once(v)
    step = 0
    while any(e.has_unfinished() for e in engines.values()):
        for v in names[step % len(names) :] + names[: step % len(names)]:
            step_once(v)
        step += 1
    return {v: _Run(steps[v], outputs[v], _violations(engines[v]) - violations[v]) for v in names}


def _violations(engine: Engine) -> int:
    return int(engine.canary.stats()["violations"]) if engine.canary else 0


def _row(model: str, case: Case, variant: str, runs: list[dict[str, _Run]],
         canary_bytes_of: Callable[[StepShape], int] | None,
         kv_bytes_of: Callable[[StepShape], int] | None,
         timed: bool = False) -> dict[str, Any]:  # fmt: skip
    """One (model, batch, phase, variant) row over the repeats of a case (bytes: None
    without a bytes model; canary host time: with ``timed``)."""
    ratios, tps, forwards, host, host_ratios = [], [], [], [], []
    for run in runs:
        mine = [s for s in run[variant].steps if s.phase == case.phase]
        ref = [s for s in run[BASELINE].steps if s.phase == case.phase]
        ratios += [m.seconds / r.seconds - 1.0 for m, r in zip(mine, ref, strict=True) if r.seconds > 0]
        host += [s.canary_seconds / max(len(s.shapes), 1) for s in mine]
        host_ratios += [m.canary_seconds / r.seconds for m, r in zip(mine, ref, strict=True) if r.seconds > 0]
        shapes = [shape for s in mine for shape in s.shapes]
        seconds = sum(s.seconds for s in mine)
        tps.append(sum(sum(s.extend_lens) for s in shapes) / seconds if seconds else 0.0)
        forwards += shapes
    n = max(len(forwards), 1)
    canary = kv = None
    if canary_bytes_of is not None and kv_bytes_of is not None:
        canary = sum(map(canary_bytes_of, forwards)) / n
        kv = sum(map(kv_bytes_of, forwards)) / n
    row: dict[str, Any] = {
        "model": model,
        "batch": case.batch,
        "phase": case.phase,
        "variant": variant,
        "forwards": len(forwards) // len(runs),
        "mean_batch": round(sum(len(s.prefix_lens) for s in forwards) / n, 2),
        "tokens_per_s": statistics.median(tps),
        "overhead_pct": 100.0 * statistics.median(ratios) if ratios else 0.0,
        "canary_bytes_per_forward": None if canary is None else round(canary),
        "kv_read_bytes_per_forward": None if kv is None else round(kv),
        "canary_vs_kv_read_pct": 100.0 * canary / kv if canary is not None and kv else None,
        "violations": sum(run[variant].violations for run in runs),
        "identical_outputs": all(run[variant].outputs == run[BASELINE].outputs for run in runs),
    }
    if timed:  # median over the case's steps: host time per forward, and over the paired
        # none step's time (the overhead the canary's own calls account for)
        row["canary_host_us_per_forward"] = 1e6 * statistics.median(host) if host else 0.0
        row["canary_host_pct"] = 100.0 * statistics.median(host_ratios) if host_ratios else 0.0
    return row


def table_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary's rows, abridged for the terminal (bytes n/a: no bytes model for the
    model's pool, e.g. DeepSeek-V4's compressed groups)."""
    short = {"tokens_per_s": "tok/s", "overhead_pct": "overhead %",
             "canary_bytes_per_forward": "canary B/fwd", "kv_read_bytes_per_forward": "KV read B/fwd",
             "canary_vs_kv_read_pct": "canary/KV %", "identical_outputs": "same",
             "canary_host_us_per_forward": "canary us/fwd", "canary_host_pct": "canary %"}  # fmt: skip
    out = []
    for row in summary["rows"]:
        r = {short.get(k, k): "n/a" if v is None else v for k, v in row.items()
             if k not in ("forwards", "mean_batch")}  # fmt: skip
        r["model"] = str(r["model"]).removeprefix("builtin:")
        out.append(r)
    return out


def parse_batches(value: str) -> tuple[int, ...]:
    """``--batches`` ("1,8,32") -> (1, 8, 32); a one-line error naming the flag otherwise."""
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(
            f"--batches={show(value)} is invalid: allowed comma-separated distinct integers >= 1"
        ) from None

