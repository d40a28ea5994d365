"""kvcanary: a runtime KV-cache integrity canary, and the hybrid sliding-window engine it guards.

Subcommands: run | serve | warmup | selftest | explain | bench (overhead, engine, serve, prealloc).
Also ``python -m kvcanary``.

Defaults come from the config dataclasses; bad values are rejected before anything starts,
with the flag, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvcanary.config import DEFAULT_MAX_QUEUED_REQUESTS, EngineConfig
from kvcanary.engine.args import add_engine_flags, engine_config_from_args
from kvcanary.utils import show
from kvcanary.workload import WorkloadSpec

_E = EngineConfig.field_default
_W = WorkloadSpec()


def _workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=_W.num_requests,
                   help="requests in the synthetic workload (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=_W.input_len,
                   help="max prompt length; prompts vary in [input_len/2, input_len] (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=_W.output_len, help="new tokens per request (default: %(default)s)")
    p.add_argument("--shared-prefix-len", type=int, default=None,
                   help=f"tokens every prompt shares (default: half of --input-len, at most "
                        f"{_W.shared_prefix_len})")


@contextlib.contextmanager
def _log_to_stderr(level: str | None) -> Iterator[None]:
    """``--log-level``: show kvcanary's own log lines (stats, sweep, SWA divergence are INFO)
    on stderr for the duration of the command."""
    if level is None:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("kvcanary")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(level.upper())
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def _cmd_run(a: argparse.Namespace) -> int:
    from kvcanary.cli.report import emit
    from kvcanary.cli.run import run_workload

    spec = WorkloadSpec.from_flags(a.num_requests, a.input_len, a.output_len, a.shared_prefix_len, a.seed)
    for flag, out in (("--json", a.json), ("--metrics-file", a.metrics_file)):
        if out and not Path(out).resolve().parent.is_dir():
            raise ValueError(f"{flag} {show(out)}: directory {show(str(Path(out).parent))} does not exist")
    if a.disagg:
        if a.metrics_file:
            raise ValueError("--metrics-file is not available with --disagg (two engines)")
        from kvcanary.disagg.cli_hooks import run_disagg

        with _log_to_stderr(a.log_level):
            summary = run_disagg(a)
        emit("kvcanary run --disagg", summary, a.json)
        return 0
    with _log_to_stderr(a.log_level):
        summary, engine = run_workload(engine_config_from_args(a), spec, progress=not a.no_progress)
    emit("kvcanary run", summary, a.json)
    if a.metrics_file:
        from kvcanary.canary.report.metrics import write_metrics_file

        write_metrics_file(engine.canary, a.metrics_file, draft=engine.draft_canary)
    return 0


def _cmd_warmup(a: argparse.Namespace) -> int:
    from kvcanary.cli.report import emit, render_matrix, write_json
    from kvcanary.engine.warmup import warm_engine

    if a.json and not Path(a.json).resolve().parent.is_dir():
        raise ValueError(f"--json {show(a.json)}: directory {show(str(Path(a.json).parent))} does not exist")
    config = engine_config_from_args(a)
    with _log_to_stderr(a.log_level):
        report = warm_engine(config, progress=not a.no_progress)
    if report.skipped is not None:
        raise ValueError(f"warm-up skipped: {report.skipped}")
    summary = {
        "model": config.model,
        "kv_canary": config.canary.mode,
        "kernels_compiled": report.compiles.num_compiled,
        "helper_kernels_compiled": report.compiles.helper_compiles,
        "compile_s": round(report.compiles.compile_s, 3),
        "wall_s": round(report.wall_s, 3),
        "skipped": report.skipped,
    }
    compiled = {c.name: round(c.seconds, 3) for c in report.compiles.compiles}
    emit("kvcanary warmup", summary, None)
    if compiled:
        rows = [{"kernel": k, "compile_s": v} for k, v in sorted(compiled.items(), key=lambda kv: -kv[1])]
        print(render_matrix("kernels compiled here (callees included)", rows))
    if a.json:
        write_json(a.json, {**summary, "compiled": compiled})
    return 0


def _cmd_serve(a: argparse.Namespace) -> int:
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port={show(a.port)} is invalid: allowed an integer in [0, 65535]")
    import uvicorn

    from kvcanary import Engine
    from kvcanary.server import create_app

    if a.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests={a.max_queued_requests} is invalid: allowed an integer >= 0")
    if a.api_key is not None and not a.api_key:
        raise ValueError('--api-key="" is invalid: allowed a non-empty string')
    config = engine_config_from_args(a)  # bad flags fail here, before anything starts
    from kvcanary.engine.warmup import warm_engine

    with _log_to_stderr(a.log_level):
        # The port opens at once; /health says "starting" and requests get a 503 until every
        # kernel the engine calls is compiled (no request waits on a compile).
        app = create_app(Engine(config), served_model_name=a.served_model_name, api_key=a.api_key,
                         max_queued_requests=a.max_queued_requests,
                         warmup=lambda: warm_engine(config, progress=True))  # fmt: skip
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level or "info")
    return 0


def _cmd_bench_overhead(a: argparse.Namespace) -> int:
    from kvcanary.bench.overhead import OverheadSpec, bench_overhead, parse_batches, table_rows
    from kvcanary.cli.report import render_matrix, render_table, write_json

    spec = OverheadSpec(
        models=tuple(_csv(a.model)), batches=parse_batches(a.batches), input_len=a.input_len,
        output_len=a.output_len, shared_prefix_len=a.shared_prefix_len, prefill_len=a.prefill_len,
        repeats=a.repeats, variants=tuple(_csv(a.variants)), time_canary=a.time_canary,
        schedule=a.schedule,
    )  # fmt: skip
    _set_threads(a.threads)
    pools = ("max_total_tokens", "swa_full_tokens_ratio")
    given = {f: _E(f) if getattr(a, f) is None else getattr(a, f) for f in pools}
    base = engine_config_from_args(argparse.Namespace(**{**vars(a), **given, "model": spec.models[0]}))
    summary = bench_overhead(base, spec, fit=tuple(f for f in pools if getattr(a, f) is None),
                             page_size=a.page_size, progress=not a.no_progress)  # fmt: skip
    print(render_table("kvcanary bench overhead", _head(summary)))
    print(render_matrix("per model x batch x phase x variant: throughput, median paired overhead vs "
                        "none, canary bytes vs the KV bytes attention reads (per forward)",
                        table_rows(summary)))  # fmt: skip
    if a.json:
        write_json(a.json, summary)
    return 0


def _head(summary: dict[str, Any]) -> dict[str, Any]:
    """A bench summary's scalars for the table (lists comma-joined; ``rows`` left out)."""
    return {k: ", ".join(map(str, v)) if isinstance(v, list) else v
            for k, v in summary.items() if k != "rows"}  # fmt: skip


