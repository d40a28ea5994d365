"""The prefill worker: runs each incoming prompt for one token and, before the scheduler
releases its KV, ships the pages (through the buf-infos, canary records included) and the
first token to the decode worker (protocol: :mod:`.protocol`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.disagg.config import DisaggConfig, DisaggFaults
from kvcanary.disagg.pages import PageIO, PageLayoutError
from kvcanary.disagg.protocol import (
    DisaggError,
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
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.utils import ceil_page

logger = logging.getLogger("kvcanary.disagg")


def _install_real_kv_post_forward(engine: Engine, seed: int) -> None:
    """Fault hook: the canary's ``real_kv_post_forward`` perturbation on every forward (byte 0
    of one written slot's real-KV source in the full-attention group, after TAIL)."""
    from kvcanary.canary.perturb import PerturbConfig, install_perturbation

    config = PerturbConfig.single(
        "real_kv_post_forward", prob=1.0, target_group="full", warmup_steps=0, seed=seed
    )
    install_perturbation(engine, config)


@dataclass(slots=True)
class _PrefillJob:
    prefix_len: int  # what the decode side already holds
    num_kv_pages: int  # how many pages the decode side reserved
    num_state_pages: int


class PrefillWorker:
    """Runs each incoming prompt for one token and ships its KV, canary records and first
    token to the decode worker."""

    def __init__(
        self,
        config: EngineConfig,
        disagg: DisaggConfig,
        link: TransferLink,
        faults: DisaggFaults | None = None,
    ):
        self.config = config
        self.faults = faults or DisaggFaults()
        self.engine = Engine(config)
        self.io = PageIO(self.engine.runner.token_to_kv_pool)
        self.layout = kv_layout(self.engine, self.io)
        self.link = link
        self.jobs: dict[int, _PrefillJob] = {}
        self.num_requests = 0
        self.num_transfers = 0
        self.transfer_bytes = 0
        self.stopped = False
        self.link_error: str | None = None
        self.engine.set_before_release(self._on_prefilled)
        if self.faults.real_kv_post_forward:
            _install_real_kv_post_forward(self.engine, config.seed)
        link.send({"type": "hello", "role": "prefill", "layout": self.layout})

    def poll(self) -> bool:
        """Handle what arrived, run one forward if there is work; True if anything happened."""
        if self.stopped:
            return False
        try:
            msgs = self.link.poll()
        except TransferError as e:
            self._on_link_failure(e)
            return False
        for msg in msgs:
            self._handle(msg.body)
        if self.stopped or not self.engine.has_unfinished():
            return bool(msgs)
        for out in self.engine.step():
            if out.finish_reason == "abort":  # the canary (abort mode) aborted it
                self.jobs.pop(out.rid, None)
                self._send_failed(out.rid, "aborted on the prefill side by the kv-canary")
        return True

    def _handle(self, body: dict[str, Any]) -> None:
        kind = body["type"]
        if kind == "hello":
            check_peer_layout(self.layout, body["layout"], "prefill")
        elif kind == "prefill":
            self._on_prefill_request(body)
        elif kind == "shutdown":
            self.stopped = True
        else:
            raise DisaggError(f"prefill: unknown message type {kind!r}")

    def _on_prefill_request(self, body: dict[str, Any]) -> None:
        self.num_requests += 1
        if self.num_requests == self.faults.crash_prefill_on_request:
            logger.error("prefill: injected crash on request %d", self.num_requests)
            os._exit(17)
        rid, prompt = int(body["rid"]), [int(t) for t in body["prompt_ids"]]
        params = SamplingParams(**body["params"])
        req = Req(rid=rid, prompt_ids=prompt, params=dataclasses.replace(params, max_new_tokens=1))
        req.generator = make_generator(params, self.config.seed, rid)
        job = _PrefillJob(int(body["prefix_len"]), len(body["kv_page_ids"]), len(body["state_page_ids"]))
        alloc = self.engine.runner.allocator
        full_size = alloc.size_full if isinstance(alloc, SWAAllocator) else alloc.size
        try:
            if ceil_page(len(prompt), self.config.page_size) > full_size:
                # The scheduler would stall on it (and fail the whole worker).
                raise ValueError(f"prompt of {len(prompt)} tokens; the prefill pool holds {full_size}")
            self.engine.enqueue(req)
        except ValueError as e:
            self._send_failed(rid, f"prefill rejected the request: {e}")
            return
        self.jobs[rid] = job

    def _on_prefilled(self, req: Req) -> None:
        """The first token is sampled and the KV still in place: ship both."""
        job = self.jobs.pop(req.rid, None)
        if job is None or self.link_error is not None:
            return
        if req.rid in self.faults.drop_transfer_rids:
            logger.error("prefill: injected transfer drop of request %d", req.rid)
            return
        try:
            pages = engine_request_pages(self.engine, req, job.prefix_len, len(req.prompt_ids))
            got = (len(pages.kv_page_ids), len(pages.state_page_ids))
            if got != (job.num_kv_pages, job.num_state_pages):
                raise PageLayoutError(
                    f"the decode side reserved {job.num_kv_pages} KV + {job.num_state_pages} "
                    f"state pages, the transfer covers {got[0]} + {got[1]}"
                )
            payload = self.io.gather(pages)
        except PageLayoutError as e:
            self._send_failed(req.rid, f"prefill could not build the transfer: {e}")
            return
        gen = req.generator
        try:
            self.link.send({"type": "kv", "rid": req.rid}, payload)
            self.link.send({
                "type": "first_token", "rid": req.rid, "token": req.output_ids[0],
                "generator_state": None if gen is None else gen.get_state().tolist(),
            })  # fmt: skip
        except TransferError as e:
            self._on_link_failure(e)
            return
        self.num_transfers += 1
        self.transfer_bytes += payload.numel()

    def _send_failed(self, rid: int, error: str) -> None:
        try:
            self.link.send({"type": "failed", "rid": rid, "error": error})
        except TransferError as e:
            self._on_link_failure(e)

    def _on_link_failure(self, e: TransferError) -> None:
        """The decode side is gone: nothing can be delivered; stop."""
        if self.link_error is None:
            logger.error("prefill: %s; stopping", e)
            self.link_error = str(e)
        self.stopped = True

    def _drain(self) -> None:
        """Finish what is in flight locally, shipping nothing, so memory can be checked."""
        self.jobs.clear()
        while self.engine.has_unfinished():
            self.engine.step()

    def report(self) -> dict[str, Any]:
        self._drain()
        return {
            "role": "prefill",
            "requests": self.num_requests,
            "transfers": self.num_transfers,
            "transfer_bytes": self.transfer_bytes,
            "link_error": self.link_error,
            "stats": dataclasses.asdict(self.engine.stats),
            "canary": canary_report(self.engine),
            **memory_report(self.engine),
        }
