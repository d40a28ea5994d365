"""``kvcanary bench serve``: the HTTP server under a bounded streaming load, on loopback.

One process: the server (uvicorn in a thread, the engine loop in another) and the load
generator (asyncio + httpx in the main thread)::

    load generator ── N concurrent streams ──▶ POST /v1/completions (stream) ──▶ engine loop
      fixed request count, an overall deadline; per request: TTFT (send -> first token)
      and the gaps between token-carrying chunks (inter-token latency)

A first, untimed request warms the server up. After the load the engine must be idle and whole: the allocator's and the pools' integrity
checks pass, and once the prefix cache lets go of what it keeps, every full / SWA slot and
req->token row is free again (``leaked_*`` count what is not). With ``--kv-canary`` the
canary's violation count is reported too. The exit status is 1 when a request failed, a slot
leaked, the canary saw a violation or the engine loop died (``engine_loop_error``).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from kvcanary.config import EngineConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.pool_check import check_engine_pools, check_workload
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.server.app import create_app
from kvcanary.server.background import background_server
from kvcanary.server.engine_loop import EngineLoopStopped
from kvcanary.workload import WorkloadSpec, make_prompts

WARMUP_TIMEOUT_S = 600.0  # the first request pays one-off costs (kernel compilation)


class BenchServeError(RuntimeError):
    """The server could not be benchmarked at all (its warm-up request failed)."""


@dataclass(slots=True)
class RequestTiming:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str | None = None


def _percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (nearest rank) of ``values``; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int,
               bar: tqdm) -> RequestTiming:  # fmt: skip
    timing = RequestTiming()
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True}
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                timing.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return timing
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    timing.error = str(event["error"].get("message"))
                    return timing
                num_new = sum(len(c.get("token_ids", ())) for c in event.get("choices", ()))
                if not num_new:
                    continue
                now = time.perf_counter()
                if timing.ttft_s is None:
                    timing.ttft_s = now - t0
                else:
                    timing.gaps_s.append(now - last)
                last = now
                timing.num_tokens += num_new
                bar.update(num_new)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        timing.error = f"{type(e).__name__}: {e}"
    if timing.error is None and timing.num_tokens != output_len:
        timing.error = f"got {timing.num_tokens} tokens, expected {output_len}"
    return timing


async def _load(url: str, prompts: list[list[int]], output_len: int, concurrency: int,
                deadline_s: float, bar: tqdm) -> tuple[list[RequestTiming], float]:  # fmt: skip
    """Every prompt once, at most ``concurrency`` at a time; what is unfinished at the
    deadline is cancelled and counted as an error."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[RequestTiming] = [RequestTiming(error="not started before the deadline")
                                    for _ in prompts]  # fmt: skip
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(deadline_s)) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = RequestTiming(error="cut by the deadline")
                results[i] = await _one(client, url, prompts[i], output_len, bar)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return results, time.perf_counter() - t0


def warm_up(url: str, prompt: list[int]) -> None:
    """One untimed request (kernel compilation, first allocations); BenchServeError when
    it fails."""
    try:
        warm = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                          timeout=WARMUP_TIMEOUT_S)  # fmt: skip
    except httpx.HTTPError as e:
        raise BenchServeError(f"the warm-up request failed: {type(e).__name__}: {e}") from None
    if warm.status_code != 200:
        raise BenchServeError(f"the warm-up request failed: HTTP {warm.status_code}: {warm.text[:300]}")


def _memory_report(engine: Engine) -> dict[str, Any]:
    """Run in the engine loop's thread once the load is over (see the module doc)."""
    running, waiting = engine.queue_lengths()
    ok = engine.check_integrity()
    if engine.prefix_cache is not None:
        if running + waiting:  # (a dead loop's requests keep their prefixes locked)
            engine.prefix_cache.evict(1 << 40, 1 << 40)
        else:
            engine.prefix_cache.free_all()
    alloc = engine.runner.allocator
    rows = engine.runner.req_to_token_pool
    if isinstance(alloc, SWAAllocator):
        leaked_full = alloc.size_full - alloc.full_available_size()
        leaked_swa = alloc.size_swa - alloc.swa_available_size()
    else:
        leaked_full, leaked_swa = alloc.size - alloc.available_size(), 0
    ok = ok and engine.check_integrity()
    canary = engine.canary.stats() if engine.canary is not None else {}
    return {
        "unfinished_after_load": running + waiting,
        "integrity_check": "pass" if ok else "FAIL",
        "leaked_full_slots": leaked_full,
        "leaked_swa_slots": leaked_swa,
        "leaked_req_rows": rows.size - rows.available_size(),
        "canary_protected_tokens": canary.get("protected_tokens", 0),
        "canary_violations": canary.get("violations", 0),
    }


