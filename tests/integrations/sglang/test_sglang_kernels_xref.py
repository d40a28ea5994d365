"""Our canary kernels and plans against SGLang 0.5.23's own, on the same random inputs.

See :mod:`sglang_xref` for what a scenario is and what is compared after every launch.
``KVCANARY_SGLANG_XREF_SCENARIOS`` (default 400) sets how many random scenarios run.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import sglang_xref as X
import torch
from sglang.version import __version__ as sglang_version

from kvcanary.canary.wire.constants import (
    CanaryLaunchTag,
    FailReason,
    KvHalf,
    LaunchStage,
    PoolKind,
    RealKvHashMode,
)
from kvcanary.canary.wire.hashing import ANCHOR_HASH_I64, chain_hash, to_i64

NUM_SCENARIOS = int(os.environ.get("KVCANARY_SGLANG_XREF_SCENARIOS", "400"))
NUM_CLEAN_SCENARIOS = max(1, NUM_SCENARIOS // 8)


def test_sglang_version_is_the_pinned_one() -> None:
    assert sglang_version == "0.5.23"


@pytest.mark.parametrize("seed", range(20))
def test_public_launchers_equal_the_references(seed: int) -> None:
    """Off CUDA, SGLang's public launchers (launch_canary_{plan,verify,write}_kernel) give
    exactly what the references give, so comparing against the references is comparing
    against what SGLang runs on a CPU."""
    X.run_scenario(X.ScenarioConfig.draw(seed), ("sglang", "sglang_launchers"))


@pytest.mark.parametrize("seed", range(NUM_SCENARIOS))
def test_random_scenario_matches_sglang(seed: int) -> None:
    """Records, violation rows (fail bits, slot, position, tokens, hashes), ring index,
    run counters and plans equal SGLang's after every launch of every forward."""
    X.run_scenario(X.ScenarioConfig.draw(seed))


@pytest.mark.parametrize("seed", range(10_000, 10_000 + NUM_CLEAN_SCENARIOS))
def test_records_written_by_either_verify_clean_under_the_other(seed: int) -> None:
    """A fault-free run: no violation anywhere; then every committed position of every
    running request (HEAD and TAIL buffers, K and V, FULL and SWA) is verified by SGLang on
    our records and by us on SGLang's (TAIL with the real-KV fingerprints): still none."""
    cfg = X.ScenarioConfig.draw(seed, clean=True)
    world, impls = X.run_scenario(cfg, ("sglang", "numba", "torch"), clean=True)
    for impl in impls.values():
        assert impl.ring_state()[0] == 0, f"{impl.name}: violations in a fault-free run"
    sg = impls["sglang"]
    checked = 0
    for ours in (impls["numba"], impls["torch"]):
        sg.bufs, ours.bufs = ours.bufs, sg.bufs  # each verifies the other's records
        try:
            for gi in range(len(world.groups)):
                plans = X.sweep_plans(world, gi)
                if plans is None:
                    continue
                for key in [k for k in sg.bufs if k[0] == gi]:
                    sg.verify_plan(gi, key[1], key[2], plans[0])
                    ours.verify_plan(gi, key[1], key[2], plans[1])
                    checked += 1
        finally:
            sg.bufs, ours.bufs = ours.bufs, sg.bufs
        assert sg.ring_state()[0] == 0, f"SGLang flags records written by {ours.name}"
        assert ours.ring_state()[0] == 0, f"{ours.name} flags records written by SGLang"
    assert checked or not world.requests


# ----------------------------------------------------------------------------- single faults


def _clean_world(seed: int, **overrides: object) -> tuple[X.World, dict[str, X.Impl]]:
    """A fault-free run with at least one request holding >= 4 committed tokens."""
    for attempt in range(50):
        cfg = dataclasses.replace(X.ScenarioConfig.draw(seed * 100 + attempt, clean=True),
                                  num_steps=8, write_input_assert=False, **overrides)  # fmt: skip
        world, impls = X.run_scenario(cfg, clean=True)
        if any(r.computed >= 4 for r in world.requests.values()):
            return world, impls
    raise AssertionError("no scenario with a request of 4+ tokens")


