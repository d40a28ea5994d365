"""EngineLoop: the one thread that owns an Engine.

The engine is not thread-safe. HTTP handlers never touch it: they ``submit`` a request (or
``call`` a function, e.g. a metrics scrape) and wait on the returned future; the loop thread
drains its inbox, calls ``engine.add_request`` / ``engine.step()`` and resolves futures::

    handler ──submit──▶ inbox ──▶ [loop thread] add_request ─ step ─ step ─ ... ─▶ future.set_result
                                   (blocks on the inbox only while the engine is idle)
                                   after each step: on_progress(delta) for streams; stop strings

Contracts:
* A request the engine rejects (``ValueError``: empty prompt, ids out of vocab, prompt too
  long for the context, too large for the KV pools even alone; a text prompt for a model
  without a tokenizer) fails only its own future, with :class:`InvalidRequestError`; the
  loop keeps serving everything else.
* A failing ``engine.step()`` (an engine bug, ``--kv-canary raise``) stops the loop: every
  pending and queued future fails with that error, later submits fail at once, and
  ``alive`` turns False (the engine's state can no longer be trusted).
* ``abort(sub)`` (a client went away) removes the request from the engine, freeing its KV;
  its future fails with :class:`RequestAborted`.
* A stop string (``Submission.stop``) is matched on the detokenised output after every step
  (:class:`~kvcanary.server.text_stream.TextStream`); a match aborts the request in the
  engine and resolves it with ``finish_reason="stop"`` and the text cut before the match.
* ``Submission.after``: added to the engine only once that submission has its first token
  (its prompt is then in the prefix cache), so ``n`` copies of a prompt share its KV.
"""

from __future__ import annotations

import dataclasses
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
from kvcanary.engine.request import TokenLogprob
from kvcanary.model.tokenizer import TokenizerUnavailableError
from kvcanary.server.text_stream import TextStream

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The engine rejected a request's input; the message names what and why, ``cause`` is
    the engine's own (typed) exception."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class EngineLoopStopped(RuntimeError):
    """The loop is not running (stopped, or died on an engine failure)."""


class RequestAborted(RuntimeError):
    """The request was aborted by ``EngineLoop.abort`` (its client went away)."""


@dataclass(slots=True)
class LoopStats:
    """Counters kept by the loop thread (read by the metrics collector in that thread)."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_aborted: int = 0
    num_finished_by_reason: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class Progress:
    """What one request gained in one step, handed to its ``on_progress`` in the loop
    thread: text safe to show (see TextStream), the new token ids (and logprobs), and on
    the last one the finish reason."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None


@dataclass(slots=True, eq=False)
class Submission:
    """One request for the loop; ``future`` resolves to its RequestOutput (text cut at a
    stop string). Fields below ``future`` belong to the loop thread."""

    prompt: Prompt
    params: SamplingParams
    stop: tuple[str, ...] = ()
    on_progress: Callable[[Progress], None] | None = None
    after: Submission | None = None
    future: Future[RequestOutput] = field(default_factory=Future)
    rid: int = 0
    num_ids_sent: int = 0
    text: TextStream = field(init=False)  # set by submit
    started: bool = False  # has a first token (or finished): followers may start


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]


@dataclass(slots=True)
class _Abort:
    sub: Submission


