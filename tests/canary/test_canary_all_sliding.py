"""The canary on models whose layers all slide (Mistral-style: ``sliding_window`` set
globally, or ``layer_types`` all ``sliding_attention``).

The engine serves them with an SWA pool whose full sub-pool holds no layer (the full slots
are only the logical index space every req->token row points into). The canary keeps a
records-only FULL group over that index space (the chain over each request's whole
history) and an SWA group that fingerprints the sliding layers' bytes in the window.

Covered on the real engine, on ``builtin:tiny-swa-all`` and on a tiny HF Mistral checkpoint:
clean workloads (windows slide, SWA slots are evicted, page sizes 1 and 4) log nothing and
change no token; faults written straight into engine state (a req->token entry remapped, a
sliding layer's KV byte flipped, a canary record tampered) are reported; host offload and
the prefill->decode transfer carry the records (each with a control run that drops them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from engine_utils import make_prompts, slot_of, start_decoding, tiny_engine
from hf_fixtures import make_tiny_hf_checkpoint

from kvcanary import Engine, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.wire.constants import CANARY_FIELD_POSITION, PoolKind
from kvcanary.canary.wire.records import as_int64_records
from kvcanary.config import EngineConfig
from kvcanary.disagg.cluster import InProcessDisagg
from kvcanary.disagg.config import DisaggConfig, DisaggFaults
from kvcanary.memory import host_pool
from kvcanary.memory.swa_pool import SWAKVPool

PRESET = "builtin:tiny-swa-all"  # 4 layers, all sliding, window 32
CANARY_ON = dict(canary=CanaryConfig(mode="raise", real_data="partial", v_half=True,
                                     verify_tokens=True))  # fmt: skip


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny HF Mistral checkpoint: ``sliding_window`` = 6 on every layer."""
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral"))


def _model(name: str, request: pytest.FixtureRequest) -> str:
    return PRESET if name == "preset" else str(request.getfixturevalue("mistral"))


def _engine(model: str, **config: Any) -> Engine:
    return tiny_engine(model=model, **config)


def _groups(engine: Engine) -> dict[PoolKind, Any]:
    return {g.kind: g for g in engine.canary.groups}


DISTINCT = make_prompts(3, 44, 60, seed=5)  # longer than the window; no shared prefix


# ------------------------------------------------------------------ attach


@pytest.mark.parametrize("page_size", [1, 4])
def test_all_sliding_pool_gets_a_records_only_full_group(page_size: int) -> None:
    engine = _engine(PRESET, page_size=page_size,
                     canary=CanaryConfig(mode="log", real_data="partial"))
    pool = engine.runner.token_to_kv_pool
    assert isinstance(pool, SWAKVPool) and engine.runner.sliding_window == 32
    full, swa = pool.full_kv_pool, pool.swa_kv_pool
    assert full.k_buffer == [] and full.v_buffer == [] and len(swa.k_buffer) == 4
    groups = _groups(engine)
    assert [g.kind for g in engine.canary.groups] == [PoolKind.FULL, PoolKind.SWA]
    fg, sg = groups[PoolKind.FULL], groups[PoolKind.SWA]
    # FULL: one record per full slot, no real-KV source (no full-layer bytes exist).
    assert fg.num_slots == full.num_slots and fg.swa_index_lut is None and fg.window is None
    assert fg.real_kv_sources_k == fg.real_kv_sources_v == ()
    # SWA: window 32, the live mapping, and `partial` fingerprints sliding layer 0.
    assert sg.window == 32 and sg.swa_index_lut is pool.full_to_swa_index_mapping
    (src_k,), (src_v,) = sg.real_kv_sources_k, sg.real_kv_sources_v
    assert src_k.tensor.data_ptr() == swa.k_buffer[0].data_ptr()
    assert src_v.tensor.data_ptr() == swa.v_buffer[0].data_ptr()
    # The layerless full sub-pool's KV channel is empty; after attaching it is the records.
    assert full.get_contiguous_buf_infos() == ([], [], [])
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in (fg.k_head, fg.k_tail, fg.v_head, fg.v_tail)]
    assert lens == [full.num_slots * 32] * 4 and items == [32 * page_size] * 4
    state_ptrs, _, state_items = pool.get_state_buf_infos()
    assert state_ptrs == [sg.k_head.data_ptr(), *(b.data_ptr() for b in swa.k_buffer),
                          sg.k_tail.data_ptr(), sg.v_head.data_ptr(),
                          *(b.data_ptr() for b in swa.v_buffer), sg.v_tail.data_ptr()]  # fmt: skip
    assert state_items[0] == 32 * page_size
    assert state_items[1] == swa.k_buffer[0][0].nbytes * page_size
    # Host copies: the records are the full sub-pool's sidecars.
    assert full.extra_slot_buffers == fg.buffers() and swa.extra_slot_buffers == sg.buffers()