def _victim(world: X.World) -> X.Request:
    return max(world.requests.values(), key=lambda r: r.computed)


def _run_victim_forward(world: X.World, impls: dict[str, X.Impl], req: X.Request) -> list[list[int]]:
    """One forward of ``req`` alone, compared launch by launch; SGLang's new ring rows."""
    before = impls["sglang"].ring_state()[0]
    fwd = world.build_forward([req], clean=True)
    X.run_forward(world, impls, fwd, "after corruption")
    n, rows = impls["sglang"].ring_state()
    assert n > before, "the corruption went unnoticed"
    return rows[before:].tolist()


def _has(rows: list[list[int]], tag: int, slot: int, bit: int) -> bool:
    return any(r[0] == tag and r[1] == slot and r[7] & bit for r in rows)


RECORD_FAULTS = {  # field -> (bit at the corrupted slot or None, bit at its successor or None)
    "token": (None, FailReason.VERIFY_CHAIN_HASH_MISMATCH),
    "position": (FailReason.VERIFY_POSITION_MISMATCH, FailReason.VERIFY_CHAIN_HASH_MISMATCH),
    "chain": (FailReason.VERIFY_CHAIN_HASH_MISMATCH, None),
    "real_kv_field": (FailReason.VERIFY_REAL_KV_HASH_MISMATCH, None),
}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("fault", "stage"),
    [(f, s) for f in RECORD_FAULTS for s in (LaunchStage.HEAD, LaunchStage.TAIL)],
)
def test_record_field_fault_same_bits(fault: str, stage: LaunchStage, seed: int) -> None:
    """A stored token / position / chain hash / real-KV field of one FULL K record (HEAD or
    TAIL buffer): SGLang and ours report the same rows, with the expected bit on the slot or
    its successor. (HEAD records hold real_kv_hash 0 and HEAD verifies against 0, so a
    corrupted HEAD field 3 is a real-KV mismatch too.)"""
    world, impls = _clean_world(seed)
    req = _victim(world)
    p = random.Random(seed).randrange(1, req.computed - 1)
    slot, succ = (int(world.req_to_token[req.row, q]) for q in (p, p + 1))
    field = list(RECORD_FAULTS).index(fault)
    for impl in impls.values():
        rec = impl.bufs[0, stage, KvHalf.K].view(torch.int64)
        rec[slot, field] = int(rec[slot, field]) ^ 0x5A5A
    rows = _run_victim_forward(world, impls, req)
    tag = int(CanaryLaunchTag.HEAD_K_FULL if stage == LaunchStage.HEAD else CanaryLaunchTag.TAIL_K_FULL)
    at_slot, at_succ = RECORD_FAULTS[fault]
    assert at_slot is None or _has(rows, tag, slot, at_slot), rows
    assert at_succ is None or _has(rows, tag, succ, at_succ), rows