_STOP = object()


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stats = LoopStats()
        self.error: BaseException | None = None  # why the loop died, if it did
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[int, Submission] = {}  # rid -> submission in the engine
        self._deferred: list[Submission] = []  # waiting for their ``after`` to start
        # Guards _closed (no future is stranded by a submit racing shutdown) and the count.
        self._lock = threading.Lock()
        self._closed = False
        self._num_in_flight = 0
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

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet resolved (admission control reads this)."""
        return self._num_in_flight

    def submit(self, sub: Submission) -> Future[RequestOutput]:
        sub.text = TextStream(self.engine.tokenizer.decode, sub.stop)
        with self._lock:
            self._num_in_flight += 1
        sub.future.add_done_callback(self._resolved)
        self._put(sub, sub.future)
        return sub.future

    def abort(self, sub: Submission) -> None:
        """Stop ``sub`` and free its KV (no-op once it has resolved)."""
        if not sub.future.done():
            self._put(_Abort(sub), Future())

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn()`` in the loop thread between steps (for reads of engine state)."""
        fut: Future[Any] = Future()
        self._put(_Call(fn, fut), fut)
        return fut

    def _resolved(self, _: Future[RequestOutput]) -> None:
        with self._lock:
            self._num_in_flight -= 1

    def _put(self, item: Any, fut: Future[Any]) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._inbox.put(item)
        if closed:  # outside the lock: fut's done callbacks (_resolved) take it
            fut.set_exception(self._stopped_error())

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
            elif isinstance(item, _Abort):
                self._abort(item.sub)
            elif item.after is not None and not item.after.started:
                self._deferred.append(item)
            else:
                self._add(item)

    def _add(self, sub: Submission) -> None:
        if not sub.future.set_running_or_notify_cancel():
            return
        try:
            sub.rid = self.engine.add_request(sub.prompt, sub.params)
        except (ValueError, TokenizerUnavailableError) as e:
            sub.future.set_exception(InvalidRequestError(e))
        except Exception as e:  # noqa: BLE001 -- an engine bug fails this request only
            sub.future.set_exception(e)
        else:
            self._pending[sub.rid] = sub
        finally:
            sub.started = sub.future.done()  # failed: its followers must not wait forever

    def _abort(self, sub: Submission) -> None:
        if sub in self._deferred:
            self._deferred.remove(sub)
            if not sub.future.set_running_or_notify_cancel():
                return
        elif self._pending.get(sub.rid) is sub:
            del self._pending[sub.rid]
            self.engine.abort_request(sub.rid)
        else:
            return  # already resolved
        self.stats.num_aborted += 1
        sub.started = True
        sub.future.set_exception(RequestAborted(f"request {sub.rid} aborted"))

    @staticmethod
    def _run_call(item: _Call) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            item.future.set_result(item.fn())
        except Exception as e:  # noqa: BLE001
            item.future.set_exception(e)

    def _step(self) -> None:
        finished = {out.rid: out for out in self.engine.step()}
        self.stats.num_steps += 1
        watched = [s for s in self._pending.values()
                   if s.rid not in finished and (s.on_progress or s.stop or not s.started)]  # fmt: skip
        running = {r.rid: r for r in self.engine.running_requests()} if watched else {}
        for sub in watched:
            r = running.get(sub.rid)
            if r is None or len(r.output_ids) <= sub.num_ids_sent:
                continue
            sub.started = True
            self._progress(sub, r.output_ids, r.output_logprobs, None)
            if sub.text.stopped:  # a stop string matched
                stopped = self.engine.abort_request(sub.rid)
                if stopped is not None:
                    self._finish(sub, dataclasses.replace(stopped, finish_reason="stop"))
        for rid, out in finished.items():
            if rid in self._pending:
                self._finish(self._pending[rid], out)
        if self._deferred:
            ready = [s for s in self._deferred if s.after is None or s.after.started]
            self._deferred = [s for s in self._deferred if s not in ready]
            for s in ready:
                self._add(s)
        if not self.engine.has_unfinished() and self.engine.canary is not None:
            self.engine.canary.flush()  # idle: report what a delayed pump has not read yet

    def _progress(self, sub: Submission, output_ids: list[int],
                  logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> str | None:  # fmt: skip
        """Advance ``sub``'s text over ``output_ids``; tell its stream what is new. Returns
        the finish reason sent: ``"stop"`` when finishing the text matched a stop string."""
        new_ids = output_ids[sub.num_ids_sent :]
        new_lps = None if logprobs is None else logprobs[sub.num_ids_sent :]
        sub.num_ids_sent = len(output_ids)
        if finish_reason is None:
            text = sub.text.update(output_ids)
        else:
            text = sub.text.finish(output_ids)
            finish_reason = "stop" if sub.text.stopped else finish_reason
        if sub.on_progress is not None and (text or new_ids or finish_reason):
            sub.on_progress(Progress(text, new_ids, new_lps, finish_reason))
        return finish_reason

    def _finish(self, sub: Submission, out: RequestOutput) -> None:
        self._pending.pop(sub.rid, None)
        sub.started = True
        reason: str = "stop"
        if not sub.text.stopped:  # finishing the text may still match a stop string
            reason = self._progress(sub, out.output_ids, out.logprobs, out.finish_reason) or ""
        elif sub.on_progress is not None:
            sub.on_progress(Progress("", [], [] if out.logprobs is not None else None, reason))
        self.stats.num_prompt_tokens += len(out.prompt_ids)
        self.stats.num_generated_tokens += len(out.output_ids)
        self.stats.num_finished_by_reason[reason] += 1
        sub.future.set_result(dataclasses.replace(out, text=sub.text.text, finish_reason=reason))

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        err = self._stopped_error()
        for sub in [*self._pending.values(), *self._deferred]:
            if not sub.future.done():
                sub.future.set_exception(err)
        self._pending.clear()
        self._deferred.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is _STOP or isinstance(item, _Abort):
                continue
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(err)