def _set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads={show(threads)} is invalid: allowed an integer >= 1")
    import torch

    torch.set_num_threads(threads)


def _cmd_bench_engine(a: argparse.Namespace) -> int:
    from kvcanary.bench.engine_vs_hf import EngineBenchSpec, bench_engine
    from kvcanary.bench.overhead import parse_batches
    from kvcanary.cli.report import render_matrix, render_table, write_json

    spec = EngineBenchSpec(
        model=a.model, batches=parse_batches(a.batches), input_len=a.input_len,
        output_len=a.output_len, repeats=a.repeats, page_size=a.page_size,
        prefill_tokens=a.prefill_tokens, seed=a.seed, vllm_python=a.vllm_python,
    )  # fmt: skip
    _set_threads(a.threads)
    summary = bench_engine(spec, threads=a.threads, progress=not a.no_progress)
    print(render_table("kvcanary bench engine (vs transformers generate and vLLM)", _head(summary)))
    print(render_matrix("tokens/s per batch size and system (median of the rounds); mismatches: "
                        "prompts whose tokens differ from transformers'", summary["rows"]))  # fmt: skip
    if a.json:
        write_json(a.json, summary)
    return 0


def _cmd_bench_spec(a: argparse.Namespace) -> int:
    from kvcanary.bench.spec import SpecBenchSpec, bench_spec
    from kvcanary.cli.report import render_matrix, render_table, write_json

    spec = SpecBenchSpec(
        model=a.model, draft_models=tuple(_csv(a.draft_models)),
        num_speculative_tokens=a.num_speculative_tokens, batch=a.batch, input_len=a.input_len,
        output_len=a.output_len, repeats=a.repeats, workloads=tuple(_csv(a.workloads)),
        canary=not a.no_canary, seed=a.seed,
    )  # fmt: skip
    _set_threads(a.threads)
    summary = bench_spec(engine_config_from_args(a), spec, progress=not a.no_progress)
    print(render_table("kvcanary bench spec", _head(summary)))
    print(render_matrix("per workload x variant: decode tok/s and speed-up over plain decoding "
                        "(medians over repeats), draft acceptance, the canary's cost with "
                        "speculation (+canary rows)", summary["rows"]))  # fmt: skip
    if a.json:
        write_json(a.json, summary)
    return 0 if summary["outputs_identical"] and not any(summary["violations"].values()) else 1


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _cmd_selftest(a: argparse.Namespace) -> int:
    from kvcanary.cli.report import write_json
    from kvcanary.cli.selftest import render_selftest, run_selftest

    if a.num_seeds < 1:
        raise ValueError(f"--num-seeds={show(a.num_seeds)} is invalid: allowed an integer >= 1")
    seeds = list(range(a.seed, a.seed + a.num_seeds))
    canary_log = logging.getLogger("kvcanary.canary")
    level = canary_log.level
    if not a.verbose:  # the injected faults' violation reports are the expected outcome
        canary_log.setLevel(logging.ERROR)
    try:
        faults = None if a.faults is None else _csv(a.faults)
        summary = run_selftest(_csv(a.models), faults, seeds, progress=not a.no_progress,
                               graph_safe=a.kv_canary_graph_safe)  # fmt: skip
    finally:
        canary_log.setLevel(level)
    print(render_selftest(summary))
    if a.json:
        write_json(a.json, summary)
    return 0 if summary["ok"] else 1


