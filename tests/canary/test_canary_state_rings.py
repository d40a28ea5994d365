"""Compress-state rings (DeepSeek-V4 compressor state): the plans of :mod:`.state_plan` on
hand-computed batches, and the C4 / C128 / indexer state groups on a real DSV4KVPool at run
time: clean over chunked prefill and decode, and faults injected into the pool's ring rows
and mapping caught under the state kinds' own tags (rows outside the live tail: silent)."""

from __future__ import annotations

import pytest
import torch
from canary_fake_runner import FakeRunner
from test_canary_install import install

from kvcanary.canary.plan.reference import PlanInputs
from kvcanary.canary.plan.state import StateRing, build_state_plans
from kvcanary.canary.wire.constants import NO_SLOT, NO_TOKEN, PoolKind
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.swa_allocator import SWAAllocator

# ------------------------------------------------------------------ plans


def _inputs(r2t: torch.Tensor, rows: list[int], prefix: list[int], extend: list[int],
            out_cache_loc: list[int]) -> PlanInputs:  # fmt: skip
    pos = [p + j for p, e in zip(prefix, extend, strict=True) for j in range(e)]
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return PlanInputs(
        req_to_token=r2t, req_pool_indices=t(rows), prefix_lens=t(prefix),
        extend_lens=t(extend), input_ids=t([100 + p for p in pos]), positions=t(pos),
        out_cache_loc=t(out_cache_loc),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("ratio", "overlap", "ring_size", "seq", "tail"),
    [
        (4, True, 8, [0, 1, 3, 4, 7, 8, 11, 300], [0, 1, 3, 4, 7, 4, 7, 4]),
        (128, False, 128, [0, 5, 127, 128, 300], [0, 5, 127, 0, 44]),
        (128, False, 1, [0, 5, 128, 300], [0, 1, 0, 1]),  # SGLang's online C128: one row
    ],
)
def test_tail_is_the_open_window_and_the_overlap(ratio: int, overlap: bool, ring_size: int,
                                                 seq: list[int], tail: list[int]) -> None:  # fmt: skip
    ring = StateRing(ratio, ring_size, "request", overlap=overlap)
    assert ring.tail_len(torch.tensor(seq)).tolist() == tail


def test_request_ring_plans_chain_the_tail_and_skip_rows_the_forward_takes_over() -> None:
    ring = StateRing(4, 8, "request", overlap=True)
    r2t = torch.zeros((3, 32), dtype=torch.int32)
    # row 1: 10 committed, 3 new (positions 10..12); row 0: padding (1 token, skipped)
    plans = build_state_plans(_inputs(r2t, [1, 0], [10, 0], [3, 1], [0, 0, 0, 0]), ring, None)
    v = plans.verify
    assert v.positions.tolist() == [4, 5, 6, 7, 8, 9]  # tail(10) = 10 % 4 + 4 = 6
    assert v.slots.tolist() == [8 + p % 8 for p in range(4, 10)]
    # position 3 is still one of the last 8 rows of L = 10 (rows of 2..9): chained
    assert v.prev_slots.tolist() == [8 + p % 8 for p in range(3, 9)]
    assert v.expected_tokens.tolist() == [NO_TOKEN] * 6
    w = plans.write
    assert w.seed_slots.tolist() == [8 + 9 % 8, NO_SLOT]
    assert (w.num_tokens.tolist(), w.token_starts.tolist()) == ([3, 0], [0, 3])
    assert w.slots.tolist()[:3] == [8 + p % 8 for p in (10, 11, 12)]
    # after the forward, positions 10..12 took the rows of 2..4: TAIL skips position 4 only
    assert plans.tail_verify is not None
    assert plans.tail_verify.positions.tolist() == [5, 6, 7, 8, 9]


def test_the_first_tail_entry_is_unchained_when_its_predecessor_row_was_reused() -> None:
    ring = StateRing(128, 128, "request")
    r2t = torch.zeros((2, 400), dtype=torch.int32)
    plans = build_state_plans(_inputs(r2t, [1], [130], [1], [0]), ring, None)
    assert plans.verify.positions.tolist() == [128, 129]
    # 127 is one of the last 128 positions of L = 130 (2..129): reachable
    assert plans.verify.prev_slots.tolist() == [128 + 127, 128 + 128 % 128]
    ring1 = StateRing(128, 1, "request")  # online: the row holds only the last position
    plans = build_state_plans(_inputs(r2t, [1], [130], [1], [0]), ring1, None)
    assert plans.verify.positions.tolist() == [129]
    assert plans.verify.prev_slots.tolist() == [0]  # unreachable: the same row moved on
    assert plans.verify.slots.tolist() == [1] and plans.write.seed_slots.tolist() == [1]
    assert plans.tail_verify is not None and plans.tail_verify.num_entries == 0
    plans = build_state_plans(_inputs(r2t, [1], [0], [3], [0, 0, 0]), ring1, None)
    assert plans.write.seed_slots.tolist() == [NO_SLOT]  # the anchor
    assert plans.verify.num_entries == 0


