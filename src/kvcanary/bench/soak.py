"""``kvcanary bench soak``: the HTTP server for a bounded time under clients that misbehave.

One process, as ``bench serve`` (:mod:`.serve`): the server on loopback, and ``N`` client
tasks that, until the duration is up, each send one request after another, of a kind drawn
at random (seeded)::

    stream       streamed completion (half of them with usage), checked to the [DONE]
    plain        plain completion
    chat         chat completion, streamed or not
    n2           n = 2 (two copies sharing the prompt's KV)
    stop         a stop string (a few characters of the prompt's own text)
    seeded       sampled (temperature 0.8) with a seed
    shared       a prompt that starts with one of a few shared prefixes
    disconnect   streamed; the client goes away after 0..3 chunks (0: before the first token)
    walkaway     plain; the client gives up after a random fraction of a second
    invalid      a bad field (max_tokens 0, temperature true, or a body that is not JSON): 400
    oversized    a prompt longer than the context: 400

Every request must end as its kind expects: answered (200, a finish reason, at most
``max_tokens`` tokens a copy), refused with its 400, or, for the two kinds that leave,
left. Anything else (a 5xx, a 503, a wrong status, a hang past the request timeout) is an
error. Resident memory (``/proc/self/statm``) is sampled every ``rss_interval_s``: the
report gives it at the start, after warm-up (``warmup_fraction`` of the run) and at the end,
with the curve. Once the load is over the engine must go idle and whole (the memory checks
of :mod:`.serve`: integrity, and every full / SWA slot and req->token row free once the
prefix cache lets go) and, with ``--kv-canary``, the canary must have seen no violation.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from kvcanary.bench.serve import _percentile, _wait_idle_then, memory_ok, warm_up
from kvcanary.config import EngineConfig
from kvcanary.engine.engine import Engine
from kvcanary.server.app import create_app
from kvcanary.server.background import background_server

KINDS: dict[str, int] = {  # kind -> weight
    "stream": 4, "plain": 3, "chat": 2, "n2": 1, "stop": 1, "seeded": 1, "shared": 3,
    "disconnect": 2, "walkaway": 1, "invalid": 1, "oversized": 1,
}  # fmt: skip
_LEAVING = ("disconnect", "walkaway")


@dataclass(slots=True)
class SoakConfig:
    duration_s: float = 600.0
    concurrency: int = 8
    max_tokens: int = 24  # per request (drawn from 1 .. max_tokens)
    prompt_len: int = 64  # prompts of 4 .. prompt_len tokens
    seed: int = 0
    request_timeout_s: float = 120.0  # a request still open after this is an error (a hang)
    rss_interval_s: float = 1.0
    warmup_fraction: float = 0.2
    max_rss_growth_mib: float = 64.0  # after warm-up, to the end

    def check(self) -> None:
        for name, value, ok, allowed in (
            ("--duration", self.duration_s, self.duration_s > 0, "a number of seconds > 0"),
            ("--concurrency", self.concurrency, self.concurrency >= 1, "an integer >= 1"),
            ("--max-tokens", self.max_tokens, self.max_tokens >= 1, "an integer >= 1"),
            ("--prompt-len", self.prompt_len, self.prompt_len >= 4, "an integer >= 4"),
            ("--request-timeout", self.request_timeout_s, self.request_timeout_s > 0,
             "a number of seconds > 0"),
            ("--max-rss-growth-mib", self.max_rss_growth_mib, self.max_rss_growth_mib >= 0,
             "a number >= 0"),
        ):  # fmt: skip
            if not ok:
                raise ValueError(f"{name}={value} is invalid: allowed {allowed}")


@dataclass(slots=True)
class Outcome:
    kind: str
    result: str  # "answered" | "refused" | "left" | "error"
    latency_s: float
    detail: str = ""


@dataclass(slots=True)
class _RssSampler:
    interval_s: float
    samples: list[tuple[float, float]] = field(default_factory=list)  # (t since start, MiB)
    _stop: threading.Event = field(default_factory=threading.Event)
    t0: float = 0.0  # monotonic start

    def start(self) -> None:
        self.t0 = time.monotonic()
        threading.Thread(target=self._run, name="kvcanary-soak-rss", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self.t0, rss_mib()))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self.samples.append((time.monotonic() - self.t0, rss_mib()))


def rss_mib() -> float:
    """This process's resident memory in MiB (0 where ``/proc`` is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except (OSError, ValueError, IndexError):
        return 0.0


