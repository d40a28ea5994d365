"""Command-line entry points of disaggregation, for ``kvcanary.cli.command`` to wire in::

    run = sub.add_parser("run", ...); ...; add_disagg_run_flags(run)
    _cmd_run: if a.disagg: summary = run_disagg(a)        # instead of run_workload(...)
    prealloc = benches.add_parser("prealloc", ...); add_bench_prealloc_flags(prealloc)
    _cmd_bench_prealloc: summary = cmd_bench_prealloc(a)  # then print / --json as usual

Defaults come from :class:`~.config.DisaggConfig` and the bench's signature.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from kvcanary.config import EngineConfig, SamplingParams, SpeculativeConfig
from kvcanary.disagg.config import DIST_BACKENDS, TRANSFER_BACKENDS, DisaggConfig
from kvcanary.engine.args import engine_config_from_args
from kvcanary.utils import show

_D = DisaggConfig()


def add_disagg_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--disagg", action="store_true",
                   help="run a prefill worker and a decode worker (two processes) instead of "
                        "one engine; KV, SWA window state and canary records travel between "
                        "them")  # fmt: skip
    g.add_argument("--disagg-transfer-backend", default=_D.transfer_backend,
                   choices=TRANSFER_BACKENDS,
                   help="torch: two processes over torch.distributed; inproc: both workers in "
                        "this process (default: %(default)s)")  # fmt: skip
    g.add_argument("--disagg-dist-backend", default=_D.dist_backend, choices=DIST_BACKENDS,
                   help="KV data channel: auto = gloo on CPU, nccl on CUDA (default: %(default)s)")
    g.add_argument("--disagg-master-addr", default=_D.master_addr,
                   help="rendezvous address (default: %(default)s, loopback)")
    g.add_argument("--disagg-master-port", type=int, default=_D.master_port,
                   help="rendezvous port, 0 = pick a free one (default: %(default)s)")
    g.add_argument("--disagg-transfer-timeout", type=float, default=_D.transfer_timeout_s,
                   help="seconds a request may wait for its KV before it fails (default: %(default)s)")
    _reserve_flag(g)
    g.add_argument("--disable-swa-tail-prealloc", action="store_true",
                   help="pre-allocate the whole sequence in the SWA pool, not only the window tail")
    g.add_argument("--decode-max-total-tokens", type=int, default=None,
                   help="decode side's full pool (default: --max-total-tokens)")
    g.add_argument("--decode-swa-full-tokens-ratio", type=float, default=None,
                   help="decode side's SWA / full pool ratio (default: --swa-full-tokens-ratio)")


def _reserve_flag(g: Any) -> None:
    g.add_argument("--num-reserved-decode-tokens", type=int, default=_D.num_reserved_decode_tokens,
                   help="decode admission keeps this many tokens per active request for decode "
                        "growth (default: %(default)s)")  # fmt: skip


def disagg_config_from_args(a: argparse.Namespace) -> DisaggConfig:
    return DisaggConfig(
        transfer_backend=getattr(a, "disagg_transfer_backend", _D.transfer_backend),
        dist_backend=getattr(a, "disagg_dist_backend", _D.dist_backend),
        master_addr=getattr(a, "disagg_master_addr", _D.master_addr),
        master_port=getattr(a, "disagg_master_port", _D.master_port),
        transfer_timeout_s=getattr(a, "disagg_transfer_timeout", _D.transfer_timeout_s),
        num_reserved_decode_tokens=a.num_reserved_decode_tokens,
        swa_tail_prealloc=not a.disable_swa_tail_prealloc,
    )


def run_disagg(a: argparse.Namespace, config: EngineConfig | None = None) -> dict[str, Any]:
    """``kvcanary run --disagg``: the workload through a prefill and a decode worker; the
    summary (stable JSON keys). ``config``: the prefill side's engine config (default: from
    the ``run`` flags); the decode side differs only by the ``--decode-*`` pool sizes."""
    from tqdm import tqdm

    from kvcanary.disagg.cluster import DisaggCluster, InProcessDisagg
    from kvcanary.model import load_model_config
    from kvcanary.workload import WorkloadSpec, make_prompts

    if config is None:
        config = engine_config_from_args(a)
    disagg = disagg_config_from_args(a)
    decode = dataclasses.replace(
        config,
        max_total_tokens=a.decode_max_total_tokens or config.max_total_tokens,
        swa_full_tokens_ratio=a.decode_swa_full_tokens_ratio or config.swa_full_tokens_ratio,
    )
    spec = WorkloadSpec.from_flags(a.num_requests, a.input_len, a.output_len, a.shared_prefix_len, a.seed)
    prompts = make_prompts(spec, load_model_config(config.model).vocab_size)
    params = SamplingParams(max_new_tokens=spec.output_len, ignore_eos=True)
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=getattr(a, "no_progress", False))
    driver = InProcessDisagg if disagg.transfer_backend == "inproc" else DisaggCluster
    # The prefill side computes each request's first token only: it never decodes, so it
    # loads no draft model (speculative decoding runs on the decode side).
    prefill = dataclasses.replace(config, speculative=SpeculativeConfig())
    with driver(prefill, decode, disagg) as pair:
        t0 = time.perf_counter()  # workers are up: time the workload only
        outs = pair.generate(prompts, params, on_outputs=lambda done: bar.update(len(done)))
        wall = time.perf_counter() - t0
        reports = pair.shutdown()
    bar.close()
    return summarize_disagg(config, disagg, outs, wall, reports)


def summarize_disagg(config: EngineConfig, disagg: DisaggConfig, outs: list[Any], wall_s: float,
                     reports: dict[str, dict[str, Any] | None]) -> dict[str, Any]:  # fmt: skip
    pre, dec = reports.get("prefill") or {}, reports.get("decode") or {}
    pst, dst = pre.get("stats", {}), dec.get("stats", {})
    failed = [o for o in outs if o.finish_reason == "error"]

    def canary(rep: dict[str, Any], key: str, which: str = "canary") -> Any:
        c = rep.get(which) or {}
        return c.get("stats", {}).get(key, 0)

    out_tokens = sum(len(o.output_ids) for o in outs)
    return {
        "model": config.model,
        "page_size": config.page_size,
        "kv_canary": config.canary.mode,
        "disagg_transfer_backend": disagg.transfer_backend,
        "swa_tail_prealloc": dec.get("tail_prealloc", False),
        "requests": len(outs),
        "failed_requests": len(failed),
        "first_error": failed[0].error if failed else None,
        "prompt_tokens": sum(len(o.prompt_ids) for o in outs),
        "output_tokens": out_tokens,
        "wall_time_s": wall_s,
        "output_tokens_per_s": out_tokens / wall_s if wall_s else 0.0,
        "prefill_tokens_per_s": pst["num_prefill_tokens"] / pst["prefill_time_s"] if pst.get("prefill_time_s") else 0.0,
        "decode_tokens_per_s": dst["num_decode_tokens"] / dst["decode_time_s"] if dst.get("decode_time_s") else 0.0,
        "transfers": dec.get("transfers", 0),
        "transfer_bytes": dec.get("transfer_bytes", 0),
        "decode_peak_concurrent": dec.get("peak_admitted", 0),
        "decode_retractions": dst.get("num_retractions", 0),
        "decode_prefix_cache_hit_tokens": dst.get("num_cached_prompt_tokens", 0),
        "prefill_canary_violations": canary(pre, "violations"),
        "decode_canary_violations": canary(dec, "violations"),
        "prefill_canary_protected_tokens": canary(pre, "protected_tokens"),
        "decode_canary_protected_tokens": canary(dec, "protected_tokens"),
        # Speculative decoding (the decode side; zeros when off).
        "speculative_method": config.speculative.method,
        "decode_spec_draft_tokens": dst.get("spec_num_proposed", 0),
        "decode_spec_accepted_tokens": dst.get("spec_num_accepted", 0),
        "decode_draft_canary_violations": canary(dec, "violations", "draft_canary"),
        "decode_draft_canary_protected_tokens": canary(dec, "protected_tokens", "draft_canary"),
        "prefill_integrity_ok": pre.get("integrity_ok", False),
        "decode_integrity_ok": dec.get("integrity_ok", False),
        "prefill_memory_free": pre.get("memory_free", False),
        "decode_memory_free": dec.get("memory_free", False),
    }


def add_bench_prealloc_flags(p: argparse.ArgumentParser) -> None:
    import inspect

    from kvcanary.disagg.bench import bench_prealloc

    d = {k: v.default for k, v in inspect.signature(bench_prealloc).parameters.items()}
    p.add_argument("--model", default=d["model"], help="a model with sliding-window layers (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=d["page_size"], help="KV page size in tokens (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=d["input_len"],
                   help="prompt length L, >> the window (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=d["output_len"], help="new tokens per request (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=d["num_requests"],
                   help="requests in the throughput run (default: %(default)s)")
    p.add_argument("--swa-pool-tokens", type=int, default=d["swa_pool_tokens"],
                   help="decode SWA pool size (default: %(default)s)")
    p.add_argument("--full-pool-tokens", type=int, default=d["full_pool_tokens"],
                   help="decode full pool size, 0 = large enough not to be the bound (default: %(default)s)")
    _reserve_flag(p)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"], help="seeds the weights and the workload (default: %(default)s)")
    p.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")


def cmd_bench_prealloc(a: argparse.Namespace) -> dict[str, Any]:
    """``kvcanary bench prealloc``: the summary dict (the caller prints / writes JSON)."""
    import torch

    from kvcanary.disagg.bench import bench_prealloc

    if a.threads < 1:
        raise ValueError(f"--threads={show(a.threads)} is invalid: allowed an integer >= 1")
    torch.set_num_threads(a.threads)
    disagg = DisaggConfig(
        transfer_backend="inproc",
        num_reserved_decode_tokens=a.num_reserved_decode_tokens,
        swa_tail_prealloc=True,  # the bench runs both modes itself
    )
    return bench_prealloc(
        model=a.model, page_size=a.page_size, input_len=a.input_len, output_len=a.output_len,
        num_requests=a.num_requests, swa_pool_tokens=a.swa_pool_tokens,
        full_pool_tokens=a.full_pool_tokens, disagg=disagg, seed=a.seed,
    )  # fmt: skip