@pytest.mark.parametrize("seed", range(8))
def test_predecessor_remap_same_bits(seed: int) -> None:
    """req->token[p] remapped to the request's own slot of another position: position bit on
    the remapped entry, chain bit on its successor (whose predecessor is now wrong)."""
    world, impls = _clean_world(seed)
    req = _victim(world)
    rng = random.Random(seed)
    p = rng.randrange(1, req.computed - 1)
    other = rng.choice([q for q in range(req.computed) if q != p])
    new, succ = int(world.req_to_token[req.row, other]), int(world.req_to_token[req.row, p + 1])
    world.req_to_token[req.row, p] = new
    rows = _run_victim_forward(world, impls, req)
    tag = int(CanaryLaunchTag.HEAD_K_FULL)
    assert _has(rows, tag, new, FailReason.VERIFY_POSITION_MISMATCH), rows
    assert _has(rows, tag, succ, FailReason.VERIFY_CHAIN_HASH_MISMATCH), rows


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
def test_real_kv_byte_fault_same_bits(mode: RealKvHashMode, seed: int) -> None:
    """One flipped bit in a slot's K bytes (inside the read window): TAIL real-KV bit there."""
    world, impls = _clean_world(seed, mode=mode)
    req = _victim(world)
    rng = random.Random(seed)
    slot = int(world.req_to_token[req.row, rng.randrange(req.computed)])
    read = 16 if mode == RealKvHashMode.PARTIAL else world.cfg.bytes_per_token
    row, col = world.kv_cols(slot)
    world.full.kv[KvHalf.K][row, col + rng.randrange(read)] ^= 1 << rng.randrange(8)
    rows = _run_victim_forward(world, impls, req)
    assert _has(rows, int(CanaryLaunchTag.TAIL_K_FULL), slot,
                FailReason.VERIFY_REAL_KV_HASH_MISMATCH), rows  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_lut_entry_fault_same_bits(seed: int) -> None:
    """The full->SWA LUT entry of an in-window position points at the SWA slot of another
    in-window position: position bit on that SWA slot under HEAD_K_SWA."""
    world, impls = _clean_world(seed, swa_window=random.Random(seed).choice([3, 5, 8]))
    req = _victim(world)
    swa = world.swa
    assert swa is not None and swa.lut is not None and world.cfg.swa_window is not None
    rng = random.Random(seed)
    window = range(max(0, req.computed - world.cfg.swa_window), req.computed)
    p, other = rng.sample(list(window), 2)
    full = int(world.req_to_token[req.row, p])
    new = int(swa.lut[int(world.req_to_token[req.row, other])])
    assert new != 0
    swa.lut[full] = new
    rows = _run_victim_forward(world, impls, req)
    assert _has(rows, int(CanaryLaunchTag.HEAD_K_SWA), new, FailReason.VERIFY_POSITION_MISMATCH), rows


# ----------------------------------------------------------------------------- known corner


def test_seed_slot_written_earlier_in_the_same_write() -> None:
    """Cross-request aliasing inside one write launch (see ``sglang_xref.SEED_ALIASING``).

    Batch row 0 (req row 1) writes its first token into slot 5; batch row 1 (req row 2)
    has a one-token prefix whose req->token entry was remapped onto slot 5, which still
    holds a stale record (position 9) from a previous owner. SGLang's reference seeds row 1
    from the record row 0 just stored (chain from token 11 @ 0, position assert satisfied);
    the stored records and rows must be SGLang's.
    """
    cfg = dataclasses.replace(X.ScenarioConfig.draw(0, clean=True), page_size=1,
                              swa_window=None, v_half=False, mode=RealKvHashMode.NONE,
                              check_token=False, write_input_assert=False,
                              chain_position_assert=True, verify_capacity=100,
                              ring_capacity=16)  # fmt: skip
    world = X.World(cfg, random.Random(0))
    impls = X.make_impls(world)
    world.req_to_token[2, 0] = 5
    for impl in impls.values():
        impl.bufs[0, LaunchStage.HEAD, KvHalf.K].view(torch.int64)[5, :4] = torch.tensor(
            [77, 9, 123, 0]
        )
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    fwd = X.Forward(t([1, 2]), t([0, 1]), t([1, 1]), t([11, 22]), t([0, 1]), t([5, 7]),
                    None, None, None, None, write_req_capacity=2)  # fmt: skip
    plans = {name: impl.plan(0, fwd) for name, impl in impls.items()}
    for impl in impls.values():
        impl.write(0, LaunchStage.HEAD, KvHalf.K, plans[impl.name], fwd)
    sg = impls["sglang"].bufs[0, LaunchStage.HEAD, KvHalf.K].view(torch.int64)
    expected_seed = to_i64(chain_hash(ANCHOR_HASH_I64, 11, 0))
    assert sg[7, :4].tolist() == [22, 1, expected_seed, 0]  # SGLang: seeded from row 0's write
    assert impls["sglang"].ring_state()[0] == 0
    X.compare_state("aliased seed", impls)


def test_pool_kinds_match_sglang_tags() -> None:
    """Our launch tags 0..11 are SGLang's CanaryLaunchTag, name for name."""
    from sglang.kernels.ops.kv_canary.verify import CanaryLaunchTag as SgTag

    for tag in SgTag:
        assert CanaryLaunchTag(int(tag)).name == tag.name
    assert X.Group(PoolKind.SWA, 1, 2, None, {}).tag(LaunchStage.TAIL, KvHalf.V) == int(
        SgTag.TAIL_V_SWA
    )
