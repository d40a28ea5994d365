"""Abort mode on a DeepSeek-V4 pool (``builtin:tiny-dsv4``): a fault in a compressed
sub-pool (C4, C128, the C4 indexer) or a compress-state ring (C4, C128, indexer) aborts
exactly the running requests that reference the corrupt row, and the engine keeps serving.

The run is tests/canary/test_canary_abort_shared.py's (its helpers, its checks); only the
workload and the faults differ. Pages hold 128 tokens (a C128 row needs a whole page), so
the prompts are longer: wave 1 leaves a 400-token and a 270-token prompt in the prefix
cache, and wave 2's B and C both match the latter's first two pages (tree-owned, locked by
both) while A shares nothing. The SWA pool is an eighth of the full one, so wave 2 makes
the prefix cache give SWA pages back and its own pages' SWA ids differ from their full ids
(a fault's requests found by comparing full slots with SWA ids, or the reverse, miss)::

    positions   0 ........ 127 | 128 ....... 255 | 256 ...
    B, C        shared page 0  | shared page 1   | own page (tail, window, rings)
    A           own page 0 (tree-owned, A's lock only) | own page 1 (tail ...)

Each fault is written straight into engine state (a KV byte of a compressed row or of a
ring row, a record, a full->SWA mapping entry); the expected aborted set is computed from
the req->token rows and the pool's own addressing (``compressed_loc`` / ``state_loc``),
never from the reporter's mapping of a violation row back to slots.

A request-addressed ring (SGLang's C128; kvcanary's own rings are all SWA-page addressed)
names no pool slot: its row names the req->token row of the request owning the ring, and
that request alone is aborted. The last tests check that path on this engine and the
reporter's row -> slots table for every kind.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_canary_abort_shared import (
    PARAMS,
    Fault,
    Target,
    Workload,
    _assert_nothing_leaked,
    _check,
    _clean,
    _holders,
    _req,
    _rows_of,
    _start,
)

from kvcanary import Engine
from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.plan.state import StateAddressing, StateRing
from kvcanary.canary.report.reporter import ViolationReporter
from kvcanary.canary.wire.constants import (
    CANARY_FIELD_POSITION,
    FailReason,
    KvHalf,
    LaunchStage,
    PoolKind,
    launch_tag,
)
from kvcanary.canary.wire.records import as_int64_records
from kvcanary.canary.wire.violation import ViolationRecord
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.swa_allocator import SWAAllocator

P = 128
_rng = random.Random(12)
SHARED = tuple(_rng.randrange(256) for _ in range(270))
WORKLOAD = Workload(
    model="builtin:tiny-dsv4",
    page_size=P,
    wave1=(tuple(_rng.randrange(256) for _ in range(400)), SHARED),
    wave2=(
        tuple(_rng.randrange(256) for _ in range(170)),  # A
        SHARED[: 2 * P] + tuple(_rng.randrange(256) for _ in range(25)),  # B
        SHARED[: 2 * P] + tuple(_rng.randrange(256) for _ in range(33)),  # C
    ),
    late=tuple(_rng.randrange(256) for _ in range(17)),
    fresh=tuple(tuple(_rng.randrange(256) for _ in range(n)) for n in (150, 40)),
    num_decode_steps=3,
    max_total_tokens=8192,
    swa_full_tokens_ratio=0.125,
)
assert PARAMS.max_new_tokens is not None and PARAMS.max_new_tokens > WORKLOAD.num_decode_steps + 2


# ------------------------------------------------------------------ engine state helpers


def _pool(engine: Engine) -> DSV4KVPool:
    pool = engine.runner.token_to_kv_pool
    assert isinstance(pool, DSV4KVPool)
    return pool


def _layer(engine: Engine, ratio: int) -> int:
    """The first layer of compression ``ratio``: the one real-data "first" fingerprints."""
    return next(i for i, e in enumerate(_pool(engine).layer_mapping) if e.ratio == ratio)


def _group(engine: Engine, kind: PoolKind) -> CanaryBufferGroup:
    return next(g for g in engine.canary.groups if g.kind == kind)


def _slot(engine: Engine, rid: int, pos: int) -> int:
    req = _req(engine, rid)
    assert 0 <= pos < req.kv_len
    return int(engine.kv.req_to_token[req.req_pool_idx, pos])


def _row(engine: Engine, kind: str, rid: int, pos: int) -> int:
    """The row of DSV4 group ``kind`` holding position ``pos`` of request ``rid``."""
    slot = torch.tensor([_slot(engine, rid, pos)])
    row = int(_rows_of(engine, kind, slot)[0])
    assert row > 0, f"position {pos} of request {rid} has no {kind} row"
    return row


def _flip(buf: torch.Tensor, row: int) -> None:
    """XOR byte 0 of row ``row`` (real_data partial fingerprints a row's first bytes)."""
    buf[row].view(-1).view(torch.uint8)[0] ^= 0xFF


def _target(engine: Engine, kind: str, row: int, holders: set[int]) -> Target:
    target = Target(rows={kind: [row]}, holders=len(holders))
    assert _holders(engine, target) == holders
    return target


def _tail(engine: Engine, rid: int, back: int) -> int:
    """Position ``back`` before request ``rid``'s end: in every ring's live tail (C128's
    open window included, which the workload keeps wider than 2 positions)."""
    req = _req(engine, rid)
    assert req.kv_len % 128 > back
    return req.kv_len - back


# ------------------------------------------------------------------ faults (A, B, C: wave 2)


def c4_kv_flip_shared(engine: Engine, a: int, b: int, c: int) -> Target:
    """A byte of the C4 entry of a complete block in the tree page B and C both lock."""
    row = _row(engine, "C4", b, 203)  # block 50: positions 200..203
    _flip(_pool(engine).get_compressed_buffer(_layer(engine, 4)), row)
    return _target(engine, "C4", row, {b, c})


def indexer_kv_flip_own(engine: Engine, a: int, b: int, c: int) -> Target:
    """A byte of the C4 indexer entry of a complete block past A's tree-owned page."""
    row = _row(engine, "INDEXER", a, 135)  # block 33: positions 132..135
    block = list(range(row * 4, row * 4 + 4))
    assert _holders(engine, Target(swa=block)) != {a}  # its full ids are not A's SWA ids
    _flip(_pool(engine).get_indexer_buffer(_layer(engine, 4)), row)
    return _target(engine, "INDEXER", row, {a})


def c128_kv_flip_shared(engine: Engine, a: int, b: int, c: int) -> Target:
    """A byte of the C128 entry of the shared second page (positions 128..255)."""
    row = _row(engine, "C128", c, 255)
    _flip(_pool(engine).get_compressed_buffer(_layer(engine, 128)), row)
    return _target(engine, "C128", row, {b, c})


def c128_record_tamper(engine: Engine, a: int, b: int, c: int) -> Target:
    """The position field of the C128 HEAD record of A's first page (tree-owned, A's lock)."""
    row = _row(engine, "C128", a, 127)
    as_int64_records(_group(engine, PoolKind.C128).k_head)[row, CANARY_FIELD_POSITION] += 1
    return _target(engine, "C128", row, {a})


def c4_state_flip(engine: Engine, a: int, b: int, c: int) -> Target:
    """A byte of the C4 compress-state ring row of a live-tail position of A."""
    row = _row(engine, "C4_STATE", a, _tail(engine, a, 2))
    _flip(_pool(engine).get_state_buffer(_layer(engine, 4)), row)
    return _target(engine, "C4_STATE", row, {a})


def indexer_state_record_tamper(engine: Engine, a: int, b: int, c: int) -> Target:
    """The position field of the indexer ring's HEAD record of a live-tail position of B."""
    row = _row(engine, "INDEXER_STATE", b, _tail(engine, b, 2))
    group = _group(engine, PoolKind.INDEXER_STATE)
    as_int64_records(group.k_head)[row, CANARY_FIELD_POSITION] += 1
    return _target(engine, "INDEXER_STATE", row, {b})


def c128_state_flip(engine: Engine, a: int, b: int, c: int) -> Target:
    """A byte of the C128 compress-state ring row of a live-tail position of C (its own
    page, past the two it shares with B)."""
    row = _row(engine, "C128_STATE", c, _tail(engine, c, 1))
    _flip(_pool(engine).get_state_buffer(_layer(engine, 128)), row)
    return _target(engine, "C128_STATE", row, {c})


def swa_mapping(engine: Engine, a: int, b: int, c: int) -> Target:
    """A's live-tail full slot's SWA mapping -> B's (the latent KV and every ring row of
    that position now B's): the SWA group and the rings see it."""
    mapping = engine.runner.allocator.full_to_swa_index_mapping
    f_a, f_b = (_slot(engine, r, _tail(engine, r, 2)) for r in (a, b))
    assert int(mapping[f_a]) > 0 and int(mapping[f_b]) > 0
    mapping[f_a] = mapping[f_b]
    target = Target(swa=[int(mapping[f_b])], holders=2)
    assert _holders(engine, target) == {a, b}
    return target


FAULTS: dict[str, Fault] = {f.__name__: f for f in (
    c4_kv_flip_shared, indexer_kv_flip_own, c128_kv_flip_shared, c128_record_tamper,
    c4_state_flip, indexer_state_record_tamper, c128_state_flip, swa_mapping,
)}  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS)
def test_abort_on_a_dsv4_pool_aborts_exactly_the_requests_referencing_the_row(fault: str) -> None:
    _check(WORKLOAD, FAULTS[fault])