class _Client:
    """One client task's request maker (its own seeded RNG)."""

    def __init__(self, cfg: SoakConfig, url: str, http: httpx.AsyncClient, rng: random.Random,
                 vocab: int, context_len: int, prefixes: list[list[int]]) -> None:  # fmt: skip
        self.cfg, self.url, self.http, self.rng = cfg, url, http, rng
        self.vocab, self.context_len, self.prefixes = vocab, context_len, prefixes

    def _prompt(self) -> list[int]:
        n = self.rng.randint(4, self.cfg.prompt_len)
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _body(self, **extra: Any) -> dict[str, Any]:
        return {"prompt": self._prompt(), "max_tokens": self.rng.randint(1, self.cfg.max_tokens),
                "ignore_eos": True, **extra}  # fmt: skip

    async def one(self, kind: str) -> Outcome:
        t0 = time.perf_counter()
        try:
            result, detail = await asyncio.wait_for(getattr(self, "_" + kind)(),
                                                    self.cfg.request_timeout_s)  # fmt: skip
        except TimeoutError:
            result, detail = "error", f"no answer within {self.cfg.request_timeout_s} s"
        except httpx.HTTPError as e:
            result, detail = "error", f"{type(e).__name__}: {e}"
        return Outcome(kind, result, time.perf_counter() - t0, detail)

    # ---- kinds: each returns (result, detail)
    async def _post(self, path: str, body: Any) -> httpx.Response:
        if isinstance(body, bytes):
            return await self.http.post(self.url + path, content=body,
                                        headers={"Content-Type": "application/json"})  # fmt: skip
        return await self.http.post(self.url + path, json=body)

    @staticmethod
    def _answered(r: httpx.Response, copies: int, max_tokens: int) -> tuple[str, str]:
        if r.status_code != 200:
            return "error", f"HTTP {r.status_code}: {r.text[:200]}"
        data = r.json()
        choices, usage = data.get("choices", []), data.get("usage") or {}
        if len(choices) != copies or any(c.get("finish_reason") not in ("length", "stop") for c in choices):
            return "error", f"unexpected choices: {json.dumps(choices)[:200]}"
        if usage.get("completion_tokens", 0) > copies * max_tokens:
            return "error", f"{usage['completion_tokens']} tokens > {copies} x {max_tokens}"
        return "answered", ""

    async def _plain(self) -> tuple[str, str]:
        body = self._body()
        return self._answered(await self._post("/v1/completions", body), 1, body["max_tokens"])

    async def _seeded(self) -> tuple[str, str]:
        body = self._body(temperature=0.8, seed=self.rng.randrange(1 << 30))
        return self._answered(await self._post("/v1/completions", body), 1, body["max_tokens"])

    async def _n2(self) -> tuple[str, str]:
        body = self._body(n=2, temperature=0.7, seed=self.rng.randrange(1 << 30))
        return self._answered(await self._post("/v1/completions", body), 2, body["max_tokens"])

    async def _shared(self) -> tuple[str, str]:
        body = self._body()
        body["prompt"] = self.rng.choice(self.prefixes) + body["prompt"][: self.rng.randint(1, 8)]
        return self._answered(await self._post("/v1/completions", body), 1, body["max_tokens"])

    async def _stop(self) -> tuple[str, str]:
        body = self._body(prompt="the quick brown fox jumps over the lazy dog", stop=["o", "e "])
        return self._answered(await self._post("/v1/completions", body), 1, body["max_tokens"])

    async def _chat(self) -> tuple[str, str]:
        mt = self.rng.randint(1, self.cfg.max_tokens)
        body = {"messages": [{"role": "user", "content": f"hello {self.rng.randrange(1000)}"}],
                "max_tokens": mt, "ignore_eos": True}  # fmt: skip
        if self.rng.random() < 0.5:
            return self._answered(await self._post("/v1/chat/completions", body), 1, mt)
        return await self._read_stream("/v1/chat/completions", {**body, "stream": True}, mt, None)

    async def _stream(self) -> tuple[str, str]:
        body = self._body(stream=True)
        if self.rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return await self._read_stream("/v1/completions", body, body["max_tokens"], None)

    async def _disconnect(self) -> tuple[str, str]:
        body = self._body(stream=True, max_tokens=self.cfg.max_tokens)
        chunks = self.rng.randint(0, 3)
        if chunks == 0:  # before the first token: the response has not started yet
            try:
                await asyncio.wait_for(self._post("/v1/completions", body), self.rng.uniform(0.0, 0.2))
            except TimeoutError:
                return "left", "before the first token"
            return "left", "answered before the client left"
        return await self._read_stream("/v1/completions", body, body["max_tokens"], chunks)

    async def _walkaway(self) -> tuple[str, str]:
        body = self._body(max_tokens=self.cfg.max_tokens)
        try:
            await asyncio.wait_for(self._post("/v1/completions", body), self.rng.uniform(0.0, 0.5))
        except TimeoutError:
            return "left", "mid-request"
        return "left", "answered before the client left"

    async def _invalid(self) -> tuple[str, str]:
        body: Any = self.rng.choice([
            {"prompt": "hi", "max_tokens": 0},
            {"prompt": "hi", "temperature": True},
            b"{not json",
        ])  # fmt: skip
        r = await self._post("/v1/completions", body)
        return ("refused", "") if r.status_code == 400 else ("error", f"HTTP {r.status_code}, wanted 400")

    async def _oversized(self) -> tuple[str, str]:
        body = {"prompt": [5] * (self.context_len + 8), "max_tokens": 4}
        r = await self._post("/v1/completions", body)
        return ("refused", "") if r.status_code == 400 else ("error", f"HTTP {r.status_code}, wanted 400")

    async def _read_stream(self, path: str, body: dict[str, Any], max_tokens: int,
                           leave_after: int | None) -> tuple[str, str]:  # fmt: skip
        """Read a stream to its [DONE] (or leave after ``leave_after`` chunks)."""
        chunks, tokens, finish = 0, 0, None
        async with self.http.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return "error", f"HTTP {r.status_code}: {r.text[:200]}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return "error", str(event["error"].get("message"))
                chunks += 1
                for c in event.get("choices", ()):
                    tokens += len(c.get("token_ids", ()))
                    finish = c.get("finish_reason") or finish
                if leave_after is not None and chunks >= leave_after:
                    return "left", f"after {chunks} chunks"  # (leaving the block closes it)
        if leave_after is not None:
            return "left", "answered before the client left"
        if finish not in ("length", "stop") or tokens > max_tokens:
            return "error", f"stream ended with finish_reason={finish}, {tokens} tokens"
        return "answered", ""


