"""The canary on the real engine: clean workloads over every memory feature log nothing and
change no output token; injected faults are reported with the expected tag and reason; the
modes do what they promise (log goes on, raise raises, abort aborts only the culprit)."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch
from engine_utils import make_prompts, slot_of, start_decoding, tiny_engine

from kvcanary import Engine, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.errors import KVCanaryViolation
from kvcanary.canary.wire.violation import parse_violation_line

MODELS = ["builtin:tiny-mha", "builtin:tiny-swa"]
CANARY_ON = dict(canary=CanaryConfig(mode="raise", real_data="partial", v_half=True,
                                     verify_tokens=True))

# ------------------------------------------------------------------ baseline: zero false positives

# Wave 1 finishes right after the shared prefix, so even the window-aware (SWA) prefix cache
# still holds a matchable prefix for wave 2 (longer prompts and outputs: the window slides).
_rng = random.Random(3)
_SHARED = [_rng.randrange(256) for _ in range(48)]
WAVES = [
    ([_SHARED + [_rng.randrange(256) for _ in range(4)] for _ in range(2)], 2),
    ([_SHARED + [_rng.randrange(256) for _ in range(_rng.randint(20, 60))] for _ in range(4)], 40),
]
FEATURES: dict[str, dict[str, Any]] = {
    # prefix sharing, chunked prefill, window eviction, graph padding
    "shared-chunked-graph": dict(chunked_prefill_size=16, graph_batch_sizes=(1, 2, 8)),
    # retraction and resume under memory pressure: KV recomputed / reloaded from host
    "retract-recompute": dict(max_total_tokens=224, swa_full_tokens_ratio=1.0,
                              chunked_prefill_size=64),
    "retract-offload": dict(max_total_tokens=224, swa_full_tokens_ratio=1.0,
                            chunked_prefill_size=64, enable_host_offload=True),
}  # fmt: skip


def _run(model: str, **config: Any) -> tuple[list[list[int]], Engine]:
    engine = tiny_engine(model=model, **config)
    outs = []
    for prompts, max_new_tokens in WAVES:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        outs += [o.output_ids for o in engine.generate(prompts, params)]
    return outs, engine


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("model", MODELS)
def test_clean_workload_logs_nothing_and_changes_no_token(model: str, feature: str) -> None:
    ref, _ = _run(model, **FEATURES[feature])
    outs, engine = _run(model, **FEATURES[feature], **CANARY_ON)  # raise mode
    assert outs == ref
    canary, stats = engine.canary, engine.scheduler.stats
    assert canary.violations == [] and canary.stats()["violations"] == 0
    assert canary.stats()["verify_overflow_steps"] == 0  # every step fully verified
    tags = canary.stats()["verify_entries_by_tag"]
    assert tags["HEAD_K_FULL"] > 0 and tags["TAIL_V_FULL"] > 0
    assert stats.num_cached_prompt_tokens > 0  # prefix sharing
    if engine.runner.is_swa:
        assert tags["TAIL_V_SWA"] > 0
        assert stats.num_swa_slots_evicted > 0  # the window slid
    if feature == "shared-chunked-graph":
        assert stats.num_extend_forwards > sum(len(p) for p, _ in WAVES)  # chunked prefill
        assert stats.padded_rows > 0  # graph padding rows ran through the canary
    else:
        assert stats.num_retractions > 0
    engine.check_integrity()


# ------------------------------------------------------------------ detection


def _flip_k_byte(engine: Engine, group: str, full_slot: int) -> None:
    """XOR byte 0 of layer-0 K of ``full_slot`` (SWA group: its SWA slot), like SGLang's
    ``real_kv_used`` perturbation."""
    pool = engine.runner.token_to_kv_pool
    if group == "SWA":
        buf, slot = pool.swa_kv_pool.k_buffer[0], int(pool.full_to_swa_index_mapping[full_slot])
    else:
        buf, slot = getattr(pool, "full_kv_pool", pool).k_buffer[0], full_slot
    buf[slot].view(-1).view(torch.uint8)[0] ^= 0xFF


DISTINCT = make_prompts(3, 44, 60, seed=5)  # no shared prefix: every slot has one owner


# Eager decode, and the graph runner's (its batch reaches the canary as the runner's own
# numpy views of its static buffers: ForwardBatch.host_arrays).
GRAPHS = pytest.mark.parametrize("graphs", [(), (1, 4)], ids=["eager", "graph-runner"])


@GRAPHS
@pytest.mark.parametrize("model", MODELS)
def test_req_to_token_remap_is_a_head_chain_violation(model: str, graphs: tuple[int, ...]) -> None:
    engine = tiny_engine(model=model, canary=CanaryConfig(mode="log"), graph_batch_sizes=graphs)
    start_decoding(engine, DISTINCT)
    r2t = engine.runner.req_to_token_pool.req_to_token
    a, b = engine.running_requests()[:2]
    p = 5  # outside the 32-token window: only the FULL group reads it
    original, stolen = int(r2t[a.req_pool_idx, p]), int(r2t[b.req_pool_idx, p])
    r2t[a.req_pool_idx, p] = stolen  # another live slot, same position
    engine.step()
    r2t[a.req_pool_idx, p] = original
    rows = engine.canary.violations
    assert rows and all(r.step == engine.canary.step for r in rows)  # the very next step
    assert {r.fail_reasons for r in rows} == {("verify_chain_hash",)}
    assert {r.launch_tag for r in rows} == {"HEAD_K_FULL", "TAIL_K_FULL"}
    # The stolen slot's chain does not follow a's prefix, and a's next slot does not follow it.
    assert {r.slot_idx for r in rows} == {stolen, slot_of(engine, 0, p + 1)}
    _check_graphs(engine, graphs)


def _check_graphs(engine: Engine, graphs: tuple[int, ...]) -> None:
    """The decode steps went the way the test case says (graph runner or eager)."""
    runner = engine.scheduler.graph_runner
    assert (runner.num_replays > 0) if graphs else runner is None


@pytest.mark.parametrize(("model", "group"), [("builtin:tiny-mha", "FULL"),
                                              ("builtin:tiny-swa", "FULL"),
                                              ("builtin:tiny-swa", "SWA")])  # fmt: skip
def test_k_byte_flip_is_a_tail_real_kv_violation_and_log_mode_goes_on(
    model: str, group: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = tiny_engine(model=model, canary=CanaryConfig(mode="log", real_data="partial"))
    rids = start_decoding(engine, DISTINCT)
    a = engine.running_requests()[0]
    full_slot = slot_of(engine, 0, a.kv_len - 3)  # in the window, used by every decode step
    _flip_k_byte(engine, group, full_slot)
    with caplog.at_level(logging.WARNING, "kvcanary.canary"):
        done = []
        while engine.has_unfinished():
            done += engine.step()
    assert sorted(o.rid for o in done) == sorted(rids)  # log mode served everyone
    assert all(o.finish_reason == "length" for o in done)
    rows = engine.canary.violations
    assert rows and {(r.launch_tag, r.fail_reasons) for r in rows} == {
        (f"TAIL_K_{group}", ("verify_real_kv_hash",))
    }
    slot = full_slot if group == "FULL" else None
    assert slot is None or {r.slot_idx for r in rows} == {slot}
    logged = [parse_violation_line(r.getMessage()) for r in caplog.records]
    assert len([x for x in logged if x is not None]) == len(rows)


def test_swa_mapping_corruption_is_reported_on_an_swa_tag() -> None:
    engine = tiny_engine(model="builtin:tiny-swa", canary=CanaryConfig(mode="log"),
                         graph_batch_sizes=())
    start_decoding(engine, DISTINCT)
    a, b = engine.running_requests()[:2]
    mapping = engine.runner.allocator.full_to_swa_index_mapping
    f_a, f_b = slot_of(engine, 0, a.kv_len - 5), slot_of(engine, 1, b.kv_len - 9)  # in window
    original = int(mapping[f_a])
    mapping[f_a] = mapping[f_b]  # a's in-window token now reads b's SWA slot
    engine.step()
    mapping[f_a] = original
    rows = engine.canary.violations
    assert rows and all(r.launch_tag.endswith("_SWA") for r in rows)
    assert "HEAD_K_SWA" in {r.launch_tag for r in rows}
    assert any("verify_position" in r.fail_reasons for r in rows)  # b's record, other position


def test_abort_mode_aborts_only_the_affected_request() -> None:
    config = dict(model="builtin:tiny-swa", canary=CanaryConfig(mode="abort", real_data="partial"))

    def run(corrupt: bool) -> dict[int, Any]:
        engine = tiny_engine(**config)
        start_decoding(engine, DISTINCT)
        outs = {}
        if corrupt:
            _flip_k_byte(engine, "FULL", slot_of(engine, 1, 3))
        while engine.has_unfinished():
            outs.update({o.rid: o for o in engine.step()})
        outs["aborted"] = engine.canary.aborted_request_ids
        return outs

    clean, hit = run(False), run(True)
    victim = 2  # the second running request
    assert clean["aborted"] == [] and hit["aborted"] == [victim]
    assert hit[victim].finish_reason == "abort"
    for rid in (1, 3):
        assert hit[rid].finish_reason == "length"
        assert hit[rid].output_ids == clean[rid].output_ids


def test_raise_mode_raises_after_logging_every_row(caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine(model="builtin:tiny-mha", **CANARY_ON)
    start_decoding(engine, DISTINCT)
    for i in range(2):
        _flip_k_byte(engine, "FULL", slot_of(engine, i, 7))
    with caplog.at_level(logging.WARNING, "kvcanary.canary"), pytest.raises(KVCanaryViolation) as e:
        engine.step()
    assert isinstance(e.value, RuntimeError)
    lines = [r.getMessage() for r in caplog.records if "kv_canary violation:" in r.getMessage()]
    assert len(lines) == 2 and str(e.value) == "\n".join(lines)


@GRAPHS
def test_verify_tokens_catches_a_wrong_token(graphs: tuple[int, ...]) -> None:
    engine = tiny_engine(model="builtin:tiny-mha", canary=CanaryConfig(mode="log", verify_tokens=True),
                         graph_batch_sizes=graphs)  # fmt: skip
    start_decoding(engine, DISTINCT)
    engine.step()
    assert engine.canary.violations == []
    row = engine.running_requests()[0].req_pool_idx
    engine.runner.req_to_token_pool.token_ids[row, 4] += 1  # the expectation, not the cache
    engine.step()
    rows = engine.canary.violations
    # Position 4 holds another token than the reader's; every slot after it holds KV made
    # after that token, not the reader's (the reader chain: verify_chain_hash).
    assert {(r.position, r.fail_reasons) for r in rows if r.position <= 4} == {
        (4, ("verify_token",))}
    after = {r.position for r in rows if r.position > 4}
    assert after and {r.fail_reasons for r in rows if r.position > 4} == {("verify_chain_hash",)}
    assert after == set(range(5, max(after) + 1))
    _check_graphs(engine, graphs)


@GRAPHS
def test_verify_tokens_checks_the_token_the_forward_before_wrote(graphs: tuple[int, ...]) -> None:
    """The rows' token counts grow every step: each forward checks its rows' tokens up to
    their counts now, so the token of the position the forward before wrote is checked too,
    eager and through the graph runner's persistent batch arrays (whose HostInputs a cache
    would keep: it must gather the counts again each forward)."""
    engine = tiny_engine(model="builtin:tiny-mha", canary=CanaryConfig(mode="log", verify_tokens=True),
                         graph_batch_sizes=graphs)  # fmt: skip
    start_decoding(engine, DISTINCT)
    for _ in range(4):
        engine.step()
    assert engine.canary.violations == []
    request = engine.running_requests()[0]
    position = request.kv_len - 1  # written by the forward before
    engine.runner.req_to_token_pool.token_ids[request.req_pool_idx, position] += 1
    engine.step()
    rows = engine.canary.violations
    assert rows and {r.fail_reasons for r in rows} == {("verify_token",)}
    assert {r.position for r in rows} == {position}
    _check_graphs(engine, graphs)


@GRAPHS
def test_write_input_assertion_armed_mid_run_checks_the_next_forward(graphs: tuple[int, ...]) -> None:
    """``set_expected_inputs`` after forwards already ran (the graph runner's batches were
    seen through its persistent views by then): the next forward checks its inputs."""
    engine = tiny_engine(model="builtin:tiny-mha", canary=CanaryConfig(mode="log"),
                         graph_batch_sizes=graphs)  # fmt: skip
    start_decoding(engine, DISTINCT)
    engine.step()
    assert engine.canary.violations == []

    def expected(fb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids = fb.input_ids.clone()
        ids[0] += 1  # the first row's token is not what it should be
        return ids, fb.positions.clone()

    engine.canary.set_expected_inputs(expected)
    engine.step()
    rows = engine.canary.violations
    assert rows and {r.fail_reasons for r in rows} == {("write_token",)}
    _check_graphs(engine, graphs)
