"""``kvcanary bench prealloc``: what SWA tail pre-allocation buys the decode side.

Fixed decode pools (a full pool large enough not to be the bound, a small SWA pool) and
long prompts (``L >> W``); for tail pre-allocation on and off, side by side in one run:

* ``admitted_at_once``: requests the decode side pre-allocates concurrently into idle
  pools (the admission decision alone, no model work);
* a run of the same workload through an in-process prefill + decode pair in which the
  decode side is the only bottleneck: the concurrency it reached, its decode throughput
  (decode tokens per second of decode forwards), mean decode batch, decode forwards.

The expected admission ratio is about ``L / (W + P)``: without the tail path a request is
charged ``ceil_page(L)`` SWA tokens, with it ``ceil_page(W + (L - W) mod P) <= W + P``
(both plus the decode reserve).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.disagg.cluster import InProcessDisagg
from kvcanary.disagg.config import DisaggConfig
from kvcanary.disagg.prealloc import DecodePreallocQueue
from kvcanary.disagg.protocol import DisaggOutput
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import Req
from kvcanary.model import load_model_config
from kvcanary.utils import ceil_page, show

TARGET_FRACTION = 0.8  # of L / (W + P), when the full pool is not the bound


def _admitted_at_once(config: EngineConfig, disagg: DisaggConfig, prompts: list[list[int]],
                      params: SamplingParams) -> dict[str, Any]:  # fmt: skip
    """Pre-allocate into idle pools until admission stops; then give everything back."""
    engine = Engine(config)
    queue = DecodePreallocQueue(engine.kv, engine.scheduler, disagg)
    queue.queue.extend(Req(rid=i + 1, prompt_ids=p, params=params) for i, p in enumerate(prompts))
    admitted = queue.pop_preallocated()
    charge = queue._prealloc_required_tokens(admitted[0]) if admitted else (0, 0)
    for req in admitted:
        queue.release(req)
    engine.check_integrity()
    return {
        "tail_prealloc": queue.tail_mode,
        "admitted_at_once": len(admitted),
        "bound_by": queue.last_rejection or "none (ran out of requests)",
        "full_tokens_charged_per_request": charge[0],
        "swa_tokens_charged_per_request": charge[1],
    }


def _decode_bound_run(prefill: EngineConfig, decode: EngineConfig, disagg: DisaggConfig,
                      prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:  # fmt: skip
    """Run the workload with the decode side as the only bottleneck: before every decode
    step the prefill side delivers everything the decode side admits (both share this
    process, so a plain alternation would let prefill speed set the decode batch)."""
    pair = InProcessDisagg(prefill, decode, disagg)
    decode_worker, prefill_worker = pair.decode, pair.prefill
    for p in prompts:
        decode_worker.submit(p, params)
    outs: list[DisaggOutput] = []
    t0 = time.perf_counter()
    while len(outs) < len(prompts):
        while decode_worker.poll(step=False) | prefill_worker.poll():
            pass
        decode_worker.poll()
        outs += decode_worker.take_outputs()
    wall = time.perf_counter() - t0
    reports = pair.shutdown()
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"bench prealloc: {len(failed)} requests failed: {failed[0].error}")
    dec = reports["decode"]
    st = dec["stats"]
    return {
        "peak_concurrent": dec["peak_admitted"],
        "decode_tokens_per_s": st["num_decode_tokens"] / st["decode_time_s"] if st["decode_time_s"] else 0.0,
        "mean_decode_batch": st["num_decode_tokens"] / max(st["num_decode_forwards"], 1),
        "decode_forwards": st["num_decode_forwards"],
        "wall_time_s": wall,
        "memory_free": dec["memory_free"] and reports["prefill"]["memory_free"],
    }


def bench_prealloc(
    model: str = "builtin:tiny-swa",
    page_size: int = 4,
    input_len: int = 1024,
    output_len: int = 64,
    num_requests: int = 64,
    swa_pool_tokens: int = 2048,
    full_pool_tokens: int = 0,
    disagg: DisaggConfig | None = None,
    seed: int = 0,
    measure_throughput: bool = True,
) -> dict[str, Any]:
    """Both modes on the same pools and prompts; a flat dict of figures (stable keys)."""
    disagg = disagg or DisaggConfig(transfer_backend="inproc")
    mc = load_model_config(model)
    window = next((mc.window_of(i) for i in mc.swa_layer_ids), None)
    if window is None:
        raise ValueError(f"--model={show(model)} has no sliding-window layers; bench prealloc needs one")
    if input_len <= window:
        raise ValueError(f"--input-len={input_len} is invalid: allowed values > the window ({window})")
    for flag, value in (("--num-requests", num_requests), ("--swa-pool-tokens", swa_pool_tokens),
                        ("--output-len", output_len)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{flag}={show(value)} is invalid: allowed an integer >= 1")
    reserve = disagg.num_reserved_decode_tokens
    # More prompts than the SWA pool can admit with the tail path (a request is charged at
    # least ceil_page(W) + reserve), and a full pool with room for all of them.
    max_admits = max(num_requests, swa_pool_tokens // (ceil_page(window, page_size) + reserve) + 2)
    full_pool_tokens = full_pool_tokens or max_admits * (
        ceil_page(input_len + output_len, page_size) + reserve
    )
    rng = random.Random(seed)
    vocab = min(mc.vocab_size, 256)
    prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(max_admits)]
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    decode = EngineConfig(
        model=model, page_size=page_size, max_total_tokens=full_pool_tokens,
        # +0.5: the pool floors full * ratio, which must not round below swa_pool_tokens
        swa_full_tokens_ratio=(swa_pool_tokens + 0.5) / full_pool_tokens, enable_prefix_cache=False,
        max_running_requests=max_admits + 1, max_context_len=input_len + output_len + page_size,
        seed=seed,
    )  # fmt: skip
    prefill = dataclasses.replace(decode, swa_full_tokens_ratio=1.0)
    out: dict[str, Any] = {
        "model": model,
        "page_size": page_size,
        "sliding_window": window,
        "input_len": input_len,
        "output_len": output_len,
        "num_requests": num_requests,
        "full_pool_tokens": full_pool_tokens,
        "swa_pool_tokens": swa_pool_tokens,
        "num_reserved_decode_tokens": reserve,
        "l_over_w_plus_p": input_len / (window + page_size),
    }
    for name, tail in (("tail", True), ("no_tail", False)):
        mode = dataclasses.replace(disagg, swa_tail_prealloc=tail)
        figures = _admitted_at_once(decode, mode, prompts, params)
        if measure_throughput:
            figures |= _decode_bound_run(prefill, decode, mode, prompts[:num_requests], params)
        out |= {f"{name}_{k}": v for k, v in figures.items()}
    ratio = out["tail_admitted_at_once"] / max(out["no_tail_admitted_at_once"], 1)
    out["admitted_ratio"] = ratio
    out["admitted_ratio_over_l_over_w_plus_p"] = ratio / out["l_over_w_plus_p"]
    out["target_met"] = out["tail_bound_by"] == "full" or ratio >= TARGET_FRACTION * out["l_over_w_plus_p"]
    if measure_throughput:
        out["decode_throughput_ratio"] = out["tail_decode_tokens_per_s"] / max(
            out["no_tail_decode_tokens_per_s"], 1e-9
        )
    return out