async def _load(cfg: SoakConfig, url: str, vocab: int, context_len: int,
                bar: tqdm) -> list[Outcome]:  # fmt: skip
    root = random.Random(cfg.seed)
    prefixes = [[root.randrange(3, vocab) for _ in range(cfg.prompt_len // 2)] for _ in range(3)]
    kinds, weights = list(KINDS), list(KINDS.values())
    outcomes: list[Outcome] = []
    end = time.monotonic() + cfg.duration_s
    limits = httpx.Limits(max_connections=2 * cfg.concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.request_timeout_s)) as http:

        async def client(i: int) -> None:
            rng = random.Random(root.randrange(1 << 62) + i)
            c = _Client(cfg, url, http, rng, vocab, context_len, prefixes)
            while time.monotonic() < end:
                outcomes.append(await c.one(rng.choices(kinds, weights)[0]))
                bar.update(1)

        await asyncio.gather(*(client(i) for i in range(cfg.concurrency)))
    return outcomes


def bench_soak(config: EngineConfig, cfg: SoakConfig, *, progress: bool = True) -> dict[str, Any]:
    """Serve ``config`` on loopback under ``cfg``'s clients (module doc); the summary."""
    cfg.check()
    rss = _RssSampler(cfg.rss_interval_s)
    rss.start()
    engine = Engine(config)
    vocab, context_len = engine.runner.vocab_size, engine.runner.max_context_len
    app = create_app(engine, max_queued_requests=2 * cfg.concurrency)
    loop = app.state.engine_loop
    bar = tqdm(desc="soak requests", unit="req", disable=not progress)
    with background_server(app) as url:
        warm_up(url, [5, 6, 7])  # kernel compilation is not part of the soak
        t_load = time.monotonic() - rss.t0
        outcomes = asyncio.run(_load(cfg, url, vocab, context_len, bar))
        bar.close()
        memory = _wait_idle_then(loop, engine, timeout_s=cfg.request_timeout_s)
        aborted = loop.stats.num_aborted
    rss.stop()
    return _summary(config, cfg, outcomes, aborted, memory, rss.samples, t_load)


def _summary(config: EngineConfig, cfg: SoakConfig, outcomes: list[Outcome], aborted: int,
             memory: dict[str, Any], samples: list[tuple[float, float]],
             t_load: float) -> dict[str, Any]:  # fmt: skip
    by_kind = Counter(o.kind for o in outcomes)
    by_result = Counter(o.result for o in outcomes)
    errors = [o for o in outcomes if o.result == "error"]
    answered = [o.latency_s * 1e3 for o in outcomes if o.result == "answered"]
    t_warm = t_load + cfg.warmup_fraction * cfg.duration_s
    start = samples[0][1]
    warm = next((mib for t, mib in samples if t >= t_warm), samples[-1][1])
    end = samples[-1][1]
    return {
        "model": config.model,
        "kv_canary": config.canary.mode,
        "duration_s": cfg.duration_s,
        "concurrency": cfg.concurrency,
        "requests": len(outcomes),
        "requests_by_kind": dict(sorted(by_kind.items())),
        "answered": by_result["answered"],
        "refused_as_expected": by_result["refused"],
        "clients_left": by_result["left"],
        "server_aborts": aborted,
        "errors": len(errors),
        "first_error": f"{errors[0].kind}: {errors[0].detail}" if errors else "",
        "latency_p50_ms": _percentile(answered, 0.50),
        "latency_p99_ms": _percentile(answered, 0.99),
        "rss_start_mib": round(start, 1),
        "rss_after_warmup_mib": round(warm, 1),
        "rss_end_mib": round(end, 1),
        "rss_growth_after_warmup_mib": round(end - warm, 1),
        "max_rss_growth_mib": cfg.max_rss_growth_mib,
        "rss_curve_mib": [[round(t, 1), round(m, 1)] for t, m in samples],
        **memory,
    }


def soak_ok(summary: dict[str, Any]) -> bool:
    return (summary["errors"] == 0 and memory_ok(summary)
            and summary["rss_growth_after_warmup_mib"] <= summary["max_rss_growth_mib"])
