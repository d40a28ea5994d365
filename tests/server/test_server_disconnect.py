"""A client that goes away at any moment gets its request aborted and its KV freed within
one engine step: while it waits for a running slot, during a prefill chunk, while retracted,
before its first streamed token, mid-decode of a plain (not streamed) request.

Real HTTP on loopback: each client is a raw socket that sends one request and closes, so
the moment of the disconnect is the test's. The engine's step is wrapped to be slow (and,
for the retracted case, to stand still while a request sits retracted), and counts the real
steps, so "within one step" is measured in steps, not seconds."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvcanary import Engine, EngineConfig
from kvcanary.engine.request import Req
from kvcanary.server import create_app
from kvcanary.server.background import background_server
from kvcanary.server.engine_loop import EngineLoop

MODEL = "builtin:tiny-swa"
STEP_S = 0.1


class Live:
    def __init__(self, url: str, engine: Engine, loop: EngineLoop) -> None:
        self.url, self.engine, self.loop = url, engine, loop
        self.steps: list[tuple[float, int]] = []  # each real step's (start, aborts before it)
        self.hold = threading.Event()  # set: steps are no-ops (the engine stands still)

    def call(self, fn: Callable[[], Any]) -> Any:
        return self.loop.call(fn).result(180)  # (a first step may compile)

    def wait(self, cond: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.call(cond):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def idle(self) -> None:
        self.hold.clear()
        self.wait(lambda: self.engine.queue_lengths() == (0, 0), "the engine to go idle")
        assert self.call(self.engine.check_integrity)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    engine = Engine(EngineConfig(model=MODEL, page_size=4, max_total_tokens=4096, max_context_len=512,
                                 chunked_prefill_size=16, max_running_requests=2))  # fmt: skip
    app = create_app(engine, max_queued_requests=4)
    with background_server(app) as url:
        state = Live(url, engine, app.state.engine_loop)
        real_step = engine.step

        def step() -> Any:
            if state.hold.is_set():
                time.sleep(0.005)
                return []
            state.steps.append((time.monotonic(), state.loop.stats.num_aborted))
            time.sleep(STEP_S)
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        yield state


def _open(live: Live, path: str, body: dict[str, Any]) -> socket.socket:
    """Send one POST on a fresh connection; the caller closes it (the disconnect)."""
    url = urlsplit(live.url)
    sock = socket.create_connection((url.hostname, url.port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
    return sock


def _request(live: Live, prompt_len: int) -> Req | None:
    reqs = [*live.engine.scheduler.running, *live.engine.scheduler.waiting]
    return next((r for r in reqs if len(r.prompt_ids) == prompt_len), None)


def _prompt(n: int) -> list[int]:
    return [(7 * i + n) % 200 + 3 for i in range(n)]


def _free_slots(live: Live) -> int:
    """Free KV slots once the prefix cache has given back everything it holds."""

    def free() -> int:
        cache = live.engine.prefix_cache
        if cache is not None:
            cache.evict(1 << 40, 1 << 40)
        return live.engine.kv.available()

    return live.call(free)


def _close_and_count_steps(live: Live, sock: socket.socket, prompt_len: int) -> int:
    """Disconnect, wait until the request is gone from the engine; how many real steps
    started after the disconnect with the request still in the engine."""
    aborted = live.loop.stats.num_aborted
    t0 = time.monotonic()
    sock.close()
    live.wait(lambda: _request(live, prompt_len) is None, "the request to leave the engine")
    assert live.loop.stats.num_aborted == aborted + 1
    return sum(t > t0 and n == aborted for t, n in live.steps)


def _busy(live: Live, n: int = 2) -> list[socket.socket]:
    """``n`` streamed requests decoding for a long time (they fill the running slots)."""
    socks = [_open(live, "/v1/completions", {"prompt": _prompt(10 + i), "max_tokens": 400,
                                              "ignore_eos": True, "stream": True})
             for i in range(n)]  # fmt: skip
    live.wait(lambda: sum(len(r.output_ids) > 0 for r in live.engine.scheduler.running) == n,
              "the busy requests to decode")  # fmt: skip
    return socks


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_waiting_for_a_running_slot(live: Live, stream: bool) -> None:
    live.idle()
    busy = _busy(live)
    sock = _open(live, "/v1/completions", {"prompt": _prompt(33), "max_tokens": 8, "stream": stream})
    live.wait(lambda: (r := _request(live, 33)) is not None and r in live.engine.scheduler.waiting,
              "the request to queue")  # fmt: skip
    assert _close_and_count_steps(live, sock, 33) <= 1
    for s in busy:
        s.close()
    live.idle()


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_a_prefill_chunk(live: Live, stream: bool) -> None:
    live.idle()
    free = _free_slots(live)
    prefilled = live.call(lambda: live.engine.stats.num_prefill_tokens)
    sock = _open(live, "/v1/completions", {"prompt": _prompt(300), "max_tokens": 8, "stream": stream})
    live.wait(lambda: (r := _request(live, 300)) is not None and 32 <= r.kv_len < 200,
              "the prefill to be under way")  # fmt: skip
    assert _close_and_count_steps(live, sock, 300) <= 1
    live.idle()
    assert live.call(lambda: live.engine.stats.num_prefill_tokens) - prefilled < 300  # left mid-prefill
    assert _free_slots(live) == free  # (aborted: nothing went to the prefix cache)


def test_disconnect_while_retracted(live: Live) -> None:
    live.idle()
    free = _free_slots(live)
    sock = _open(live, "/v1/completions", {"prompt": _prompt(41), "max_tokens": 400, "ignore_eos": True})
    live.wait(lambda: (r := _request(live, 41)) is not None and len(r.output_ids) >= 3, "decoding")

    def retract() -> None:  # the scheduler's own retraction; then the engine stands still
        sched = live.engine.scheduler
        sched._retract(next(r for r in sched.running if len(r.prompt_ids) == 41))
        live.hold.set()

    live.call(retract)
    req = live.call(lambda: _request(live, 41))
    assert req in live.engine.scheduler.waiting and req.admitted_once and req.output_ids
    assert _close_and_count_steps(live, sock, 41) == 0  # the engine stood still throughout
    live.idle()
    assert _free_slots(live) == free


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_mid_decode(live: Live, stream: bool) -> None:
    live.idle()
    free = _free_slots(live)
    sock = _open(live, "/v1/completions", {"prompt": _prompt(21), "max_tokens": 400,
                                           "ignore_eos": True, "stream": stream})  # fmt: skip
    live.wait(lambda: (r := _request(live, 21)) is not None and len(r.output_ids) >= 5, "decoding")
    if stream:  # the client has read tokens
        assert b"data: " in sock.recv(65536)
    assert _close_and_count_steps(live, sock, 21) <= 1
    live.idle()
    assert _free_slots(live) == free
