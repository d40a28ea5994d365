"""ViolationReporter: what each mode does with the rows the pump brings back.

    every mode   each row -> one ``logger.warning`` with SGLang's multi-line report (first
                 line frozen: ``kv_canary violation: launch_tag=... fail_reason=...``) and
                 one parsed :class:`CanaryViolationRow` in ``rows``
    raise        then raise :class:`KVCanaryViolation` with the reports (once: later rows
                 are still logged and kept, never raised again)
    abort        then remember what the violating rows name until the engine calls
                 :meth:`take_implicated_slots` between steps

What a row implicates, by its group's kind (``verify_not_resident`` rows name a full slot
whatever their tag)::

    FULL                     full slot ``slot_idx``
    SWA                      SWA slot ``slot_idx``
    C4 / C128 / INDEXER      full slots [c * ratio, (c + 1) * ratio), c = ``slot_idx``: the
                             tokens the compressed row summarises (``full slot // ratio``)
    compress-state ring      ``swa_page``: every SWA slot of the page owning the ring,
                             page = row // ring_size; ``request``: req->token row
                             row // ring_size (the ring is the request's own: no pool slot
                             to quarantine, the request holding the row is aborted)
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import NamedTuple

import torch

from kvcanary.canary.errors import KVCanaryViolation
from kvcanary.canary.plan.state import StateRing
from kvcanary.canary.wire.constants import FailReason, PoolKind, split_launch_tag
from kvcanary.canary.wire.violation import (
    ViolationRecord,
    fail_reason_labels,
    format_violation_message,
    launch_tag_name,
)

logger = logging.getLogger("kvcanary.canary")


class CanaryViolationRow(NamedTuple):
    """One reported violation, as a tool parsing the log line would see it."""

    launch_tag: str
    fail_reasons: tuple[str, ...]
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int  # signed int64 bits
    expected_aux: int  # verify: expected chain hash; write: expected position
    step: int  # forward steps completed when the row was reported


class ImplicatedSlots(NamedTuple):
    full: torch.Tensor  # int64, full-pool slots
    swa: torch.Tensor  # int64, SWA sub-pool slots
    req_rows: torch.Tensor  # int64, req->token rows (request-addressed rings)


class ViolationReporter:
    """``context``: `` key=value`` fields appended to each report's first line (the vLLM
    connector's `` rank=R`` on a worker of several); empty: the frozen line as is."""

    def __init__(self, mode: str, compression_ratios: dict[PoolKind, int],
                 state_rings: dict[PoolKind, StateRing] | None = None):  # fmt: skip
        self.mode = mode
        self.context = ""
        self.compression_ratios = compression_ratios
        self.state_rings = state_rings or {}
        self.rows: list[CanaryViolationRow] = []
        self.raised = False
        self._full: set[int] = set()
        self._swa: set[int] = set()
        self._req_rows: set[int] = set()

    def report(
        self, records: list[ViolationRecord], *, total: int, capacity: int, step: int
    ) -> None:
        if not records:
            return
        messages = [
            format_violation_message(
                r,
                total_violations=total,
                ring_overflow=total > capacity,
                step_when_pumped=step,
                context=self.context,
            )
            for r in records
        ]
        for r, message in zip(records, messages, strict=True):
            logger.warning(message)
            self.rows.append(
                CanaryViolationRow(
                    launch_tag_name(r.launch_tag), tuple(fail_reason_labels(r.fail_reason)),
                    r.slot_idx, r.position, r.stored_token, r.expected_token,
                    r.stored_chain_hash, r.expected_aux, step,
                )
            )  # fmt: skip
        if self.mode == "abort":
            for r in records:
                self._implicate(r)
        if self.mode == "raise" and not self.raised:
            self.raised = True
            raise KVCanaryViolation("\n".join(messages))

    def _implicate(self, r: ViolationRecord) -> None:
        try:
            kind = split_launch_tag(r.launch_tag)[0]
        except ValueError:
            return
        if r.fail_reason & FailReason.VERIFY_NOT_RESIDENT:  # names the full slot (no SWA slot)
            self._full.add(r.slot_idx)
        elif kind == PoolKind.SWA:
            self._swa.add(r.slot_idx)
        elif kind == PoolKind.FULL:
            self._full.add(r.slot_idx)
        elif kind in self.state_rings:  # a ring row: whatever owns the ring (module doc)
            ring = self.state_rings[kind]
            owner = r.slot_idx // ring.ring_size
            if ring.addressing == "swa_page":
                self._swa.update(range(owner * ring.swa_page_size,
                                       (owner + 1) * ring.swa_page_size))  # fmt: skip
            else:  # request-addressed (SGLang's C128): the request's req->token row
                self._req_rows.add(owner)
        else:  # a compressed row summarises `ratio` consecutive full slots
            ratio = self.compression_ratios.get(kind, 1)
            self._full.update(range(r.slot_idx * ratio, (r.slot_idx + 1) * ratio))

    def take_implicated_slots(self) -> ImplicatedSlots | None:
        """What the rows reported since the last call implicate (abort mode), or None."""
        if not (self._full or self._swa or self._req_rows):
            return None
        out = ImplicatedSlots(
            *(torch.tensor(sorted(s), dtype=torch.int64)
              for s in (self._full, self._swa, self._req_rows))
        )  # fmt: skip
        self._full, self._swa, self._req_rows = set(), set(), set()
        return out

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Reported rows by launch tag and by fail reason."""
        by_tag = Counter(r.launch_tag for r in self.rows)
        by_reason = Counter(reason for r in self.rows for reason in r.fail_reasons)
        return dict(sorted(by_tag.items())), dict(sorted(by_reason.items()))