def test_swa_page_rings_go_through_the_lut_and_an_evicted_predecessor_is_unreachable() -> None:
    P = 4
    ring = StateRing(4, 8, "swa_page", overlap=True, swa_page_size=P)
    r2t = torch.zeros((2, 16), dtype=torch.int32)
    r2t[1, :12] = torch.arange(4, 16)  # full slots 4..15
    lut = torch.zeros(20, dtype=torch.int64)
    lut[8:16] = torch.arange(12, 20)  # positions 4..11 in SWA pages 3 and 4; 0..3 evicted
    plans = build_state_plans(_inputs(r2t, [1], [11], [1], [15]), ring, lut)
    swa_row = lambda s: (s // P) * 8 + s % 8  # noqa: E731
    assert plans.verify.positions.tolist() == [4, 5, 6, 7, 8, 9, 10]  # tail(11) = 7
    assert plans.verify.slots.tolist() == [swa_row(s) for s in range(12, 19)]
    # position 3's SWA page is gone (LUT 0): unreachable, not a false chain mismatch
    assert plans.verify.prev_slots.tolist()[0] == 0
    assert plans.write.slots.tolist() == [swa_row(19)]
    assert plans.write.seed_slots.tolist() == [swa_row(18)]


def test_a_swa_page_ring_needs_the_lut_and_bad_rings_are_refused() -> None:
    r2t = torch.zeros((2, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="full->SWA LUT"):
        build_state_plans(_inputs(r2t, [1], [0], [1], [0]),
                          StateRing(4, 8, "swa_page", swa_page_size=4), None)  # fmt: skip
    with pytest.raises(ValueError, match="addressing='slot'; allowed: swa_page, request"):
        StateRing(4, 8, "slot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="swa_page_size=0"):
        StateRing(4, 8, "swa_page")


# ------------------------------------------------------------------ a DSV4 pool at run time

P = 128  # a C128 row needs a whole page
RATIOS = [0, 4, 128, 4]


def dsv4_runner(**cfg: object) -> FakeRunner:
    pool = DSV4KVPool(8 * P, 8 * P, P, RATIOS, 8, 4, torch.float32)
    alloc = SWAAllocator(8 * P, 8 * P, P, kvcache=pool)
    return install(FakeRunner(pool, alloc, sliding_window=64, max_context_len=512),
                   **{"real_data": "partial", **cfg})  # fmt: skip


def _run(runner: FakeRunner) -> None:
    """Chunked prefill in chunks that straddle C4 and C128 windows, then decode: 2 requests."""
    for chunk in (37, 37, 37, 90, 100):
        runner.forward([(1, chunk), (2, chunk // 3)])
    for _ in range(6):
        runner.forward([(1, 1), (2, 1)])


STATE_TAGS = ("C4_STATE", "C128_STATE", "INDEXER_STATE")


def test_state_groups_run_clean_over_chunked_prefill_and_decode() -> None:
    runner = dsv4_runner(verify_tokens=True)
    _run(runner)
    stats = runner.canary.stats()
    assert stats["violations"] == 0
    written = (3 * 37 + 90 + 100 + 6) + (3 * 12 + 30 + 33 + 6)  # every token, in every ring
    for kind in STATE_TAGS:
        assert stats["write_entries_by_tag"][f"TAIL_K_{kind}"] == written
        assert stats["verify_entries_by_tag"][f"HEAD_K_{kind}"] > 0
    # a decode step verifies only the live tails: C4 <= 7 rows per request, C128 < 128
    assert stats["verify_entries_by_tag"]["HEAD_K_C4_STATE"] <= 11 * 2 * 7


def _ring(runner: FakeRunner, kind: str) -> tuple[torch.Tensor, int]:
    pool = runner.token_to_kv_pool
    sub = {"C4_STATE": pool.compress_state_pools[4], "C128_STATE": pool.compress_state_pools[128],
           "INDEXER_STATE": pool.indexer_compress_state_pool}[kind]  # fmt: skip
    return sub.buffers[0], sub.rows_per_page


def _row_of(runner: FakeRunner, req: int, position: int, ring_size: int) -> int:
    pool = runner.token_to_kv_pool
    full = int(runner.req_to_token_pool.req_to_token[req, position])
    swa = int(pool.full_to_swa_index_mapping[full])
    return (swa // P) * ring_size + swa % ring_size


@pytest.mark.parametrize("kind", STATE_TAGS)
def test_a_byte_flip_in_a_live_tail_row_is_caught_under_the_ring_tag(kind: str) -> None:
    runner = dsv4_runner()
    _run(runner)  # request 1: 307 tokens (C4 tail 307 % 4 + 4 = 7: 300..306, C128: 256..306)
    buf, ring_size = _ring(runner, kind)
    row = _row_of(runner, 1, 305, ring_size)
    buf.view(torch.uint8)[row, 3] ^= 0x10  # layer 0 is the fingerprinted one
    runner.forward([(1, 1), (2, 1)])
    # only TAIL records carry fingerprints: the next forward's TAIL verify sees it
    bad = [v for v in runner.canary.violations if v.launch_tag == f"TAIL_K_{kind}"]
    assert [(v.slot_idx, v.position, v.fail_reasons) for v in bad] == [
        (row, 305, ("verify_real_kv_hash",))
    ]


def test_a_byte_flip_outside_the_live_tail_is_not_a_violation() -> None:
    runner = dsv4_runner()
    _run(runner)
    buf, ring_size = _ring(runner, "C128_STATE")
    # 200 is in the C128 window [128, 256), compressed long ago: its ring row is dead (and
    # no live position shares it: the open window 256..306 has a ring of its own)
    row = _row_of(runner, 1, 200, ring_size)
    buf.view(torch.uint8)[row, 3] ^= 0x10
    runner.forward([(1, 1), (2, 1)])
    assert runner.canary.stats()["violations"] == 0


def test_a_state_row_stored_in_the_wrong_ring_slot_is_caught() -> None:
    """The compressor writes position 305's state into 304's row (misdirected store):
    304's row no longer holds what its record fingerprinted."""
    runner = dsv4_runner()
    _run(runner)
    buf, ring_size = _ring(runner, "C128_STATE")
    src, dst = _row_of(runner, 1, 305, ring_size), _row_of(runner, 1, 304, ring_size)
    buf[dst] = buf[src]
    runner.forward([(1, 1), (2, 1)])
    rows = {(v.launch_tag, v.slot_idx) for v in runner.canary.violations}
    assert ("TAIL_K_C128_STATE", dst) in rows and ("TAIL_K_C128_STATE", src) not in rows


def test_a_stale_swa_mapping_points_the_ring_at_another_requests_rows() -> None:
    """Position 305 of request 1 remapped onto request 2's SWA page: the rings follow the
    mapping, so every ring's record there names another position and chain."""
    runner = dsv4_runner()
    _run(runner)
    pool = runner.token_to_kv_pool
    r2t = runner.req_to_token_pool.req_to_token
    full_1, full_2 = int(r2t[1, 305]), int(r2t[2, 100])
    pool.full_to_swa_index_mapping[full_1] = pool.full_to_swa_index_mapping[full_2]
    runner.forward([(1, 1), (2, 1)])
    by_tag: dict[str, set[str]] = {}
    for v in runner.canary.violations:
        if v.position in (305, 100):
            by_tag.setdefault(v.launch_tag, set()).update(v.fail_reasons)
    for kind in ("SWA", *STATE_TAGS):
        assert "verify_position" in by_tag[f"HEAD_K_{kind}"], kind
    assert PoolKind.C4_STATE.name == "C4_STATE"  # the tag names carry the kind's name


def test_explain_names_the_ring_and_the_cause(caplog: pytest.LogCaptureFixture) -> None:
    from kvcanary.canary.explain import explain

    runner = dsv4_runner()
    _run(runner)
    buf, ring_size = _ring(runner, "INDEXER_STATE")
    row = _row_of(runner, 1, 303, ring_size)
    buf.view(torch.uint8)[row, 0] ^= 0x01
    with caplog.at_level("WARNING", logger="kvcanary.canary"):
        runner.forward([(1, 1), (2, 1)])
    summary = explain(caplog.text)
    assert summary["by_tag"] == {"TAIL_K_INDEXER_STATE": 1}
    (cause,) = summary["causes"]
    assert cause["cause"] == "compress_state_corruption"
    assert f"ring row {row} (the raw state of position 303)" in cause["evidence"][0]
    assert summary["top_slots"][0]["group"] == "INDEXER_STATE"