def bench_serve(config: EngineConfig, spec: WorkloadSpec, *, concurrency: int, deadline_s: float,
                progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Serve ``config`` on loopback, run ``spec``'s requests through ``concurrency``
    streams, report latencies, throughput, errors and the memory/canary checks."""
    if concurrency < 1:
        raise ValueError(f"--concurrency={concurrency} is invalid: allowed an integer >= 1")
    if not deadline_s > 0:
        raise ValueError(f"--deadline={deadline_s} is invalid: allowed a number of seconds > 0")
    check_workload(config, spec)
    engine = Engine(config)
    prompts = make_prompts(spec, engine.runner.vocab_size)
    check_engine_pools(engine, map(len, prompts), spec.output_len)
    app = create_app(engine, max_queued_requests=concurrency)
    loop = app.state.engine_loop
    bar = tqdm(total=len(prompts) * spec.output_len, desc="tokens", unit="tok", unit_scale=True,
               disable=not progress)  # fmt: skip
    with background_server(app) as url:
        # One request first, untimed: one-off costs (kernel compilation, first allocations)
        # would otherwise land in the first requests' TTFT.
        warm_up(url, prompts[0])
        results, wall_s = asyncio.run(_load(url, prompts, spec.output_len, concurrency, deadline_s, bar))
        bar.close()
        memory = _wait_idle_then(loop, engine)
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [g * 1e3 for r in ok for g in r.gaps_s]
    num_tokens = sum(r.num_tokens for r in results)
    return {
        "model": config.model,
        "kv_canary": config.canary.mode,
        "requests": len(results),
        "concurrency": concurrency,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "wall_time_s": wall_s,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / wall_s if wall_s else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "ttft_p50_ms": _percentile(ttft, 0.50),
        "ttft_p99_ms": _percentile(ttft, 0.99),
        "itl_p50_ms": _percentile(itl, 0.50),
        "itl_p99_ms": _percentile(itl, 0.99),
        "itl_mean_ms": statistics.fmean(itl) if itl else 0.0,
        **memory,
    }


def _wait_idle_then(loop: Any, engine: Engine, timeout_s: float = 30.0) -> dict[str, Any]:
    """The memory report once the engine has nothing left (aborts of cut requests land a
    step after their disconnect)."""
    deadline = time.monotonic() + timeout_s
    while loop.alive and time.monotonic() < deadline:
        try:
            if loop.call(engine.queue_lengths).result(timeout_s) == (0, 0):
                break
        except EngineLoopStopped:
            break
        time.sleep(0.05)
    error = f"{type(loop.error).__name__}: {loop.error}" if loop.error is not None else ""
    try:
        report: dict[str, Any] = loop.call(lambda: _memory_report(engine)).result(timeout_s)
    except EngineLoopStopped:  # a dead loop's engine is idle for good: read it from here
        report = _memory_report(engine)
    return {**report, "engine_loop_error": error}


def memory_ok(summary: dict[str, Any]) -> bool:
    """The after-load checks of :func:`_wait_idle_then`'s report all passed."""
    return (not summary["engine_loop_error"] and summary["integrity_check"] == "pass"
            and summary["leaked_full_slots"] == summary["leaked_swa_slots"] == 0
            and summary["leaked_req_rows"] == 0 and summary["canary_violations"] == 0
            and summary["unfinished_after_load"] == 0)  # fmt: skip


def bench_ok(summary: dict[str, Any]) -> bool:
    return summary["errors"] == 0 and memory_ok(summary)