def test_a_request_addressed_ring_row_aborts_exactly_the_request_owning_it() -> None:
    """SGLang's C128 ring is addressed by request (row = req_pool_idx * ring_size + position
    % ring_size), so its row names no pool slot, only the request owning the ring. With the
    reporter reading the C128 ring that way, a violation in a row of B's ring aborts B alone
    and quarantines nothing (the ring is B's own state); A and C finish as in the clean run
    and nothing leaks."""
    engine, (a, b, c) = _start(WORKLOAD)
    reporter = engine.canary.reporter
    ring = reporter.state_rings[PoolKind.C128_STATE]
    reporter.state_rings[PoolKind.C128_STATE] = dataclasses.replace(ring, addressing="request")
    req_b = _req(engine, b)
    pos = req_b.kv_len - 1
    tag = launch_tag(PoolKind.C128_STATE, LaunchStage.TAIL, KvHalf.K)
    row = req_b.req_pool_idx * ring.ring_size + pos % ring.ring_size
    reporter.report([ViolationRecord(int(tag), row, pos, -1, -1, 0, 0, int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH))],
                    total=1, capacity=1, step=0)  # fmt: skip
    outs = {o.rid: o for o in engine.step()}
    assert engine.canary.aborted_request_ids == [b]
    while engine.has_unfinished():
        outs.update((o.rid, o) for o in engine.step())
    clean = _clean(WORKLOAD).outs
    assert outs[b].finish_reason == "abort"
    assert [outs[r].output_ids for r in (a, c)] == [clean[r].output_ids for r in (a, c)]
    alloc = engine.runner.allocator
    assert isinstance(alloc, SWAAllocator)
    assert alloc.full_attn_allocator.num_quarantined_pages() == 0
    assert alloc.swa_attn_allocator.num_quarantined_pages() == 0
    _assert_nothing_leaked(engine)