def _cmd_explain(a: argparse.Namespace) -> int:
    from kvcanary.canary.explain import explain, render_explain
    from kvcanary.cli.report import write_json

    if a.logfile == "-":
        text = sys.stdin.read()
    else:
        path = Path(a.logfile)
        if not path.is_file():
            raise ValueError(f"LOGFILE={show(a.logfile)} is invalid: allowed an existing file or \"-\" (stdin)")
        text = path.read_text(errors="replace")
    summary = {"log": a.logfile, **explain(text)}
    print(render_explain(summary))
    if a.json:
        write_json(a.json, summary)
    return 0


def _cmd_bench_vllm(a: argparse.Namespace) -> int:
    from kvcanary.cli.report import emit
    from kvcanary.integrations.vllm.bench import bench_vllm, check_bench_vllm_args

    check_bench_vllm_args(a)
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "kvcanary bench vllm needs vLLM, which this environment lacks: `make test-vllm` "
            "builds .venv-vllm; run .venv-vllm/bin/kvcanary bench vllm (with "
            "VLLM_CPU_KVCACHE_SPACE=1 on a CPU-only machine)"
        )
    r = bench_vllm(a)
    summary = {
        "model": r["model"], "outputs_identical": r["outputs_identical"],
        **({"control_outputs_identical": r["control_outputs_identical"]}
           if "control_outputs_identical" in r else {}),
        **{f"{k}_{side}": r[k][side] for k in ("prefill_tok_s", "decode_tok_s")
           for side in ("plain", "canary", "overhead_pct")},
        **{f"{k}_control_difference_pct": v["difference_pct"]
           for k, v in r.get("noise_floor", {}).items()},
        **({"connector_outputs_identical": r["connector_outputs_identical"]}
           if "connector_outputs_identical" in r else {}),
        **{f"{k}_{side}": v[side] for k, v in r.get("connector_control", {}).items()
           for side in ("interface_pct", "canary_beyond_interface_pct")},
        **{f"paired_{kind.removesuffix('_pct')}_{pair}_pct": v
           for kind in ("prefill_pct", "decode_pct") for pair, v in r["paired"][kind].items()},
        **{k: r["per_step"][k] for k in (
            "plain_decode_step_ms", "canary_decode_total_ms", "canary_vs_plain_decode_step_pct",
            "paired_canary_vs_plain_decode_step_pct", "plain_prefill_pass_ms",
            "canary_prefill_pass_ms", "canary_vs_plain_prefill_pct",
            "paired_canary_vs_plain_prefill_pct")},
    }  # fmt: skip
    emit("kvcanary bench vllm (plain vs canary connector)", summary, None)
    if a.json:
        from kvcanary.cli.report import write_json

        write_json(a.json, r)
    return 0 if r["outputs_identical"] else 1


