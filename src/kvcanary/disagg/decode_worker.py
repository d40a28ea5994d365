"""The decode worker: admits requests against its pools (:mod:`.prealloc`), sends the
destination page ids to the prefill worker, scatters the pages that come back, and decodes
(protocol and failure handling: :mod:`.protocol`)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

import torch

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.disagg.config import DisaggConfig, DisaggFaults
from kvcanary.disagg.pages import PageIO, PageLayoutError, TransferPages
from kvcanary.disagg.prealloc import DecodePreallocQueue
from kvcanary.disagg.protocol import (
    DisaggError,
    DisaggOutput,
    canary_report,
    check_peer_layout,
    engine_request_pages,
    kv_layout,
    memory_report,
)
from kvcanary.disagg.transfer import TransferError, TransferLink
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import Req
from kvcanary.engine.sampling import make_generator

logger = logging.getLogger("kvcanary.disagg")


class DecodeWorker:
    """Admits requests against the decode pools, asks the prefill worker for their KV and
    decodes them once it lands."""

    def __init__(
        self,
        config: EngineConfig,
        disagg: DisaggConfig,
        link: TransferLink,
        faults: DisaggFaults | None = None,
    ):
        self.config = config
        self.disagg = disagg
        self.faults = faults or DisaggFaults()
        self.engine = Engine(config)
        self.scheduler = self.engine.scheduler
        self.prealloc = DecodePreallocQueue(self.engine.kv, self.scheduler, disagg)
        self.io = PageIO(self.engine.runner.token_to_kv_pool)
        self.layout = kv_layout(self.engine, self.io)
        self.link = link
        self.link_error: str | None = None
        self.peer_ready = False
        self._rids = itertools.count(1)
        self._pages: dict[int, TransferPages] = {}
        self._deadlines: dict[int, float] = {}
        self._landed: set[int] = set()
        self._outputs: dict[int, DisaggOutput] = {}
        self.num_transfers = 0
        self.transfer_bytes = 0
        self.peak_transferring = 0
        self.peak_admitted = 0  # transferring + running, the decode side's concurrency
        link.send({"type": "hello", "role": "decode", "layout": self.layout})

    # ------------------------------------------------------------------ api
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queue one request; returns its id (failures come back as outputs)."""
        ids = [int(t) for t in prompt_ids]
        vocab = self.engine.runner.vocab_size
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt must be non-empty token ids in [0, {vocab})")
        limit = self.engine.runner.max_context_len
        if len(ids) + params.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"max_context_len={limit}"
            )
        rid = next(self._rids)
        req = Req(rid=rid, prompt_ids=ids, params=params)
        req.generator = make_generator(params, self.config.seed, rid)
        error = self.link_error or self.prealloc.capacity_error(req)
        if error is not None:
            self._finish_failed(req, error)
        else:
            self.prealloc.queue.append(req)
        return rid

    def take_outputs(self) -> list[DisaggOutput]:
        out = list(self._outputs.values())
        self._outputs.clear()
        return out

    def poll(self, step: bool = True) -> bool:
        """Handle what arrived, fail overdue transfers, admit, run one decode step (unless
        ``step`` is False); True if anything happened."""
        busy = self._receive()
        self._expire(time.monotonic())
        busy |= self._admit()
        sched = self.scheduler
        self.peak_admitted = max(
            self.peak_admitted, len(self.prealloc.transferring) + len(sched.running)
        )
        if not step:
            return busy
        # A retracted request that cannot come back yet waits for the transfers in flight
        # rather than failing the whole batch (the scheduler would call the pool too small).
        stalled = not sched.running and not self.prealloc.transferring
        if sched.running or (sched.waiting and stalled):
            for out in self.engine.step():
                self._outputs[out.rid] = DisaggOutput(
                    out.rid, out.prompt_ids, out.output_ids, out.finish_reason, None,
                    out.num_cached_prompt_tokens, out.num_retractions,
                )  # fmt: skip
            busy = True
        return busy

    def shutdown(self) -> None:
        """Tell the prefill worker to stop (if it is still there)."""
        if self.link_error is None:
            try:
                self.link.send({"type": "shutdown"})
            except TransferError as e:
                self._on_link_failure(e)

    # ------------------------------------------------------------------ messages
    def _receive(self) -> bool:
        if self.link_error is not None:
            return False
        try:
            msgs = self.link.poll()
        except TransferError as e:
            self._on_link_failure(e)
            return True
        for msg in msgs:
            body = msg.body
            kind = body["type"]
            if kind == "hello":
                check_peer_layout(self.layout, body["layout"], "decode")
                self.peer_ready = True
            elif kind == "kv":
                self._on_kv(int(body["rid"]), msg.payload)
            elif kind == "first_token":
                self._on_first_token(body)
            elif kind == "failed":
                self._fail_transfer(int(body["rid"]), f"prefill failed: {body['error']}")
            else:
                raise DisaggError(f"decode: unknown message type {kind!r}")
        return bool(msgs)

    def _on_kv(self, rid: int, payload: torch.Tensor | None) -> None:
        if rid not in self.prealloc.transferring:  # failed (e.g. timed out) meanwhile: drop
            logger.warning("decode: dropping late KV of request %d", rid)
            return
        try:
            if payload is None:
                raise ValueError("KV message without payload")
            self.io.scatter(payload, self._pages[rid], page_offset=self.faults.page_offset)
        except ValueError as e:
            self._fail_transfer(rid, f"KV transfer failed: {e}")
            return
        self._landed.add(rid)
        self.num_transfers += 1
        self.transfer_bytes += payload.numel()

    def _on_first_token(self, body: dict[str, Any]) -> None:
        rid = int(body["rid"])
        req = self.prealloc.transferring.get(rid)
        if req is None:
            return
        if rid not in self._landed:
            self._fail_transfer(rid, "first token arrived before the request's KV")
            return
        self._forget(rid)
        del self.prealloc.transferring[rid]
        sched, stats = self.scheduler, self.engine.stats
        token = int(body["token"])
        if body.get("generator_state") is not None and req.generator is not None:
            req.generator.set_state(torch.tensor(body["generator_state"], dtype=torch.uint8))
        req.output_ids.append(token)
        self.engine.kv.req_to_token_pool.append_tokens([req.req_pool_idx], [req.kv_len], [token])
        req.admitted_once = True
        req.num_cached_prompt_tokens = req.cache_protected_len
        stats.num_prompt_tokens += len(req.prompt_ids)
        stats.num_cached_prompt_tokens += req.cache_protected_len
        if sched.check_finish(req, token):
            sched.finish(req)
            self._outputs[rid] = DisaggOutput(
                rid, list(req.prompt_ids), list(req.output_ids), req.finish_reason or "",
                None, req.num_cached_prompt_tokens, 0,
            )  # fmt: skip
        else:
            sched.adopt(req)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> bool:
        if not (self.peer_ready and self.link_error is None and self.prealloc.queue):
            return False
        admitted = self.prealloc.pop_preallocated()
        for req in admitted:
            try:
                pages = engine_request_pages(self.engine, req, req.cache_protected_len, req.kv_len)
            except PageLayoutError as e:
                self._fail_transfer(req.rid, f"decode could not describe its pages: {e}")
                continue
            self._pages[req.rid] = pages
            self._deadlines[req.rid] = time.monotonic() + self.disagg.transfer_timeout_s
            try:
                self.link.send({
                    "type": "prefill", "rid": req.rid, "prompt_ids": req.prompt_ids,
                    "params": dataclasses.asdict(req.params),
                    "prefix_len": req.cache_protected_len,
                    "kv_page_ids": pages.kv_page_ids, "state_page_ids": pages.state_page_ids,
                })  # fmt: skip
            except TransferError as e:
                self._on_link_failure(e)
                break
        self.peak_transferring = max(self.peak_transferring, len(self.prealloc.transferring))
        if not admitted and self._idle():
            # Rejected although nothing else holds decode memory: it can never fit.
            req = self.prealloc.queue.popleft()
            self._finish_failed(
                req, f"request {req.rid} does not fit the idle decode pools "
                f"({self.prealloc.last_rejection})",
            )  # fmt: skip
            return True
        return bool(admitted)

    def _idle(self) -> bool:
        sched = self.scheduler
        return not (sched.running or sched.waiting or self.prealloc.transferring)

    # ------------------------------------------------------------------ failures
    def _expire(self, now: float) -> None:
        for rid, deadline in list(self._deadlines.items()):
            if now > deadline:
                self._fail_transfer(
                    rid, f"transfer timed out: no KV and first token from the prefill worker "
                    f"within {self.disagg.transfer_timeout_s:g}s",
                )  # fmt: skip

    def _forget(self, rid: int) -> None:
        self._pages.pop(rid, None)
        self._deadlines.pop(rid, None)
        self._landed.discard(rid)

    def _fail_transfer(self, rid: int, error: str) -> None:
        """Fail a transferring request and free everything it holds."""
        req = self.prealloc.transferring.get(rid)
        if req is None:
            return
        self._forget(rid)
        self.prealloc.release(req)
        self._finish_failed(req, error)

    def _finish_failed(self, req: Req, error: str) -> None:
        logger.error("decode: request %d failed: %s", req.rid, error)
        req.finish_reason = "error"
        self._outputs[req.rid] = DisaggOutput(
            req.rid, list(req.prompt_ids), list(req.output_ids), "error", error
        )

    def _on_link_failure(self, e: TransferError) -> None:
        """The prefill worker is gone: fail every request that still needs it."""
        if self.link_error is None:
            self.link_error = f"prefill worker unreachable: {e}"
        for rid in list(self.prealloc.transferring):
            self._fail_transfer(rid, self.link_error)
        while self.prealloc.queue:
            self._finish_failed(self.prealloc.queue.popleft(), self.link_error)

    def report(self) -> dict[str, Any]:
        for canary in self.engine.canaries:
            canary.flush()
        return {
            "role": "decode",
            "tail_prealloc": self.prealloc.tail_mode,
            "transfers": self.num_transfers,
            "transfer_bytes": self.transfer_bytes,
            "peak_transferring": self.peak_transferring,
            "peak_admitted": self.peak_admitted,
            "link_error": self.link_error,
            "stats": dataclasses.asdict(self.engine.stats),
            "canary": canary_report(self.engine),
            "draft_canary": canary_report(self.engine, draft=True),  # (speculative decoding)
            **memory_report(self.engine),
        }