def _reporter(ring: StateRing) -> ViolationReporter:
    return ViolationReporter("abort", {PoolKind.C4: 4, PoolKind.C128: 128, PoolKind.INDEXER: 4},
                             {PoolKind.C4_STATE: ring})  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "addressing", "reason", "full", "swa", "req_rows"),
    [
        (PoolKind.FULL, "swa_page", FailReason.VERIFY_POSITION_MISMATCH, [21], [], []),
        (PoolKind.SWA, "swa_page", FailReason.VERIFY_POSITION_MISMATCH, [], [21], []),
        (PoolKind.SWA, "swa_page", FailReason.VERIFY_NOT_RESIDENT, [21], [], []),  # a full slot
        (PoolKind.C4, "swa_page", FailReason.VERIFY_REAL_KV_HASH_MISMATCH, [84, 85, 86, 87], [], []),
        (PoolKind.INDEXER, "swa_page", FailReason.WRITE_POSITION_MISMATCH, [84, 85, 86, 87], [], []),
        (PoolKind.C128, "swa_page", FailReason.VERIFY_REAL_KV_HASH_MISMATCH, list(range(21 * 128, 22 * 128)),
         [], []),
        # ring row 21 of 8-row rings: ring 2, i.e. SWA page 2 (slots 32..47 with pages of 16)
        (PoolKind.C4_STATE, "swa_page", FailReason.VERIFY_REAL_KV_HASH_MISMATCH, [], list(range(32, 48)), []),
        (PoolKind.C4_STATE, "request", FailReason.VERIFY_REAL_KV_HASH_MISMATCH, [], [], [2]),  # req row 2
    ],
)  # fmt: skip
def test_what_a_violation_row_implicates(
    kind: PoolKind, addressing: StateAddressing, reason: FailReason, full: list[int],
    swa: list[int], req_rows: list[int],
) -> None:  # fmt: skip
    """Reporter module doc: each kind's row 21 -> the slots (or request row) it names."""
    reporter = _reporter(StateRing(4, 8, addressing, overlap=True, swa_page_size=16))
    tag = launch_tag(kind, LaunchStage.TAIL, KvHalf.K)
    reporter.report([ViolationRecord(int(tag), 21, 5, -1, -1, 0, 0, int(reason))], total=1,
                    capacity=1, step=0)  # fmt: skip
    out = reporter.take_implicated_slots()
    assert out is not None
    assert (out.full.tolist(), out.swa.tolist(), out.req_rows.tolist()) == (full, swa, req_rows)
    assert reporter.take_implicated_slots() is None  # handed over once
