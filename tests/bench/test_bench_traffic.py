"""The bytes model of `bench overhead` (kvcanary/bench/traffic.py): a hand-computed forward,
and the canary's own entry counters over a real run."""

from __future__ import annotations

import pytest

from kvcanary.bench.engines import record_forward_shapes
from kvcanary.bench.traffic import StepShape, canary_bytes, canary_groups, kv_read_bytes
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.wire.constants import CANARY_SLOT_BYTES
from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.engine import Engine
from kvcanary.model.presets import PRESETS
from kvcanary.workload import WorkloadSpec, make_prompts

TINY_SWA = PRESETS["tiny-swa"]  # S S F S S F, window 32, 2 kv heads x 32 dims
FP32 = 4
# Three rows: a decode past the window, a fresh 16-token prefill, a decode inside it.
STEP = StepShape(prefix_lens=(40, 0, 10), extend_lens=(1, 16, 1))


def test_kv_read_bytes_by_hand() -> None:
    # One position of one layer: K + V = 2 x 2 heads x 32 dims x 4 B = 512 B.
    # Full layers read p + e: 41 + 16 + 11 = 68 positions.
    # Sliding layers read from max(0, p - W + 1): 41 - 9, 16, 11 = 59 positions.
    assert kv_read_bytes(STEP, TINY_SWA, FP32) == 2 * 512 * 68 + 4 * 512 * 59
    assert kv_read_bytes(STEP, PRESETS["tiny-mha"], FP32) == 4 * 512 * 68
    assert kv_read_bytes(STEP, TINY_SWA, 2) == (2 * 512 * 68 + 4 * 512 * 59) // 2


# FULL group: verifies p (50 entries), writes e (18). SWA group: verifies min(p, 32) (42).
# HEAD and TAIL each verify and write 32 B records; TAIL fingerprints F per slot; the store
# check reads F and 32 B of scratch per source per written token.
@pytest.mark.parametrize(("options", "expected"), [
    ({"mode": "none"}, 0),
    ({"mode": "log"}, 32 * 2 * 68 + 32 * 2 * 60),
    ({"mode": "log", "real_data": "partial"},
     32 * 2 * 68 + 16 * 68 + (16 + 32) * 18 + 32 * 2 * 60 + 16 * 60 + (16 + 32) * 18),
    ({"mode": "log", "real_data": "all"},  # F = a layer's K row: 256 B
     32 * 2 * 68 + 256 * 68 + (256 + 32) * 18 + 32 * 2 * 60 + 256 * 60 + (256 + 32) * 18),
    ({"mode": "log", "real_data": "partial", "v_half": True},
     2 * (32 * 2 * 68 + 16 * 68 + (16 + 32) * 18 + 32 * 2 * 60 + 16 * 60 + (16 + 32) * 18)),
    ({"mode": "log", "real_data": "partial", "real_data_layers": "all"},  # FULL 2, SWA 4 layers
     32 * 2 * 68 + 32 * 68 + (32 + 64) * 18 + 32 * 2 * 60 + 64 * 60 + (64 + 128) * 18),
])  # fmt: skip
def test_canary_bytes_by_hand(options: dict[str, object], expected: int) -> None:
    groups = canary_groups(TINY_SWA, CanaryConfig(**options), FP32)
    assert canary_bytes(STEP, groups) == expected


def test_mha_has_one_group_and_all_sliding_a_records_only_full_group() -> None:
    partial = CanaryConfig(mode="log", real_data="partial")
    [full] = canary_groups(PRESETS["tiny-mha"], partial, FP32)
    assert (full.window, full.num_sources, full.fingerprint_bytes) == (None, 1, 16)
    full, swa = canary_groups(PRESETS["tiny-swa-all"], partial, FP32)
    assert (full.window, full.num_sources) == (None, 0)  # no layer: records only
    assert (swa.window, swa.num_sources) == (32, 1)