def _cmd_bench_serve(a: argparse.Namespace) -> int:
    from kvcanary.bench.serve import BenchServeError, bench_ok, bench_serve
    from kvcanary.cli.report import emit

    _set_threads(a.threads)
    spec = WorkloadSpec.from_flags(a.num_requests, a.input_len, a.output_len, a.shared_prefix_len, a.seed)
    try:
        with _log_to_stderr(a.log_level):
            summary = bench_serve(engine_config_from_args(a), spec, concurrency=a.concurrency,
                                  deadline_s=a.deadline, progress=not a.no_progress)  # fmt: skip
    except BenchServeError as e:  # the server failed, not the input: one line, exit 1
        print(f"kvcanary bench serve: failed: {e}", file=sys.stderr)
        return 1
    emit("kvcanary bench serve (streams on loopback)", summary, a.json)
    return 0 if bench_ok(summary) else 1


def _cmd_bench_soak(a: argparse.Namespace) -> int:
    from kvcanary.bench.serve import BenchServeError
    from kvcanary.bench.soak import SoakConfig, bench_soak, soak_ok
    from kvcanary.cli.report import render_table, write_json

    _set_threads(a.threads)
    cfg = SoakConfig(duration_s=a.duration, concurrency=a.concurrency, max_tokens=a.max_tokens,
                     prompt_len=a.prompt_len, seed=a.seed or 0, request_timeout_s=a.request_timeout,
                     max_rss_growth_mib=a.max_rss_growth_mib)  # fmt: skip
    try:
        cfg.check()
        with _log_to_stderr(a.log_level):
            summary = bench_soak(engine_config_from_args(a), cfg, progress=not a.no_progress)
    except ValueError as e:
        print(f"kvcanary bench soak: {e}", file=sys.stderr)
        return 2
    except BenchServeError as e:  # the server failed, not the input: one line, exit 1
        print(f"kvcanary bench soak: failed: {e}", file=sys.stderr)
        return 1
    table = {k: v for k, v in summary.items() if k != "rss_curve_mib"}  # (the curve: --json)
    print(render_table("kvcanary bench soak (misbehaving clients on loopback)", table))
    if a.json:
        write_json(a.json, summary)
    return 0 if soak_ok(summary) else 1


