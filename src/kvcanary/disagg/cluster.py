"""Running a prefill worker and a decode worker together.

    InProcessDisagg   both workers in this process, driven alternately over an in-memory
                      link (unit tests, benchmarks; no fault may kill the process)
    DisaggCluster     two spawned processes over torch.distributed (rank 0 prefill, rank 1
                      decode, loopback by default); this process only submits prompts to
                      the decode worker and collects outputs and reports through pipes

Both offer ``generate(prompts, params) -> list[DisaggOutput]`` (prompt order) and
``shutdown() -> {"prefill": report | None, "decode": report | None}`` and are context
managers. Nothing waits without a deadline: a worker that dies or stops answering fails
``generate`` with :class:`~.protocol.DisaggError` naming it, and ``shutdown`` terminates what
does not exit in time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.disagg.config import DisaggConfig, DisaggFaults
from kvcanary.disagg.decode_worker import DecodeWorker
from kvcanary.disagg.prefill_worker import PrefillWorker
from kvcanary.disagg.protocol import DisaggError, DisaggOutput
from kvcanary.disagg.transfer import InProcessLink

_IDLE_SLEEP_S = 0.0005  # a worker with nothing to do yields the (shared) CPU this long

OnOutputs = Callable[[list[DisaggOutput]], None]


def _as_list(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    plist = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} sampling params for {n} prompts")
    return plist


class InProcessDisagg:
    def __init__(
        self,
        prefill_config: EngineConfig,
        decode_config: EngineConfig,
        disagg: DisaggConfig | None = None,
        faults: DisaggFaults | None = None,
    ):
        disagg = disagg or DisaggConfig(transfer_backend="inproc")
        if faults is not None and faults.crash_prefill_on_request:
            raise ValueError("crash_prefill_on_request would kill this process; use DisaggCluster")
        prefill_link, decode_link = InProcessLink.pair()
        self.prefill = PrefillWorker(prefill_config, disagg, prefill_link, faults)
        self.decode = DecodeWorker(decode_config, disagg, decode_link, faults)
        self._links = (prefill_link, decode_link)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        timeout_s: float = 600.0,
        on_outputs: OnOutputs | None = None,
    ) -> list[DisaggOutput]:
        rids = [self.decode.submit(list(p), sp) for p, sp in zip(prompts, _as_list(params, len(prompts)), strict=True)]
        done: dict[int, DisaggOutput] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(rids):
            if time.monotonic() > deadline:
                raise DisaggError(f"generate: {len(rids) - len(done)} requests unfinished after {timeout_s:g}s")
            busy = self.decode.poll()
            busy |= self.prefill.poll()
            outs = self.decode.take_outputs()
            done |= {o.rid: o for o in outs}
            if on_outputs is not None and outs:
                on_outputs(outs)
            if not busy:
                time.sleep(_IDLE_SLEEP_S)
        return [done[r] for r in rids]

    def shutdown(self) -> dict[str, Any]:
        self.decode.shutdown()
        self.prefill.poll()
        reports = {"prefill": self.prefill.report(), "decode": self.decode.report()}
        for link in self._links:
            link.close()
        return reports

    def __enter__(self) -> InProcessDisagg:
        return self

    def __exit__(self, *exc: object) -> None:
        for link in self._links:
            link.close()


# ============================================================================ processes


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _worker_process(
    role: str,
    config: EngineConfig,
    disagg: DisaggConfig,
    faults: DisaggFaults,
    port: int,
    conn: Any,
) -> None:
    """Entry point of a worker process: connect, build the worker, serve until told to stop
    (decode: by the parent; prefill: by the decode worker or a dead link), report."""
    from kvcanary.disagg.transfer import TorchDistLink

    torch.set_num_threads(disagg.threads_per_worker or max(1, (os.cpu_count() or 2) // 2))
    link = None
    try:
        link = TorchDistLink(
            0 if role == "prefill" else 1, master_addr=disagg.master_addr, master_port=port,
            device=torch.device(config.device), dist_backend=disagg.dist_backend,
            timeout_s=disagg.transfer_timeout_s, connect_timeout_s=disagg.connect_timeout_s,
        )  # fmt: skip
        if role == "prefill":
            prefill = PrefillWorker(config, disagg, link, faults)
            conn.send(("ready", None))
            _serve_prefill(prefill, conn)
        else:
            decode = DecodeWorker(config, disagg, link, faults)
            conn.send(("ready", None))
            _serve_decode(decode, conn)
    except BaseException:  # noqa: BLE001 - the parent gets the traceback
        conn.send(("error", f"{role} worker: {traceback.format_exc()}"))
    finally:
        if link is not None:
            link.close()
        conn.close()


def _serve_prefill(worker: PrefillWorker, conn: Any) -> None:
    while not worker.stopped:
        if conn.poll() and conn.recv()[0] == "shutdown":  # the parent gives up on us
            break
        if not worker.poll():
            time.sleep(_IDLE_SLEEP_S)
    conn.send(("report", worker.report()))


def _serve_decode(worker: DecodeWorker, conn: Any) -> None:
    while True:
        if conn.poll():
            cmd, arg = conn.recv()
            if cmd == "shutdown":
                worker.shutdown()
                conn.send(("report", worker.report()))
                return
            try:  # cmd == "submit"
                rids = [worker.submit(p, SamplingParams(**sp)) for p, sp in arg]
                conn.send(("submitted", rids))
            except ValueError as e:
                conn.send(("submit_error", str(e)))
        busy = worker.poll()
        outputs = worker.take_outputs()
        if outputs:
            conn.send(("outputs", outputs))
        elif not busy:
            time.sleep(_IDLE_SLEEP_S)


class DisaggCluster:
    def __init__(
        self,
        prefill_config: EngineConfig,
        decode_config: EngineConfig,
        disagg: DisaggConfig | None = None,
        faults: DisaggFaults | None = None,
    ):
        self.disagg = disagg = disagg or DisaggConfig()
        faults = faults or DisaggFaults()
        port = disagg.master_port or _free_port(disagg.master_addr)
        ctx = mp.get_context("spawn")
        self._conns: dict[str, Any] = {}
        self._procs: dict[str, Any] = {}
        self._reports: dict[str, dict[str, Any] | None] = {"prefill": None, "decode": None}
        self._errors: dict[str, str] = {}
        for role, config in (("prefill", prefill_config), ("decode", decode_config)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_process, args=(role, config, disagg, faults, port, child),
                name=f"kvcanary-{role}", daemon=True,
            )  # fmt: skip
            proc.start()
            child.close()
            self._conns[role], self._procs[role] = parent, proc
        try:
            deadline = time.monotonic() + disagg.connect_timeout_s
            for role in ("prefill", "decode"):
                self._expect(role, "ready", deadline)
        except BaseException:
            self._terminate()
            raise

    # ------------------------------------------------------------------ pipes
    def _recv(self, role: str, deadline: float) -> tuple[str, Any]:
        conn, proc = self._conns[role], self._procs[role]
        while True:
            try:
                if conn.poll(0.05):
                    msg = conn.recv()
                    if msg[0] == "error":
                        self._errors[role] = msg[1]
                        raise DisaggError(msg[1])
                    if msg[0] == "report":
                        self._reports[role] = msg[1]
                    return msg
            except (EOFError, OSError):
                proc.join(1.0)
                raise DisaggError(
                    f"{role} worker exited (exit code {proc.exitcode})"
                    + (f": {self._errors[role]}" if role in self._errors else "")
                ) from None
            if not proc.is_alive() and not conn.poll():
                raise DisaggError(f"{role} worker exited (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise DisaggError(f"{role} worker did not answer in time")

    def _expect(self, role: str, kind: str, deadline: float) -> Any:
        got, arg = self._recv(role, deadline)
        if got == "submit_error":
            raise ValueError(arg)
        if got != kind:
            raise DisaggError(f"{role} worker: expected {kind!r}, got {got!r}")
        return arg

    # ------------------------------------------------------------------ api
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        timeout_s: float = 600.0,
        on_outputs: OnOutputs | None = None,
    ) -> list[DisaggOutput]:
        plist = _as_list(params, len(prompts))
        deadline = time.monotonic() + timeout_s
        items = [([int(t) for t in p], dataclasses.asdict(sp)) for p, sp in zip(prompts, plist, strict=True)]
        self._conns["decode"].send(("submit", items))
        rids = self._expect("decode", "submitted", deadline)
        done: dict[int, DisaggOutput] = {}
        while len(done) < len(rids):
            outs = self._expect("decode", "outputs", deadline)
            done |= {o.rid: o for o in outs}
            if on_outputs is not None:
                on_outputs(outs)
        return [done[r] for r in rids]

    def shutdown(self, timeout_s: float | None = None) -> dict[str, dict[str, Any] | None]:
        """Stop both workers; their final reports (None for a worker that died)."""
        deadline = time.monotonic() + (timeout_s or self.disagg.connect_timeout_s)
        for role in ("decode", "prefill"):
            if self._procs[role].is_alive():
                with contextlib.suppress(OSError):  # it exited meanwhile
                    self._conns[role].send(("shutdown", None))
        for role in ("decode", "prefill"):
            if self._reports[role] is None and role not in self._errors:
                try:
                    while self._recv(role, deadline)[0] != "report":
                        pass
                except DisaggError:
                    pass
        self._terminate(deadline)
        return dict(self._reports)

    @property
    def exitcodes(self) -> dict[str, int | None]:
        return {role: proc.exitcode for role, proc in self._procs.items()}

    def _terminate(self, deadline: float | None = None) -> None:
        for proc in self._procs.values():
            proc.join(max(0.0, (deadline or 0) - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
        for conn in self._conns.values():
            conn.close()

    def __enter__(self) -> DisaggCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        if any(p.is_alive() for p in self._procs.values()):
            self.shutdown()
