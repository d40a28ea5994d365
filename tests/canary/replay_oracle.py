"""An independent read oracle for the upstream-bug replays: what each KV slot really holds
against what the request reading it expects, from the engine's own forward batches.

Attached to an engine (its ``runner.forward`` wrapped; full-attention models: every layer
reads ``req_to_token[row, :seq_len]``), it follows every forward:

* a **store** at position ``p`` (slot ``out_cache_loc[j]``, token ``input_ids[j]``) leaves
  ``slot -> (p, token, token history, context)``: the writer's own token sequence up to
  ``p`` (its true tokens before this forward, then the tokens it was fed) and a hash of
  everything it read at positions ``< p`` with its own token (what its K/V above the first
  layer was computed from);
* a **read** is each position ``< seq_len`` of each request in the forward. It is
  **foreign** when the slot holds another position, token or token history than the
  request's true tokens (its prompt + outputs, from the scheduler's ``Req``) give there, or
  was never written; **tainted** when only the context differs (K/V computed, correctly
  placed, from reads that were foreign). Both are bad reads.

Nothing here calls the canary: the oracle says where and when a forward first read bad KV;
the tests compare that with where and when the canary reported it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from log_lines import log_lines

from kvcanary import Engine

_SEED = 0x5EED

Content = tuple[int, int, int, int]  # position, token, token history, context


def _content(position: int, token: int, history: int, context: int) -> Content:
    return position, token, hash((history, token)), hash((context, token))


@dataclass(frozen=True)
class BadRead:
    forward: int  # 1-based count of forwards
    rid: int
    position: int
    slot: int
    foreign: bool  # False: tainted
    stored_now: bool  # what it read was stored by this same forward (another position's)
    next_slot: int | None  # the reader's slot of position + 1 (None: the last it reads)


@dataclass
class ReadOracle:
    engine: Engine
    forwards: int = 0
    reads: int = 0
    bad: list[BadRead] = field(default_factory=list)
    batches: list[tuple[bool, list[int]]] = field(default_factory=list)  # (decode?, rids)
    retracted: list[tuple[int, int]] = field(default_factory=list)  # (forwards so far, rid)
    _slots: dict[int, Content] = field(default_factory=dict)

    def attach(self) -> ReadOracle:
        runner = self.engine.runner
        forward = runner.forward

        def observed(fb: Any, *args: Any, **kwargs: Any) -> Any:
            self.observe(fb)
            return forward(fb, *args, **kwargs)

        runner.forward = observed  # an instance attribute: the scheduler calls runner.forward
        kv = self.engine.scheduler.kv
        retract = kv.retract

        def retracting(req: Any) -> None:
            self.retracted.append((self.forwards, req.rid))
            retract(req)

        kv.retract = retracting  # type: ignore[method-assign]
        return self

    @property
    def first_bad_forward(self) -> int | None:
        return self.bad[0].forward if self.bad else None

    def foreign(self, forward: int | None = None, *, stored_before: bool = False) -> list[BadRead]:
        """Foreign reads (of ``forward``; ``stored_before``: only of what an earlier forward
        stored, which the records show before this forward's own stores land)."""
        return [b for b in self.bad if b.foreign and forward in (None, b.forward)
                and not (stored_before and b.stored_now)]  # fmt: skip

    def foreign_slots(self, forward: int | None = None) -> set[int]:
        return {b.slot for b in self.foreign(forward)}

    def bad_rids(self) -> set[int]:
        return {b.rid for b in self.bad}

    def observe(self, fb: Any) -> None:
        """One forward. Every store lands before any read (attention stores each layer's
        new K/V for the whole batch, then attends), so a slot another request of the batch
        stores reads as that request's store."""
        self.forwards += 1
        self.batches.append((fb.is_decode, list(fb.rids)))
        table = self.engine.runner.req_to_token_pool.req_to_token
        reqs = {r.rid: r for r in self.engine.scheduler.running}
        ids, positions, locs = fb.input_ids.tolist(), fb.positions.tolist(), fb.out_cache_loc.tolist()
        spans, offset = [], 0
        for i, rid in enumerate(fb.rids):
            prefix, seq = fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i]
            spans.append((rid, prefix, seq, table[int(fb.req_pool_indices[i]), :seq].tolist(), offset))
            offset += seq - prefix
        # This forward's stores, the last writer of a slot winning: slot -> (rid, position).
        writer = {locs[start + k]: (rid, prefix + k) for rid, prefix, seq, _, start in spans
                  for k in range(seq - prefix)}  # fmt: skip
        stored: dict[tuple[int, int], Content] = {}
        for rid, prefix, seq, slots, start in spans:
            truth = reqs[rid].all_ids()
            history = context = expected_history = expected_context = _SEED
            for p, slot in enumerate(slots):
                if p >= prefix:
                    j = start + p - prefix
                    assert positions[j] == p and locs[j] == slot, "batch and req->token disagree"
                    stored[(rid, p)] = _content(p, ids[j], history, context)
                who = writer.get(slot)
                held: Any = self._slots.get(slot) if who is None else stored.get(who, who)
                expected = _content(p, truth[p], expected_history, expected_context)
                self.reads += 1
                if held != expected:
                    foreign = not isinstance(held, tuple) or len(held) != 4 or held[:3] != expected[:3]
                    after = slots[p + 1] if p + 1 < seq else None
                    self.bad.append(BadRead(self.forwards, rid, p, slot, foreign, who is not None, after))
                history = hash((history, truth[p] if p < prefix else ids[start + p - prefix]))
                context = hash((context, held))
                expected_history = hash((expected_history, truth[p]))
                expected_context = hash((expected_context, expected))
        for slot, who in writer.items():
            self._slots[slot] = stored[who]


@contextmanager
def canary_log() -> Iterator[list[str]]:
    """The canary's log lines (logger ``kvcanary.canary``, warnings and up) while inside."""
    with log_lines("kvcanary.canary") as handler:
        yield handler.lines