def _cmd_bench_prealloc(a: argparse.Namespace) -> int:
    from kvcanary.cli.report import emit
    from kvcanary.disagg.cli_hooks import cmd_bench_prealloc

    emit("kvcanary bench prealloc", cmd_bench_prealloc(a), a.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcanary", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the engine on a synthetic workload and print a summary")
    add_engine_flags(run)
    _workload_flags(run)
    run.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    run.add_argument("--metrics-file", metavar="OUT",
                     help="write the canary's Prometheus metrics (text exposition) to OUT")
    from kvcanary.disagg.cli_hooks import add_bench_prealloc_flags, add_disagg_run_flags

    add_disagg_run_flags(run)
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--log-level", choices=("debug", "info", "warning"), default=None,
                     help="print kvcanary's log lines at this level to stderr (info: the "
                          "canary's stats, sweep and SWA divergence lines)")
    run.set_defaults(func=_cmd_run)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions and "
                                         "/v1/chat/completions, streamed or not; SGLang's /generate; "
                                         "/v1/models, /health, /metrics)")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: %(default)s)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send and see (default: the --model value)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* and /generate "
                            "(default: no key; /health and /metrics stay open)")
    serve.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                       help="requests that may wait beyond --max-running-requests; more get "
                            "HTTP 503 with Retry-After (default: %(default)s)")
    serve.add_argument("--log-level", choices=("debug", "info", "warning"), default=None,
                       help="kvcanary's and uvicorn's log level (default: uvicorn's info, "
                            "kvcanary's own lines hidden)")
    serve.set_defaults(func=_cmd_serve)

    warmup = sub.add_parser(
        "warmup", help="compile (into numba's on-disk cache) every kernel the engine calls with "
                       "these flags, so that run / serve start without compiling (e.g. in a "
                       "container build)")
    add_engine_flags(warmup)
    warmup.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    warmup.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    warmup.add_argument("--log-level", choices=("debug", "info", "warning"), default=None,
                        help="print kvcanary's log lines at this level to stderr")
    warmup.set_defaults(func=_cmd_warmup)

    from kvcanary.canary.perturb.config import PERTURB_MODES
    from kvcanary.cli.selftest import SELFTEST_MODELS

    selftest = sub.add_parser(
        "selftest", help="fault-injection campaign: every fault class x pool kind, detected? "
                         "plus clean runs (false positives); exit 1 on a miss or a false positive",
    )  # fmt: skip
    selftest.add_argument("--models", default=",".join(SELFTEST_MODELS),
                          help="comma-separated pools to test; builtin:tiny-dsv4 adds the "
                               "DeepSeek-V4 pool's per-sub-pool classes; spec:<model> runs "
                               "the speculative classes on <model> with a draft model "
                               "(default: %(default)s)")
    selftest.add_argument("--faults", default=None,
                          help="comma-separated fault classes, each applying to at least one "
                               "model (default: every class that applies to each model, of "
                               f"{','.join(PERTURB_MODES)})")
    selftest.add_argument("--seed", type=int, default=0, help="first seed (default: %(default)s)")
    selftest.add_argument("--num-seeds", type=int, default=3,
                          help="seeds seed, seed+1, ...: each draws other prompts and injection "
                               "targets; a class must be detected under all (default: %(default)s)")
    selftest.add_argument("--kv-canary-graph-safe", action="store_true",
                          help="run the campaign with graph-safe decode plans (static "
                               "capacities on the device, as a captured decode uses)")
    selftest.add_argument("--json", metavar="OUT", help="also write the detection matrix as JSON to OUT")
    selftest.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    selftest.add_argument("--verbose", action="store_true",
                          help="also print the injections' log lines and violation reports")
    selftest.set_defaults(func=_cmd_selftest)

    explain = sub.add_parser(
        "explain", help="group the kv_canary violation lines of a kvcanary or SGLang log and "
                        "name their likely causes",
    )  # fmt: skip
    explain.add_argument("logfile", metavar="LOGFILE", help="log file to read ('-': stdin)")
    explain.add_argument("--json", metavar="OUT", help="also write the analysis as JSON to OUT")
    explain.set_defaults(func=_cmd_explain)

    bench = sub.add_parser("bench", help="benchmarks measured side by side in one run")
    benches = bench.add_subparsers(dest="bench", required=True)
    overhead = benches.add_parser(
        "overhead", help="canary cost (none vs log vs log + real-data) per model: decode at each "
                         "batch size and a long-prompt prefill, with the canary's bytes per "
                         "forward against the KV bytes attention reads",
        conflict_handler="resolve",  # --model and the pool flags are redefined below
    )  # fmt: skip
    add_engine_flags(overhead, with_canary=False, with_speculative=False)
    from kvcanary.bench.overhead import SCHEDULES, VARIANTS, OverheadSpec

    _O = OverheadSpec()
    overhead.add_argument("--model", default=",".join(_O.models),
                          help="comma-separated models, each builtin:<preset> or a HF model "
                               "directory; one engine per variant each (default: %(default)s)")  # fmt: skip
    overhead.add_argument("--max-total-tokens", type=int, default=None,
                          help="full KV pool size in tokens (default: sized to each model's "
                               "largest case, so every batch runs at once)")  # fmt: skip
    overhead.add_argument("--swa-full-tokens-ratio", type=float, default=None,
                          help="SWA pool size / full pool size (default: sized like "
                               "--max-total-tokens)")  # fmt: skip
    overhead.add_argument("--batches", default=",".join(map(str, _O.batches)),
                          help="comma-separated decode batch sizes, one case each (default: %(default)s)")
    overhead.add_argument("--input-len", type=int, default=_O.input_len,
                          help="max prompt length of the decode cases; prompts vary in "
                               "[input_len/2, input_len] (default: %(default)s)")  # fmt: skip
    overhead.add_argument("--output-len", type=int, default=_O.output_len,
                          help="new tokens per request of the decode cases (default: %(default)s)")
    overhead.add_argument("--shared-prefix-len", type=int, default=_O.shared_prefix_len,
                          help="tokens every prompt of a decode case shares (default: %(default)s)")
    overhead.add_argument("--prefill-len", type=int, default=_O.prefill_len,
                          help="prompt length of the long-prompt prefill case; 0: no such case "
                               "(default: %(default)s)")  # fmt: skip
    overhead.add_argument("--repeats", type=int, default=_O.repeats,
                          help="repeats of every case, new prompts each; figures are medians "
                               "(default: %(default)s)")  # fmt: skip
    overhead.add_argument("--variants", default=",".join(_O.variants),
                          help=f"comma-separated subset of {', '.join(VARIANTS)} (must include "
                               "none; default: %(default)s)")  # fmt: skip
    overhead.add_argument("--threads", type=int, default=None,
                          help="torch CPU threads (default: torch's choice); 1 is steadier on "
                               "a machine shared with other work")  # fmt: skip
    overhead.add_argument("--time-canary", action="store_true",
                          help="also time the canary calls the engine makes in every step "
                               "(columns canary us/fwd and canary %%: median host time per "
                               "forward, and over the paired none step); the timers add "
                               "~0.3-1 us a call to the canary variants")  # fmt: skip
    overhead.add_argument("--schedule", default=_O.schedule,
                          help=f"{' | '.join(SCHEDULES)}. lockstep: the variants' engines "
                               "take turns step by step (the pairs closest in time; each step "
                               "finds the caches as the other engines left them); blocks: each "
                               "runs a whole case alone, order rotated every repeat (the caches "
                               "hold one engine, as in a deployment) (default: %(default)s)")  # fmt: skip
    overhead.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    overhead.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    overhead.set_defaults(func=_cmd_bench_overhead)

    engine = benches.add_parser(
        "engine", help="our engine vs transformers generate vs vLLM's CPU build (when its venv "
                       "is there): same checkpoint and prompts, batched greedy, interleaved, "
                       "outputs checked against transformers",
    )  # fmt: skip
    from kvcanary.bench.engine_vs_hf import EngineBenchSpec

    _B = EngineBenchSpec()
    engine.add_argument("--model", default=_B.model,
                        help="a builtin preset or a Qwen3 checkpoint directory (default: %(default)s)")
    engine.add_argument("--page-size", type=int, default=_B.page_size,
                        help="KV page size in tokens (default: %(default)s)")
    engine.add_argument("--batches", default=",".join(map(str, _B.batches)),
                        help="comma-separated batch sizes: prompts generated together "
                             "(default: %(default)s)")  # fmt: skip
    engine.add_argument("--input-len", type=int, default=_B.input_len,
                        help="max prompt length; prompts vary in [input_len/2, input_len] (default: %(default)s)")
    engine.add_argument("--output-len", type=int, default=_B.output_len,
                        help="new tokens per prompt (default: %(default)s)")
    engine.add_argument("--prefill-tokens", type=int, default=_B.prefill_tokens,
                        help="tokens per prefill forward in ours (chunked prefill) and in vLLM "
                             "(max_num_batched_tokens); transformers prefills a batch at once "
                             "(default: %(default)s, vLLM's CPU default)")  # fmt: skip
    engine.add_argument("--seed", type=int, default=_B.seed,
                        help="seeds the weights and the prompts (default: %(default)s)")
    engine.add_argument("--repeats", type=int, default=_B.repeats,
                        help="interleaved rounds; figures are medians (default: %(default)s)")
    engine.add_argument("--vllm-python", default=_B.vllm_python,
                        help="python of the vLLM venv; vLLM is skipped (with a note) when it is "
                             "missing (default: %(default)s)")  # fmt: skip
    engine.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads, here and in vLLM's worker (default: each its "
                             "own choice); 1 is steadier on a machine shared with other work")  # fmt: skip
    engine.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    engine.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    engine.set_defaults(func=_cmd_bench_engine)

    spec_bench = benches.add_parser(
        "spec", help="speculative decoding side by side: plain vs ngram vs draft models, each "
                     "with and without the canary, on repetitive and random prompts: tok/s, "
                     "speed-up, acceptance, outputs checked against plain greedy decoding",
        conflict_handler="resolve",  # --model is redefined below
    )  # fmt: skip
    add_engine_flags(spec_bench, with_canary=False, with_speculative=False)
    from kvcanary.bench.spec import WORKLOADS, SpecBenchSpec

    _S = SpecBenchSpec()
    spec_bench.add_argument("--model", default=_S.model,
                            help="the target model: builtin:<preset> or a HF model directory "
                                 "(default: %(default)s)")  # fmt: skip
    spec_bench.add_argument("--draft-models", default=",".join(_S.draft_models),
                            help="comma-separated draft models, one variant each; each must "
                                 "share the target's vocab size; '' for none (default: "
                                 "%(default)s: the target itself, every draft accepted, and a "
                                 "different model)")  # fmt: skip
    spec_bench.add_argument("--num-speculative-tokens", type=int, default=_S.num_speculative_tokens,
                            help="draft tokens per request and step (K) (default: %(default)s)")
    spec_bench.add_argument("--batch", type=int, default=_S.batch,
                            help="requests per workload (default: %(default)s)")
    spec_bench.add_argument("--input-len", type=int, default=_S.input_len,
                            help="prompt tokens per request (default: %(default)s)")
    spec_bench.add_argument("--output-len", type=int, default=_S.output_len,
                            help="new tokens per request (default: %(default)s)")
    spec_bench.add_argument("--repeats", type=int, default=_S.repeats,
                            help="repeats, new prompts each; figures are medians (default: %(default)s)")
    spec_bench.add_argument("--workloads", default=",".join(_S.workloads),
                            help=f"comma-separated subset of {', '.join(WORKLOADS)} (default: %(default)s)")
    spec_bench.add_argument("--no-canary", action="store_true",
                            help="skip the +canary variants (the canary's cost with speculation)")
    spec_bench.add_argument("--seed", type=int, default=_S.seed, help="prompt seed (default: %(default)s)")
    spec_bench.add_argument("--threads", type=int, default=None,
                            help="torch CPU threads (default: torch's choice)")
    spec_bench.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    spec_bench.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    spec_bench.set_defaults(func=_cmd_bench_spec)

    serve_bench = benches.add_parser(
        "serve", help="the HTTP server under N concurrent streams on loopback: TTFT and "
                      "inter-token latency p50/p99, tokens/s, errors, then leaked slots and "
                      "canary violations; exit 1 on any error, leak or violation",
    )  # fmt: skip
    add_engine_flags(serve_bench)
    _workload_flags(serve_bench)
    serve_bench.add_argument("--concurrency", type=int, default=64,
                             help="concurrent streaming requests (default: %(default)s)")
    serve_bench.add_argument("--deadline", type=float, default=600.0,
                             help="seconds for the whole load; requests unfinished by then "
                                  "are cut and count as errors (default: %(default)s)")
    serve_bench.add_argument("--threads", type=int, default=None,
                             help="torch CPU threads (default: torch's choice)")
    serve_bench.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    serve_bench.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    serve_bench.add_argument("--log-level", choices=("debug", "info", "warning"), default=None,
                             help="print kvcanary's log lines at this level to stderr")
    serve_bench.set_defaults(func=_cmd_bench_serve)

    soak = benches.add_parser(
        "soak", help="the HTTP server for a bounded time under N clients that misbehave "
                     "(disconnects at any moment, bad and oversized requests, n > 1, stop "
                     "strings, seeds, shared prefixes): latency p50/p99, resident memory "
                     "over time, then leaked slots and canary violations; exit 1 on an "
                     "unexpected answer, a leak, a violation or memory that keeps growing",
    )  # fmt: skip
    add_engine_flags(soak)
    soak.add_argument("--duration", type=float, default=600.0,
                      help="seconds of load (default: %(default)s)")
    soak.add_argument("--concurrency", type=int, default=8,
                      help="clients, each sending one request after another (default: %(default)s)")
    soak.add_argument("--max-tokens", type=int, default=24,
                      help="requests ask for 1 .. this many tokens (default: %(default)s)")
    soak.add_argument("--prompt-len", type=int, default=64,
                      help="prompts of 4 .. this many tokens (default: %(default)s)")
    soak.add_argument("--request-timeout", type=float, default=120.0,
                      help="a request unanswered after this many seconds is an error "
                           "(default: %(default)s)")  # fmt: skip
    soak.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                      help="resident memory may grow this much from the end of warm-up (a "
                           "fifth of the run) to the end (default: %(default)s)")  # fmt: skip
    soak.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads (default: torch's choice)")
    soak.add_argument("--json", metavar="OUT", help="also write the summary (with the memory "
                                                    "curve) as JSON to OUT")  # fmt: skip
    soak.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    soak.add_argument("--log-level", choices=("debug", "info", "warning"), default=None,
                      help="print kvcanary's log lines at this level to stderr")
    soak.set_defaults(func=_cmd_bench_soak)

    vllm_bench = benches.add_parser(
        "vllm", help="vLLM with and without the canary connector on one workload, side by "
                     "side (needs the vLLM venv: make test-vllm builds .venv-vllm)",
    )  # fmt: skip
    from kvcanary.integrations.vllm.bench import add_bench_vllm_flags

    add_bench_vllm_flags(vllm_bench)
    vllm_bench.set_defaults(func=_cmd_bench_vllm)

    prealloc = benches.add_parser(
        "prealloc", help="disaggregated decode: admitted concurrency with vs without SWA tail pre-allocation"
    )
    add_bench_prealloc_flags(prealloc)
    prealloc.set_defaults(func=_cmd_bench_prealloc)
    _describe_subcommands(parser)
    return parser


def _describe_subcommands(parser: argparse.ArgumentParser) -> None:
    """A subcommand's ``--help`` page opens with its one-line help (where it has no longer
    description of its own)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                sub.description = sub.description or helps.get(name)
                _describe_subcommands(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from kvcanary import envs
    from kvcanary.canary.errors import KVCanaryViolation
    from kvcanary.engine.errors import KVPoolTooSmallError

    try:
        envs.check_all()
        return int(args.func(args))
    except (ValueError, KVPoolTooSmallError) as e:  # bad input / sizes: one clear line
        print(f"kvcanary {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KVCanaryViolation as e:  # --kv-canary raise: the reports, no traceback
        print(f"kvcanary {args.command}: KV-canary violation (raise mode):\n{e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
