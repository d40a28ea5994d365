"""EngineLoop: the one thread that owns an Engine.

The engine is not thread-safe. HTTP handlers never touch it: they ``submit`` a request (or
``call`` a function, e.g. a metrics scrape) and wait on the returned future; the loop thread
drains its inbox, calls ``engine.add_request`` / ``engine.step()`` and resolves futures::

    handler ──submit──▶ inbox ──▶ [loop thread] add_request ─ step ─ step ─ ... ─▶ future.set_result
                                   (blocks on the inbox only while the engine is idle)

Contracts:
* A request the engine rejects (``ValueError``: empty prompt, ids out of vocab, prompt too
  long for the context; a text prompt for a model without a tokenizer) fails only its own
  future, with :class:`InvalidRequestError`; the loop keeps serving everything else.
* A failing ``engine.step()`` (an engine bug, ``--kv-canary raise``) stops the loop: every
  pending and queued future fails with that error, later submits fail at once, and
  ``alive`` turns False (the engine's state can no longer be trusted).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvcanary.config import SamplingParams
from kvcanary.engine.engine import Engine, Prompt, RequestOutput
from kvcanary.model.tokenizer import TokenizerUnavailableError

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The engine rejected a request's input; the message names what and why, ``cause`` is
    the engine's own (typed) exception."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class EngineLoopStopped(RuntimeError):
    """The loop is not running (stopped, or died on an engine failure)."""


@dataclass(slots=True)
class LoopStats:
    """Counters kept by the loop thread (read by the metrics collector in that thread)."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_finished_by_reason: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class _Submit:
    prompt: Prompt
    params: SamplingParams
    future: Future[RequestOutput]


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]


_STOP = object()


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stats = LoopStats()
        self.error: BaseException | None = None  # why the loop died, if it did
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[int, Future[RequestOutput]] = {}  # rid -> future
        # Guards _closed against a submit racing the loop's shutdown (no future is stranded).
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineLoop.start() called twice")
        self._thread = threading.Thread(target=self._run, name="kvcanary-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the current step, fail what is still pending, join the thread."""
        self._inbox.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def submit(self, prompt: Prompt, params: SamplingParams) -> Future[RequestOutput]:
        fut: Future[RequestOutput] = Future()
        self._put(_Submit(prompt, params, fut), fut)
        return fut

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn()`` in the loop thread between steps (for reads of engine state)."""
        fut: Future[Any] = Future()
        self._put(_Call(fn, fut), fut)
        return fut

    def _put(self, item: Any, fut: Future[Any]) -> None:
        with self._lock:
            if self._closed:
                fut.set_exception(self._stopped_error())
            else:
                self._inbox.put(item)

    def _stopped_error(self) -> EngineLoopStopped:
        why = f"engine failed: {type(self.error).__name__}: {self.error}" if self.error else "stopped"
        return EngineLoopStopped(f"the engine loop is not running ({why})")

    # ------------------------------------------------------------ loop thread
    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # noqa: BLE001 -- reported to every waiting request
            logger.exception("engine loop failed; failing all pending requests")
            self.error = e
        finally:
            self._close()

    def _drain(self, block: bool) -> bool:
        """Take everything queued (waiting for one item when ``block``); False on stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            if isinstance(item, _Call):
                self._run_call(item)
            else:
                self._add(item)

    def _add(self, item: _Submit) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            rid = self.engine.add_request(item.prompt, item.params)
        except (ValueError, TokenizerUnavailableError) as e:
            item.future.set_exception(InvalidRequestError(e))
        except Exception as e:  # noqa: BLE001 -- an engine bug fails this request only
            item.future.set_exception(e)
        else:
            self._pending[rid] = item.future

    @staticmethod
    def _run_call(item: _Call) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            item.future.set_result(item.fn())
        except Exception as e:  # noqa: BLE001
            item.future.set_exception(e)

    def _step(self) -> None:
        finished = self.engine.step()
        self.stats.num_steps += 1
        for out in finished:
            self.stats.num_prompt_tokens += len(out.prompt_ids)
            self.stats.num_generated_tokens += len(out.output_ids)
            self.stats.num_finished_by_reason[out.finish_reason] += 1
            fut = self._pending.pop(out.rid, None)
            if fut is not None:
                fut.set_result(out)
        if not self.engine.has_unfinished() and self.engine.canary is not None:
            self.engine.canary.flush()  # idle: report what a delayed pump has not read yet

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        err = self._stopped_error()
        for fut in self._pending.values():
            fut.set_exception(err)
        self._pending.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP and item.future.set_running_or_notify_cancel():
                item.future.set_exception(err)
