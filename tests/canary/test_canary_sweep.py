"""Radix sweep: the DFS emits each cached slot with its position and predecessor; a sweep
catches corruption of a cached prefix no running request reads (which per-forward
verification cannot see); clean sweeps over tombstones, retraction and sharing are silent."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from engine_utils import make_prompts, tiny_engine

from kvcanary import Engine, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.observe.sweep import walk_radix_cache
from kvcanary.canary.perturb.faults import flip_byte, group_slot
from kvcanary.canary.perturb.slots import unlocked_cached_slots
from kvcanary.canary.wire.constants import CANARY_FIELD_TOKEN, KvHalf, LaunchStage, PoolKind
from kvcanary.canary.wire.records import as_int64_records
from kvcanary.memory.allocator import make_allocator
from kvcanary.memory.radix_cache import RadixCache


def test_walk_emits_positions_and_predecessors_across_nodes() -> None:
    alloc = make_allocator(64, 1)
    cache = RadixCache(alloc, 1)
    a, b = alloc.alloc(4), alloc.alloc(4)
    cache.insert([1, 2, 3, 4], a)
    cache.insert([1, 2, 7, 8], b)  # shares [1, 2]: b[:2] are duplicates the tree frees
    slots, prevs, positions = walk_radix_cache(cache)
    a, b = a.tolist(), b.tolist()
    got = set(zip(slots.tolist(), prevs.tolist(), positions.tolist(), strict=True))
    assert got == {(a[0], -1, 0), (a[1], a[0], 1), (a[2], a[1], 2), (a[3], a[2], 3),
                   (b[2], a[1], 2), (b[3], b[2], 3)}  # fmt: skip
    empty = walk_radix_cache(RadixCache(make_allocator(64, 1), 1))
    assert all(t.numel() == 0 for t in empty)


_rng = random.Random(11)
_SHARED = [_rng.randrange(256) for _ in range(24)]
CACHED_WAVE = [_SHARED + [_rng.randrange(256) for _ in range(6)] for _ in range(2)]
OTHER_WAVE = make_prompts(3, 20, 30, seed=12)  # shares nothing with the cached wave


def _cache_then_run(model: str, corrupt, sweep_interval: int = 0) -> Engine:
    """Wave 1 fills the prefix cache and finishes; ``corrupt(engine)`` damages a cached slot;
    wave 2 (unrelated prompts) runs 12 decode steps."""
    canary = CanaryConfig(mode="log", real_data="partial", sweep_interval=sweep_interval)
    engine = tiny_engine(model=model, canary=canary, graph_batch_sizes=())
    engine.generate(CACHED_WAVE, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert engine.canary.violations == []
    corrupt(engine)
    engine.generate(OTHER_WAVE, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return engine


def _cached_slot(engine: Engine, group_kind: PoolKind) -> tuple[int, int]:
    """(full slot, group slot) of a cached slot no running request holds."""
    group = next(g for g in engine.canary.groups if g.kind == group_kind)
    full = unlocked_cached_slots(engine.kv.prefix_cache, group.swa_index_lut)[5]
    return full, group_slot(group, full)


@pytest.mark.parametrize(("model", "kind"), [("builtin:tiny-mha", PoolKind.FULL),
                                             ("builtin:tiny-swa", PoolKind.FULL),
                                             ("builtin:tiny-swa", PoolKind.SWA)])  # fmt: skip
def test_sweep_catches_a_byte_flip_in_cached_but_unused_kv(model: str, kind: PoolKind) -> None:
    flipped: list[int] = []

    def corrupt(engine: Engine) -> None:
        group = next(g for g in engine.canary.groups if g.kind == kind)
        _, slot = _cached_slot(engine, kind)
        flip_byte(group, slot, random.Random(0), "test")
        flipped.append(slot)

    # Without a sweep nothing reads the cached prefix: the flip goes unnoticed.
    assert _cache_then_run(model, corrupt).canary.violations == []
    engine = _cache_then_run(model, corrupt, sweep_interval=3)
    rows = engine.canary.violations
    assert rows and {(r.launch_tag, r.fail_reasons, r.slot_idx) for r in rows} == {
        (f"SWEEP_K_{kind.name}", ("verify_real_kv_hash",), flipped[-1])
    }
    assert engine.canary.stats()["sweep_passes"] >= 4


def test_sweep_catches_a_corrupted_record_of_a_cached_prefix() -> None:
    """No real-KV fingerprint needed: a cached slot whose record changed breaks the chain of
    its successor."""

    def corrupt(engine: Engine) -> None:
        full, _ = _cached_slot(engine, PoolKind.FULL)
        tail = engine.canary.groups[0].records(LaunchStage.TAIL, KvHalf.K)
        as_int64_records(tail)[full, CANARY_FIELD_TOKEN] += 1

    engine = _cache_then_run("builtin:tiny-mha", corrupt, sweep_interval=2)
    rows = engine.canary.violations
    assert rows and {(r.launch_tag, r.fail_reasons) for r in rows} == {
        ("SWEEP_K_FULL", ("verify_chain_hash",))
    }


def test_clean_sweeps_over_tombstones_retraction_and_sharing_are_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SWA pool under pressure (prefix-cache tombstones, retraction), every step swept."""
    canary = CanaryConfig(mode="raise", real_data="partial", v_half=True, sweep_interval=1)
    engine = tiny_engine(model="builtin:tiny-swa", canary=canary,
                         max_total_tokens=256, swa_full_tokens_ratio=0.5, chunked_prefill_size=32)  # fmt: skip
    prompts = [_SHARED + p[:20] for p in make_prompts(5, 20, 40, seed=13)]
    with caplog.at_level(logging.INFO, "kvcanary.canary"):
        for wave in (prompts[:2], prompts[2:]):
            engine.generate(wave, SamplingParams(max_new_tokens=40, ignore_eos=True))
    stats = engine.canary.stats()
    assert stats["violations"] == 0
    assert stats["sweep_passes"] == stats["steps"]
    assert stats["verify_entries_by_tag"]["SWEEP_V_SWA"] > 0
    assert engine.scheduler.stats.num_retractions > 0
    assert engine.scheduler.stats.num_swa_slots_tombstoned > 0
    assert f"[canary] sweep succeeded {stats['steps']} times (last_step={stats['steps'] - 1})" in caplog.text


def test_sweep_without_a_prefix_cache_does_nothing() -> None:
    engine = tiny_engine(model="builtin:tiny-mha",
                         canary=CanaryConfig(mode="log", sweep_interval=1),
                         enable_prefix_cache=False)  # fmt: skip
    engine.generate(OTHER_WAVE, SamplingParams(max_new_tokens=4))
    stats = engine.canary.stats()
    assert stats["sweep_passes"] == 0 and "SWEEP_K_FULL" not in stats["kernel_runs_by_tag"]
    assert "SWEEP_K_FULL" in stats["launch_tags_active"]  # configured, just nothing to sweep
    sweep_runs = engine.canary.runtime.verify_counters.kernel_runs[4:6]  # SWEEP_{K,V}_FULL
    assert torch.equal(sweep_runs, torch.zeros(2, dtype=torch.int64))