def test_real_data_layers_all_fingerprints_every_sliding_layer() -> None:
    engine = _engine(PRESET, canary=CanaryConfig(mode="log", real_data="all",
                                                 real_data_layers="all"))  # fmt: skip
    swa = engine.runner.token_to_kv_pool.swa_kv_pool
    sg = _groups(engine)[PoolKind.SWA]
    fingerprinted = [s.tensor.data_ptr() for s in sg.real_kv_sources_k]
    assert fingerprinted == [b.data_ptr() for b in swa.k_buffer]
    assert _groups(engine)[PoolKind.FULL].real_kv_sources_k == ()


# ------------------------------------------------------------------ clean workloads


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("model_name", ["preset", "mistral"])
def test_clean_workload_logs_nothing_and_changes_no_token(
    model_name: str, page_size: int, request: pytest.FixtureRequest
) -> None:
    model = _model(model_name, request)
    # Shared 24-token prefix (prefix cache + tombstones), prompts and outputs longer than
    # the window (32 / 6): the window slides and SWA slots are evicted.
    prompts = make_prompts(4, 36, 70, shared=24, seed=7)  # byte ids: in both vocabs
    params = SamplingParams(max_new_tokens=44, ignore_eos=True)
    config = dict(page_size=page_size, chunked_prefill_size=32, max_total_tokens=2048)

    def run(**canary: Any) -> tuple[list[list[int]], Engine]:
        engine = _engine(model, **config, **canary)
        outs = [o.output_ids for o in engine.generate(prompts[:2], params)]
        outs += [o.output_ids for o in engine.generate(prompts[2:], params)]  # cache hits
        return outs, engine

    ref, _ = run()
    outs, engine = run(**CANARY_ON)  # raise mode: any violation would raise
    assert outs == ref
    stats, canary = engine.scheduler.stats, engine.canary.stats()
    assert engine.canary.violations == [] and canary["violations"] == 0
    assert canary["verify_overflow_steps"] == 0
    tags = canary["verify_entries_by_tag"]
    # The FULL chain covers each whole history, the SWA group only the windows.
    assert tags["HEAD_K_SWA"] > 0 and tags["TAIL_V_SWA"] > 0
    assert tags["HEAD_K_FULL"] > tags["HEAD_K_SWA"] and tags["TAIL_V_FULL"] == tags["HEAD_K_FULL"]
    assert stats.num_swa_slots_evicted > 0  # the windows slid
    assert stats.num_cached_prompt_tokens > 0
    engine.check_integrity()


# ------------------------------------------------------------------ faults in engine state


@pytest.mark.parametrize("model_name", ["preset", "mistral"])
def test_req_to_token_remap_outside_the_window_is_a_full_chain_violation(
    model_name: str, request: pytest.FixtureRequest
) -> None:
    model = _model(model_name, request)
    engine = _engine(model, canary=CanaryConfig(mode="log"), graph_batch_sizes=())
    start_decoding(engine, DISTINCT)
    r2t = engine.runner.req_to_token_pool.req_to_token
    a, b = engine.running_requests()[:2]
    p = 3  # far outside the window (32 / 6): no attention layer reads it, only the chain
    original, stolen = int(r2t[a.req_pool_idx, p]), int(r2t[b.req_pool_idx, p])
    r2t[a.req_pool_idx, p] = stolen  # another live slot, same position
    engine.step()
    r2t[a.req_pool_idx, p] = original
    rows = engine.canary.violations
    assert rows and all(r.step == engine.canary.step for r in rows)  # the very next step
    assert {r.fail_reasons for r in rows} == {("verify_chain_hash",)}
    assert {r.launch_tag for r in rows} == {"HEAD_K_FULL", "TAIL_K_FULL"}
    assert {r.slot_idx for r in rows} == {stolen, slot_of(engine, 0, p + 1)}
    engine.step()  # restored: nothing more
    assert len(engine.canary.violations) == len(rows)


@pytest.mark.parametrize(("layers", "layer"), [("first", 0), ("all", 3)])
def test_sliding_layer_byte_flip_in_the_window_is_a_tail_swa_violation(
    layers: str, layer: int
) -> None:
    canary = CanaryConfig(mode="log", real_data="partial", real_data_layers=layers)
    engine = _engine(PRESET, canary=canary)
    rids = start_decoding(engine, DISTINCT)
    pool = engine.runner.token_to_kv_pool
    a = engine.running_requests()[0]
    full_slot = slot_of(engine, 0, a.kv_len - 3)  # in the window, read by every decode step
    swa_slot = int(pool.full_to_swa_index_mapping[full_slot])
    assert swa_slot > 0
    pool.swa_kv_pool.k_buffer[layer][swa_slot].view(-1).view(torch.uint8)[0] ^= 0xFF
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert sorted(o.rid for o in done) == sorted(rids)  # log mode served everyone
    rows = engine.canary.violations
    assert rows and {(r.launch_tag, r.fail_reasons) for r in rows} == {
        ("TAIL_K_SWA", ("verify_real_kv_hash",))
    }
    assert {r.slot_idx for r in rows} == {swa_slot}  # SWA tags report SWA slots


