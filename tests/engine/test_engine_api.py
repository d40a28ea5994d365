"""The offline API: configuration errors, prompts, sampling, stop tokens, the token oracle,
and aborting requests whose KV is implicated."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_all_memory_free, greedy_outputs, make_prompts, tiny_engine

from kvcanary import EngineConfig, SamplingParams
from kvcanary.canary.wire.hashing import splitmix64
from kvcanary.utils import show


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("page_size", 0, ">= 1"),
        ("swa_full_tokens_ratio", 1.5, "(0, 1]"),
        ("canary", "loud", "a kvcanary.canary.config.CanaryConfig"),
        ("dtype", "int8", "one of"),
        ("graph_batch_sizes", (4, 2), "strictly increasing"),
        ("max_total_tokens", 3, ">= 2 * page_size"),
    ],
)
def test_invalid_engine_config_names_field_value_and_allowed(field, value, allowed) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig(**{field: value})
    msg = str(e.value)
    assert field in msg and show(value) in msg and allowed in msg


@pytest.mark.parametrize(("field", "value"), [("max_new_tokens", 0), ("top_p", 0.0), ("temperature", -1.0)])
def test_invalid_sampling_params(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_prompts_are_rejected_without_side_effects() -> None:
    engine = tiny_engine()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 99999])
    with pytest.raises(ValueError, match="max_context_len"):
        engine.add_request([1] * 1000, SamplingParams(max_new_tokens=100))
    assert not engine.has_unfinished()


def test_string_prompt_round_trips_through_the_byte_tokenizer() -> None:
    engine = tiny_engine()
    out = engine.generate("hello kv canary", SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert out.prompt_ids == list(b"hello kv canary")
    assert len(out.output_ids) == 5
    assert out.text == engine.tokenizer.decode(out.output_ids)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy() -> None:
    prompts = make_prompts(3, 20, 30, seed=2)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=5,
                            ignore_eos=True)
    a = [o.output_ids for o in tiny_engine().generate(prompts, params)]
    b = [o.output_ids for o in tiny_engine().generate(prompts, params)]
    greedy = greedy_outputs(tiny_engine(), prompts, 12)
    assert a == b
    assert a != greedy


def test_stop_token_ends_generation() -> None:
    engine = tiny_engine()
    prompt = make_prompts(1, 30, 30, seed=3)[0]
    full = greedy_outputs(engine, [prompt], 10)[0]
    stop = full[4]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=(stop,),
                                                   ignore_eos=True))[0]
    assert out.output_ids == full[: full.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_token_oracle_follows_the_formula_under_chunking_and_retraction() -> None:
    prompts = make_prompts(4, 30, 60, seed=4)
    engine = tiny_engine(token_oracle=True, chunked_prefill_size=16, max_total_tokens=256,
                         swa_full_tokens_ratio=0.5)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    vocab = engine.runner.vocab_size
    for o in outs:
        expect = [splitmix64(o.rid ^ (len(o.prompt_ids) + i)) % vocab for i in range(40)]
        assert o.output_ids == expect
    assert_all_memory_free(engine)


def test_abort_requests_referencing_a_slot_spares_the_others() -> None:
    prompts = make_prompts(4, 40, 60, seed=5)
    clean = greedy_outputs(tiny_engine(), prompts, 16)
    engine = tiny_engine()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):
        engine.step()
    sched = engine.scheduler
    victim = next(r for r in sched.running if r.rid == rids[1])
    slot = sched.kv.req_to_token[victim.req_pool_idx, 5].to(torch.int64).reshape(1)
    assert sched.abort_requests_referencing(slot) == [victim.rid]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.rid] = o
    assert done[rids[1]].finish_reason == "abort"
    for i in (0, 2, 3):
        assert done[rids[i]].output_ids == clean[i]
    alloc = engine.runner.allocator.full_attn_allocator
    page = int(slot) // engine.config.page_size
    assert bool(alloc.page_quarantined[page])
    assert page not in alloc.free_pages.tolist()
    engine.check_integrity()


def test_abort_drops_the_corrupt_prefix_from_the_cache() -> None:
    prompts = make_prompts(3, 48, 60, shared=32, seed=6)
    engine = tiny_engine()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    for _ in range(2):
        engine.step()
    sched = engine.scheduler
    assert sched.kv.prefix_cache is not None and sched.kv.prefix_cache.total_size() > 0
    shared_slot = sched.kv.req_to_token[sched.running[0].req_pool_idx, 3].to(torch.int64).reshape(1)
    aborted = sched.abort_requests_referencing(shared_slot)
    assert sorted(aborted) == sorted(rids)  # every request shares the corrupt prefix page
    # A newcomer with the same prefix must recompute it, not reuse the corrupt slots.
    assert sched.kv.prefix_cache.match_prefix(prompts[0]).num_tokens == 0
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


@pytest.mark.parametrize("leak", ["none", "full", "swa"])
def test_abort_reports_the_leaked_pages_it_reclaims(leak: str, caplog: pytest.LogCaptureFixture) -> None:
    """Pages taken from the real allocators behind the engine's back (a leak: no request,
    row, prefix-cache node or full slot refers to them) are reclaimed by abort mode's
    quarantine and counted and logged as a suspected leak; the aborted request's own pages
    are not counted, and nothing is counted without a leak."""
    engine = tiny_engine()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in make_prompts(3, 40, 60, seed=7)]
    for _ in range(3):
        engine.step()
    sched, page = engine.scheduler, engine.config.page_size
    swa_alloc = engine.runner.allocator
    lost = None
    if leak == "full":  # two pages of full slots, mapped to nothing, held by no one
        lost = swa_alloc.full_attn_allocator.alloc(2 * page)
    elif leak == "swa":  # an SWA page no full slot maps to
        lost = swa_alloc.swa_attn_allocator.alloc(page)
    victim = next(r for r in sched.running if r.rid == rids[1])
    slot = sched.kv.req_to_token[victim.req_pool_idx, 5].to(torch.int64).reshape(1)
    with caplog.at_level("WARNING", logger="kvcanary.engine"):
        assert sched.abort_requests_referencing(slot) == [victim.rid]
    st = engine.stats
    assert (st.num_leaked_full_slots, st.num_leaked_swa_slots) == {
        "none": (0, 0), "full": (2 * page, 0), "swa": (0, page)}[leak]
    warned = [r for r in caplog.records if "suspected KV leak" in r.getMessage()]
    assert len(warned) == (0 if leak == "none" else 1)
    if lost is not None:  # reclaimed: back in the free pool
        pages = (lost[::page] // page).tolist()
        alloc = swa_alloc.full_attn_allocator if leak == "full" else swa_alloc.swa_attn_allocator
        assert all(p in alloc.free_pages.tolist() for p in pages)
    while engine.has_unfinished():  # the others run on; the quarantined page stays out
        engine.step()
    engine.check_integrity()
