"""The alias check: a slot this forward writes that a row also reads at another position is
a violation at HEAD, without fingerprints (``real_data none``), because a HEAD writes its
records before it verifies (kernels.dispatch).

Kernel level, every backend, on one buffer: the row reads slot ``S`` at position 5, the
write stores position 40 there in the same launch. Engine level: the allocator hands a page
request A still reads to request B's next decode token (the page put back on the free
list's head, as a double free would): B's store overwrites it, A reads it in the same
forward.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_prompts, start_decoding, tiny_engine

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.plan.types import VerifyPlan, WritePlan
from kvcanary.canary.report.ring import ViolationRing
from kvcanary.canary.wire.constants import FailReason
from kvcanary.canary.wire.records import as_int64_records
from kvcanary.memory.allocator import PagedAllocator
from kvcanary.memory.swa_allocator import SWAAllocator

_POSITION = int(FailReason.VERIFY_POSITION_MISMATCH)


def _write_plan(seed: int, tokens: list[int], positions: list[int], slots: list[int]) -> WritePlan:
    n = len(tokens)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return WritePlan(t([seed]), t([0]), t([n]), t(tokens), t(positions), t(slots), n, n)


def _world(backend: str) -> tuple[torch.Tensor, VerifyPlan, WritePlan, ViolationRing]:
    """A request wrote positions 0..7 into slots 10..17; the launch re-reads them and writes
    one new token (position 40) into slot 15."""
    rec = torch.zeros(64, 32, dtype=torch.uint8)
    ring = ViolationRing(16, torch.device("cpu"))
    tokens = torch.arange(100, 108, dtype=torch.int64)
    first = _write_plan(-1, tokens.tolist(), list(range(8)), list(range(10, 18)))
    kernels.write(rec, first, ring, 0, backend=backend)  # type: ignore[arg-type]
    slots = torch.arange(10, 18)
    prev = torch.cat([torch.tensor([-1]), slots[:-1]])
    verify = VerifyPlan.from_entries(slots, prev, torch.arange(8), tokens)
    write = _write_plan(17, [7], [40], [15])
    return rec, verify, write, ring


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("write_first", [False, True])
def test_launch_writing_a_slot_it_reads_elsewhere(backend: str, write_first: bool) -> None:
    rec, verify, write, ring = _world(backend)
    kernels.launch(rec, verify, write, ring, 0, check_token=True, backend=backend,  # type: ignore[arg-type]
                   write_first=write_first)  # fmt: skip
    rows = ring.rows[: int(ring.write_index[0])]
    if not write_first:  # SGLang's order: the read sees the old record; nothing to report
        assert rows.shape[0] == 0
        return
    # Slot 15 holds position 40 where the row reads 5; slot 16's chain was made from the
    # record slot 15 held before.
    assert rows[:, 1].tolist() == [15, 16], rows.tolist()
    assert rows[0, 2] == 40 and int(rows[0, 7]) & _POSITION
    assert int(rows[1, 7]) == int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
    assert as_int64_records(rec)[15, 1] == 40  # the write landed either way


def _full_allocator(engine: object) -> PagedAllocator:
    alloc = engine.runner.allocator  # type: ignore[attr-defined]
    return alloc.full_attn_allocator if isinstance(alloc, SWAAllocator) else alloc


@pytest.mark.parametrize("model", ["builtin:tiny-mha", "builtin:tiny-swa"])
def test_page_handed_out_while_read_is_caught_in_that_forward(model: str) -> None:
    engine = tiny_engine(model=model, page_size=4, max_total_tokens=2048,
                         canary=CanaryConfig(mode="log", real_data="none"))  # fmt: skip
    a_prompt, b_prompt = make_prompts(2, 30, 30, seed=5)
    start_decoding(engine, [a_prompt, b_prompt + [7, 7]], max_new_tokens=30)
    running = engine.scheduler.running
    a = next(r for r in running if r.prompt_ids == a_prompt)
    b = next(r for r in running if r is not a)
    while b.kv_len % 4 != 0:  # B's next forward stores its new token on a new page
        assert engine.step() == []
    engine.canary.flush()
    assert engine.canary.violations == []
    row = engine.kv.req_to_token[a.req_pool_idx]
    page = int(row[8]) // 4  # holds A's positions 8..11: read by every forward of A
    alloc = _full_allocator(engine)
    alloc.free_pages = torch.cat([torch.tensor([page]), alloc.free_pages])  # the double free
    position = b.kv_len  # B's next new token
    engine.step()
    engine.canary.flush()
    assert int(engine.kv.req_to_token[b.req_pool_idx, position]) == page * 4  # the fault fired
    rows = engine.canary.violations
    head = [r for r in rows if r.launch_tag == "HEAD_K_FULL" and r.slot_idx == page * 4]
    assert head, [(r.launch_tag, r.fail_reasons, r.slot_idx) for r in rows]
    assert "verify_position" in head[0].fail_reasons and head[0].position == position