@pytest.mark.parametrize(("kind_name", "record", "offset"), [
    ("FULL", "k_head", 3),  # outside the window: only the FULL chain covers it
    ("SWA", "k_tail", -3),  # in the window (offset from kv_len)
])  # fmt: skip
def test_tampered_record_is_reported(kind_name: str, record: str, offset: int) -> None:
    kind = PoolKind[kind_name]
    engine = _engine(PRESET, canary=CanaryConfig(mode="log"), graph_batch_sizes=())
    start_decoding(engine, DISTINCT)
    a = engine.running_requests()[0]
    full_slot = slot_of(engine, 0, offset if offset >= 0 else a.kv_len + offset)
    slot = full_slot
    if kind == PoolKind.SWA:
        slot = int(engine.runner.token_to_kv_pool.full_to_swa_index_mapping[full_slot])
    group = _groups(engine)[kind]
    as_int64_records(getattr(group, record))[slot, CANARY_FIELD_POSITION] += 1
    engine.step()
    rows = engine.canary.violations
    stage = "HEAD" if record == "k_head" else "TAIL"
    assert rows and {r.launch_tag for r in rows} == {f"{stage}_K_{kind.name}"}
    assert any(r.slot_idx == slot and "verify_position" in r.fail_reasons for r in rows)


# ------------------------------------------------------------------ records travel


@pytest.mark.parametrize("page_size", [1, 4])
def test_host_offload_round_trip_keeps_the_records(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = dict(page_size=page_size, max_total_tokens=224, swa_full_tokens_ratio=1.0,
                  chunked_prefill_size=64, enable_host_offload=True, graph_batch_sizes=())  # fmt: skip
    prompts = make_prompts(4, 40, 80, seed=2)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    loads: list[dict[str, Any]] = []
    load = host_pool.load_cpu_copy

    def counting_load(pool: Any, copy: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        loads.append(copy)
        load(pool, copy, *args, **kwargs)

    monkeypatch.setattr(host_pool, "load_cpu_copy", counting_load)
    ref = [o.output_ids for o in _engine(PRESET, **config).generate(prompts, params)]
    loads.clear()
    engine = _engine(PRESET, **config, **CANARY_ON)
    assert [o.output_ids for o in engine.generate(prompts, params)] == ref
    assert engine.scheduler.stats.num_retractions > 0 and loads  # reloaded from host
    # The layerless full sub-pool's copy is exactly the FULL group's four record buffers.
    assert all([tuple(t.shape[1:]) for t in c["full"]] == [(32,)] * 4 for c in loads)
    assert engine.canary.stats()["violations"] == 0
    # Control: the same run with the FULL records left out of the host copies.
    loads.clear()
    engine = _engine(PRESET, **config, canary=dataclasses.replace(CANARY_ON["canary"], mode="log"))
    engine.runner.token_to_kv_pool.full_kv_pool.extra_slot_buffers.clear()
    engine.generate(prompts, params)
    assert loads and {r.launch_tag.rsplit("_", 1)[1] for r in engine.canary.violations} == {"FULL"}


def _disagg(config: EngineConfig, prompts: list[list[int]], faults: DisaggFaults | None = None
            ) -> tuple[list[list[int]], dict[str, Any]]:  # fmt: skip
    pair = InProcessDisagg(config, config, DisaggConfig(transfer_backend="inproc"), faults)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = pair.generate(prompts, params, timeout_s=60)
    return [o.output_ids for o in outs], pair.shutdown()


def test_prefill_to_decode_transfer_carries_the_full_records() -> None:
    config = EngineConfig(model=PRESET, page_size=4, max_total_tokens=2048, max_context_len=1024,
                          canary=CanaryConfig(mode="raise", real_data="partial"))  # fmt: skip
    prompts = make_prompts(3, 40, 90, seed=1)
    outs, reports = _disagg(config, prompts)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert outs == [o.output_ids for o in Engine(config).generate(prompts, params)]
    decode = reports["decode"]
    assert decode["transfers"] == 3 and decode["stats"]["num_extend_forwards"] == 0
    assert decode["canary"]["stats"]["violations"] == 0  # the records arrived with the KV
    # A transfer landing one page off: the FULL records (the whole KV channel) are off too.
    log = dataclasses.replace(config, canary=dataclasses.replace(config.canary, mode="log"))
    _, reports = _disagg(log, prompts[:1], DisaggFaults(page_offset=1))
    first = {r["launch_tag"] for r in reports["decode"]["canary"]["violations"] if r["step"] == 1}
    assert {"HEAD_K_FULL", "HEAD_K_SWA"} <= first