def test_more_than_four_fingerprinted_layers_is_refused_like_the_canary() -> None:
    config = CanaryConfig(mode="log", real_data="partial", real_data_layers="all")
    with pytest.raises(ValueError, match="the FULL group has 7 layers; allowed at most 4"):
        canary_groups(PRESETS["qwen3-0.6b-shape"], config, FP32)


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha", "builtin:tiny-swa-all"])
@pytest.mark.parametrize("real_data", ["none", "partial"])
def test_model_matches_the_canarys_own_counters(model: str, real_data: str) -> None:
    """Over a run with chunked prefill, a shared prefix (cache hits), window eviction and
    padded graph decodes, the entries the model counts are the entries the canary ran."""
    canary = CanaryConfig(mode="log", real_data=real_data)
    engine = Engine(EngineConfig(model=model, canary=canary, chunked_prefill_size=48,
                                 max_total_tokens=2048, swa_full_tokens_ratio=1.0))  # fmt: skip
    shapes = record_forward_shapes(engine)
    prompts = make_prompts(WorkloadSpec(3, 80, 12, 16, 0), 256)
    engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    groups = canary_groups(engine.runner.model_config, canary, FP32)
    stats = engine.canary.stats() if engine.canary else {}
    assert any(p > 0 for s in shapes for p in s.prefix_lens)  # prefixes were verified
    records = CANARY_SLOT_BYTES * stats["protected_tokens"]
    # Fingerprints: every TAIL entry of a half with sources; the store check per write.
    sourced = {f"TAIL_K_{kind}": g for kind, g in zip(("FULL", "SWA"), groups, strict=False)
               if g.num_sources}  # fmt: skip
    verified, written = stats["verify_entries_by_tag"], stats["write_entries_by_tag"]
    fingerprints = sum(g.fingerprint_bytes * (verified[tag] + written[tag])
                       + (g.fingerprint_bytes + 32 * g.num_sources) * written[tag]
                       for tag, g in sourced.items())  # fmt: skip
    assert sum(canary_bytes(s, groups) for s in shapes) == records + fingerprints
    assert bool(sourced) == (real_data != "none")


def test_replayed_cuda_graph_decodes_are_recorded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode replayed from a captured graph never calls ``runner.forward``; its shape is
    still recorded, once, without the padding rows (a stand-in graph re-runs the recorded
    work on the CPU). Without it, ``bench overhead`` on CUDA counted 0 tokens for every
    captured variant."""
    from engine_utils import stand_in_cuda_graphs

    stand_in_cuda_graphs(monkeypatch)
    engine = Engine(EngineConfig(model="builtin:tiny-swa", canary=CanaryConfig(mode="none"),
                                 graph_batch_sizes=(4,), max_total_tokens=2048))  # fmt: skip
    shapes = record_forward_shapes(engine)
    prompts = make_prompts(WorkloadSpec(3, 40, 6, 0, 0), 256)
    engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    stats = engine.scheduler.stats
    assert stats.graph_replays > 0 and len(engine.scheduler.graph_runner.graphs) > 0
    assert len(shapes) == stats.num_forwards
    decodes = [s for s in shapes if all(e == 1 for e in s.extend_lens)]
    assert sum(len(s.extend_lens) for s in decodes) == stats.num_decode_tokens  # no padding rows


@pytest.mark.parametrize("graph_parts", [False, True])
def test_canary_timers_count_each_call_the_engine_makes_once(
    graph_parts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--time-canary``'s timers: one interval per outermost canary call (before_forward,
    after_forward, each store observe, as tensors or as addresses from a fused decode layer;
    with ``graph_parts`` also begin / end_forward, which before / after_forward call inside:
    not counted twice). A fake clock that ticks once per read makes each timed call add
    exactly 1."""
    import types

    from kvcanary.bench import overhead

    ticks = iter(range(10**9))
    monkeypatch.setattr(overhead, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    config = EngineConfig(model="builtin:tiny-swa", page_size=4, max_total_tokens=4096,
                          canary=CanaryConfig(mode="log", real_data="partial"))  # fmt: skip
    engine = Engine(config)
    observes = [0]
    checker = engine.canary.runtime.store_checker
    assert checker is not None
    by_name = {"observe": 0, "observe_rows": 0}

    def counting(name: str):  # installed first: runs inside the timed observe
        call = getattr(checker, name)

        def counted(*args, **kwargs):
            observes[0] += 1
            by_name[name] += 1
            return call(*args, **kwargs)

        return counted

    for name in by_name:
        setattr(checker, name, counting(name))
    clock = overhead.time_canary_calls(engine, graph_parts=graph_parts)
    engine.generate([[5, 6, 7, 8, 9], [1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    forwards = engine.stats.num_forwards
    assert forwards > 0 and observes[0] >= 2 * forwards  # two watched stores a forward
    assert by_name["observe"] and by_name["observe_rows"]  # the prefill's, the decodes'
    assert clock[0] == 2 * forwards + observes[0]
