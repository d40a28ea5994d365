"""The replay driver: one engine run of a workload, with or without a reverted upstream fix
and with or without the canary, observed by the read oracle (:mod:`vllm_oracle`).

A workload is ``workload(llm, tick) -> outputs``: it adds requests and calls ``tick()`` for
each engine step (``tick`` steps the engine once and files the canary rows the step
reported under the oracle's step number), returning ``{request: generated token ids}``.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import vllm_harness as H
from vllm_oracle import ReadOracle

from kvcanary.canary.explain import explain

Workload = Callable[[Any, Callable[[], list[Any]]], dict[str, list[int]]]


@dataclass
class Run:
    outputs: dict[str, list[int]]
    oracle: ReadOracle
    rows: dict[int, list[Any]] = field(default_factory=dict)  # oracle step -> canary rows
    log: str = ""
    log_ends: dict[int, int] = field(default_factory=dict)  # oracle step -> end of its lines

    @property
    def first_detection(self) -> int | None:
        return min(self.rows) if self.rows else None

    def named_slots(self, step: int) -> set[int]:
        return {int(r.slot_idx) for r in self.rows.get(step, [])}

    def step_log(self, step: int) -> str:
        """The canary's log lines of oracle step ``step``."""
        start = max((end for s, end in self.log_ends.items() if s < step), default=0)
        return self.log[start : self.log_ends.get(step, start)]

    def causes(self, step: int | None = None) -> list[str]:
        """``kvcanary explain``'s causes of the whole log, or of one oracle step's lines."""
        text = self.log if step is None else self.step_log(step)
        return [c["cause"] for c in explain(text)["causes"]]


@contextlib.contextmanager
def _captured_canary_log() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("kvcanary.canary")
    log.addHandler(handler)
    try:
        yield buf
    finally:
        log.removeHandler(handler)


def replay(ckpt: Path, workload: Workload, *, canary: dict[str, Any] | None,
           patch: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
           namespace_of: Callable[[Any], Callable[[str], object]] | None = None,
           observe_loads: list[Any] | None = None,
           **engine: Any) -> Run:  # fmt: skip
    """One run (module doc). ``patch()`` is entered after the engine is built (so start-up
    runs the released code) and left before it shuts down. ``namespace_of(llm)``: the
    oracle's namespace of a request id (what its KV is computed with beyond its tokens).
    ``observe_loads``: a loading connector's observer list (``vllm_stub_connector.
    OBSERVERS``) the oracle joins for the run."""
    with _captured_canary_log() as buf, H.vllm_engine(ckpt, canary=canary, **engine) as llm:
        runner = H.worker(llm).model_runner
        oracle = (ReadOracle(runner) if namespace_of is None
                  else ReadOracle(runner, namespace_of(llm)))  # fmt: skip
        if observe_loads is not None:
            observe_loads.append(oracle)
        run = Run({}, oracle)
        conn = H.connector(llm) if canary is not None else None
        seen = 0

        def tick() -> list[Any]:
            nonlocal seen
            out = H.step(llm)
            if conn is not None:
                conn.worker.flush()
                rows = conn.worker.violations
                if len(rows) > seen:
                    run.rows.setdefault(oracle.step, []).extend(rows[seen:])
                    seen = len(rows)
                run.log_ends[oracle.step] = len(buf.getvalue())
            return out

        try:
            with patch() if patch is not None else contextlib.nullcontext():
                run.outputs = workload(llm, tick)
        finally:
            if observe_loads is not None:
                observe_loads.remove(oracle)
    run.log = buf.getvalue()
    return run


def run_to_end(llm: Any, tick: Callable[[], list[Any]], limit: int = 2000) -> dict[str, list[int]]:
    """Step until every request finished; ``{user request id: output token ids}``."""
    outputs: dict[str, list[int]] = {}
    for _ in range(limit):
        if not llm.llm_engine.has_unfinished_requests():
            break
        for out in tick():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return outputs
