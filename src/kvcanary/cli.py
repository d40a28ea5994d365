"""Command line: ``kvcanary run | bench | selftest | explain | serve``.

Defaults come from the config dataclasses; bad values are rejected before anything starts,
with the flag, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvcanary.config import KV_CANARY_MODES, EngineConfig
from kvcanary.workload import WorkloadSpec

_E = EngineConfig.field_default
_W = WorkloadSpec()


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_E("model"),
                   help="builtin:tiny-swa | builtin:tiny-mha | path to a HF model directory (default: %(default)s)")
    p.add_argument("--kv-canary", default=_E("kv_canary"), choices=KV_CANARY_MODES,
                   help="KV-canary mode (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=_E("page_size"), help="KV page size in tokens (default: %(default)s)")
    p.add_argument("--max-total-tokens", type=int, default=_E("max_total_tokens"),
                   help="full KV pool size in tokens (default: %(default)s)")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=_E("swa_full_tokens_ratio"),
                   help="SWA pool size / full pool size (default: %(default)s)")
    p.add_argument("--chunked-prefill-size", type=int, default=_E("chunked_prefill_size"),
                   help="max tokens per prefill forward, <= 0 disables chunking (default: %(default)s)")
    p.add_argument("--max-running-requests", type=int, default=_E("max_running_requests"),
                   help="(default: %(default)s)")
    p.add_argument("--disable-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    p.add_argument("--enable-host-offload", action="store_true",
                   help="retracted requests keep their KV in host memory instead of recomputing it")
    p.add_argument("--disable-graph", action="store_true", help="decode without the static-shape graph runner")
    p.add_argument("--device", default=_E("device"), help="torch device (default: %(default)s)")
    p.add_argument("--seed", type=int, default=_E("seed"), help="(default: %(default)s)")


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model,
        kv_canary=a.kv_canary,
        page_size=a.page_size,
        max_total_tokens=a.max_total_tokens,
        swa_full_tokens_ratio=a.swa_full_tokens_ratio,
        chunked_prefill_size=a.chunked_prefill_size,
        max_running_requests=a.max_running_requests,
        enable_prefix_cache=not a.disable_prefix_cache,
        enable_host_offload=a.enable_host_offload,
        graph_batch_sizes=() if a.disable_graph else _E("graph_batch_sizes"),
        device=a.device,
        seed=a.seed,
    )


def _workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=_W.num_requests, help="(default: %(default)s)")
    p.add_argument("--input-len", type=int, default=_W.input_len,
                   help="max prompt length; prompts vary in [input_len/2, input_len] (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=_W.output_len, help="new tokens per request (default: %(default)s)")
    p.add_argument("--shared-prefix-len", type=int, default=_W.shared_prefix_len,
                   help="tokens every prompt shares (default: %(default)s)")


def _cmd_run(a: argparse.Namespace) -> int:
    from kvcanary.report import render_table, write_json
    from kvcanary.run import run_workload

    spec = WorkloadSpec(a.num_requests, a.input_len, a.output_len, a.shared_prefix_len, a.seed)
    summary, _ = run_workload(_engine_config(a), spec, progress=not a.no_progress)
    print(render_table("kvcanary run", summary))
    if a.json:
        write_json(a.json, summary)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcanary", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the engine on a synthetic workload and print a summary")
    _engine_flags(run)
    _workload_flags(run)
    run.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.set_defaults(func=_cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"kvcanary {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
