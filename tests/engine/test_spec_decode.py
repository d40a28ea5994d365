"""Speculative decoding (kvcanary.engine.speculative): greedy outputs identical to plain
greedy decoding through chunked prefill, prefix-cache hits, retraction, host offload, SWA
window eviction, stop tokens and aborts; the KV of rejected drafts rolled back (no leaked
slot, no rejected token in the prefix cache); the draft model's own pools; config errors."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_utils import assert_all_memory_free, tiny_engine
from hf_fixtures import FAMILIES, VOCAB_SIZE, make_tiny_hf_checkpoint

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.config import CanaryConfig, SpeculativeConfig
from kvcanary.engine.speculative import accept_greedy, ngram_propose

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)


def _draft(model: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", num_speculative_tokens=k, draft_model=model)


def _prompts(vocab: int = 256, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (ngram finds its suffix earlier), two sharing a 24-token prefix
    (a prefix-cache hit in the second wave), one random."""
    rng = random.Random(seed)
    pat = [rng.randrange(vocab) for _ in range(5)]
    shared = [rng.randrange(vocab) for _ in range(24)]
    return [
        pat * 7 + [rng.randrange(vocab) for _ in range(3)],
        shared + pat * 3,
        [rng.randrange(vocab) for _ in range(37)],
        shared + [rng.randrange(vocab) for _ in range(9)] + pat * 2,
    ]


def _run(engine: Engine, prompts: list[list[int]], new: int = 48, waves: int = 2,
         **params: Any) -> list[tuple[list[int], str]]:  # fmt: skip
    """Outputs (ids, finish reason) in prompt order, the prompts in ``waves`` generate()
    calls (later waves hit the prefix cache); integrity checked after each."""
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True, **params)
    size = -(-len(prompts) // waves)
    outs = []
    for i in range(0, len(prompts), size):
        outs += [
            (o.output_ids, o.finish_reason) for o in engine.generate(prompts[i : i + size], sp)
        ]
        engine.check_integrity()
    return outs


def _assert_all_free(engine: Engine) -> None:
    """Target and draft: every slot and row back on the free lists."""
    assert_all_memory_free(engine)
    proposer = engine.scheduler.proposer
    draft = getattr(proposer, "runner", None)
    if draft is not None:
        assert proposer.reqs == {}  # type: ignore[union-attr]
        alloc = draft.allocator
        if draft.is_swa:
            assert alloc.full_available_size() == alloc.size_full
            assert alloc.swa_available_size() == alloc.size_swa
        else:
            assert alloc.available_size() == alloc.size
        assert draft.req_to_token_pool.available_size() == draft.req_to_token_pool.size


def _acceptance(engine: Engine) -> float:
    st = engine.stats
    assert st.spec_num_proposed > 0
    return st.spec_num_accepted / st.spec_num_proposed


# ------------------------------------------------------------------ pure functions
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_propose(seq, 2, 1, 3) == [7, 8]  # latest earlier "1 2 3" is at 4
    assert ngram_propose(seq, 9, 1, 3) == [7, 8, 1, 2, 3]  # up to the end
    assert ngram_propose([5, 6, 7, 6], 3, 1, 3) == [7, 6]  # falls back to n = 1
    assert ngram_propose([5, 6, 7], 3, 1, 3) == []  # nothing earlier
    assert ngram_propose([4, 5, 4, 5], 3, 3, 3) == []  # n = 3 only: no earlier "5 4 5"
    assert ngram_propose([7], 3, 1, 3) == []


def test_ngram_propose_matches_a_brute_force_search() -> None:
    """Random sequences over small vocabularies (many repeats) against the definition."""

    def brute(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
        for n in range(min(hi, len(seq) - 1), lo - 1, -1):
            suffix = seq[len(seq) - n :]
            for start in range(len(seq) - n - 1, -1, -1):  # latest first, not the suffix
                if seq[start : start + n] == suffix:
                    return seq[start + n : start + n + k]
        return []

    rng = random.Random(7)
    for _ in range(400):
        seq = [rng.randrange(rng.choice((2, 3, 5, 40))) for _ in range(rng.randrange(1, 60))]
        lo = rng.randrange(1, 4)
        hi, k = rng.randrange(lo, 7), rng.randrange(1, 6)
        assert ngram_propose(seq, k, lo, hi) == brute(seq, k, lo, hi), (seq, k, lo, hi)


def test_accept_greedy_keeps_the_agreeing_prefix_and_the_target_token() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 9, 1]) == ([4, 5, 9], 2)
    assert accept_greedy([4, 5, 6], [4, 5, 6, 1]) == ([4, 5, 6, 1], 3)
    assert accept_greedy([4, 5, 6], [0, 5, 6, 1]) == ([0], 0)


# ------------------------------------------------------------------ greedy-exact runs
@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_outputs_identical_with_chunking_prefix_hits_and_window(
    model: str, method: str
) -> None:
    prompts = _prompts()
    kw: dict[str, Any] = dict(model=model, chunked_prefill_size=16)
    base = tiny_engine(**kw)
    expected = _run(base, prompts)
    spec = NGRAM if method == "ngram" else _draft(model)
    engine = tiny_engine(**kw, speculative=spec)
    assert _run(engine, prompts) == expected
    st = engine.stats
    assert st.num_cached_prompt_tokens > 0  # the second wave hit the prefix cache
    if model == "builtin:tiny-swa":
        assert st.num_swa_slots_evicted > 0  # outputs ran past the window (32)
    assert st.spec_num_accepted > 0
    # fewer target decode forwards than tokens decoded: verify steps emitted several
    assert st.num_decode_forwards < st.num_decode_tokens
    assert st.num_decode_tokens == base.stats.num_decode_tokens
    if method == "ngram":  # steps without drafts decode through the graph runner
        assert st.graph_replays > 0
    _assert_all_free(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("offload", [False, True])
def test_retraction_and_host_offload_keep_outputs(method: str, offload: bool) -> None:
    prompts = _prompts(seed=3) + _prompts(seed=4)
    kw: dict[str, Any] = dict(max_total_tokens=192, swa_full_tokens_ratio=0.5, chunked_prefill_size=24,
                              enable_host_offload=offload)  # fmt: skip
    expected = _run(tiny_engine(**kw), prompts, new=56, waves=1)
    spec = NGRAM if method == "ngram" else _draft("builtin:tiny-swa")
    engine = tiny_engine(**kw, speculative=spec)
    assert _run(engine, prompts, new=56, waves=1) == expected
    assert engine.stats.num_retractions > 0
    assert engine.stats.spec_num_accepted > 0
    assert engine.stats.spec_fallbacks > 0  # verifies that did not fit: plain decode steps
    _assert_all_free(engine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_families_greedy_identical(tmp_path: Path, family: str) -> None:
    path = str(make_tiny_hf_checkpoint(tmp_path, family))
    prompts = _prompts(vocab=VOCAB_SIZE - 2, seed=1)
    kw: dict[str, Any] = dict(model=path, page_size=2, chunked_prefill_size=12, max_context_len=256)
    expected = _run(tiny_engine(**kw), prompts, new=24)
    for spec in (NGRAM, _draft(path, k=3)):
        engine = tiny_engine(**kw, speculative=spec)
        assert _run(engine, prompts, new=24) == expected, spec.method
        assert engine.stats.spec_num_proposed > 0
        _assert_all_free(engine)


def test_draft_equal_to_target_accepts_nearly_all_a_different_one_few() -> None:
    prompts = _prompts(seed=5)
    expected = _run(tiny_engine(), prompts)
    same = tiny_engine(speculative=_draft("builtin:tiny-swa"))
    assert _run(same, prompts) == expected
    assert _acceptance(same) >= 0.95
    other = tiny_engine(speculative=_draft("builtin:tiny-mha"))  # other weights, same vocab
    assert _run(other, prompts) == expected
    assert _acceptance(other) < 0.5
    _assert_all_free(same)
    _assert_all_free(other)


def test_stop_token_inside_an_accepted_run_truncates_it() -> None:
    """With draft == target every run is accepted whole: a stop token in its middle must
    end the request there, as in plain decoding, and roll back the KV past it."""
    prompt = _prompts(seed=6)[0]
    free = tiny_engine().generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    ids = free.output_ids
    first = next(i for i in range(9, 30) if ids[i] not in ids[:i])  # a token new at i >= 9
    stop = ids[first]
    for new in (30, first + 1):  # a stop token; the length limit at that token
        sp = SamplingParams(max_new_tokens=new, ignore_eos=True, stop_token_ids=(stop,))
        base = tiny_engine().generate([prompt], sp)[0]
        engine = tiny_engine(speculative=_draft("builtin:tiny-swa", k=6))
        out = engine.generate([prompt], sp)[0]
        assert (out.output_ids, out.finish_reason) == (base.output_ids, base.finish_reason)
        assert len(out.output_ids) == first + 1
        assert engine.stats.spec_num_accepted > 0
        _assert_all_free(engine)


def test_sampled_and_logprob_requests_run_beside_drafted_ones() -> None:
    """A sampled request and one asking for logprobs get no drafts, never a refusal;
    greedy ones beside them still speculate."""
    prompts = _prompts(seed=7)
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True),
              SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_new_tokens=32, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=32, ignore_eos=True)]  # fmt: skip
    engine = tiny_engine(speculative=_draft("builtin:tiny-swa"))
    outs = engine.generate(prompts, params)
    base = tiny_engine().generate(prompts, params)
    for i in (0, 2, 3):  # greedy ones: identical tokens
        assert outs[i].output_ids == base[i].output_ids
    assert all(len(o.output_ids) == 32 for o in outs)
    assert outs[2].logprobs is not None and len(outs[2].logprobs) == 32
    # the drafted requests alone: 2 requests x 31 draftable tokens at most
    assert 0 < engine.stats.spec_num_accepted <= 2 * 31
    _assert_all_free(engine)


def test_abort_mid_run_frees_target_and_draft_kv() -> None:
    engine = tiny_engine(speculative=_draft("builtin:tiny-swa"))
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    rids = [engine.add_request(p, sp) for p in _prompts(seed=8)]
    for _ in range(6):
        engine.step()
    assert engine.scheduler.proposer.reqs  # type: ignore[union-attr]
    for rid in rids[:2]:
        assert engine.abort_request(rid) is not None
    while engine.has_unfinished():
        engine.step()
    _assert_all_free(engine)


def test_prefix_cache_holds_no_rejected_token() -> None:
    """After a run with many rejections, every cached path is a prefix of some request's
    committed sequence (prompt + output)."""
    prompts = _prompts(seed=9)
    engine = tiny_engine(speculative=_draft("builtin:tiny-mha"), page_size=2)  # rejects most drafts
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    outs = engine.generate(prompts, sp)
    assert engine.stats.spec_num_proposed > engine.stats.spec_num_accepted + 50
    committed = [o.prompt_ids + o.output_ids for o in outs]
    cache = engine.prefix_cache
    assert cache is not None
    stack: list[tuple[Any, list[int]]] = [(c, []) for c in cache.root.children.values()]  # type: ignore[attr-defined]
    paths = 0
    while stack:
        node, before = stack.pop()
        path = before + [int(t) for t in node.key]
        assert any(seq[: len(path)] == path for seq in committed), path
        paths += 1
        stack.extend((c, path) for c in node.children.values())
    assert paths > 0


def test_canary_log_mode_reports_nothing_on_clean_speculative_runs() -> None:
    """The canary's HEAD / TAIL around verify forwards (several tokens a request, then a
    rollback) see no violation on a clean run."""
    prompts = _prompts(seed=10)
    expected = _run(tiny_engine(), prompts)
    canary = CanaryConfig(mode="log", real_data="all", verify_tokens=True, sweep_interval=2)
    for spec in (NGRAM, _draft("builtin:tiny-swa")):
        engine = tiny_engine(speculative=spec, canary=canary, page_size=2)
        assert _run(engine, prompts) == expected
        assert engine.canary is not None
        assert engine.canary.violations == []
        assert engine.canary.step == engine.stats.num_forwards  # the target's forwards only
        st = engine.stats
        if spec.method == "ngram":  # rejections: rolled-back positions rewritten later
            assert st.spec_num_proposed > st.spec_num_accepted > 0
        else:  # whole runs accepted: verify forwards of K + 1 tokens a request
            assert st.spec_num_accepted > 0.9 * st.spec_num_proposed
        _assert_all_free(engine)


# ------------------------------------------------------------------ config errors
@pytest.mark.parametrize(("kw", "message"), [
    (dict(method="eagle"), r'--speculative-method \(speculative.method\)="eagle" is invalid: allowed one of'),
    (dict(method="ngram", num_speculative_tokens=0),
     r"--num-speculative-tokens \(speculative.num_speculative_tokens\)=0 is invalid: allowed an integer >= 1"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), r"speculative.ngram_max\)=2 is invalid"),
    (dict(method="draft"), r"speculative.draft_model\)=\"\" is invalid"),
])  # fmt: skip
def test_bad_speculative_config_is_one_line(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        SpeculativeConfig(**kw)
    assert "\n" not in str(err.value)


def test_draft_with_another_vocab_is_refused() -> None:
    with pytest.raises(ValueError, match=r"speculative.draft_model\)=\"builtin:qwen3-0.6b-shape\" is "
                                         r"invalid: allowed a model with the target's vocab size 259 "
                                         r"\(it has 151936\)") as err:  # fmt: skip
        Engine(
            EngineConfig(model="builtin:tiny-swa", speculative=_draft("builtin:qwen3-0.6b-shape"))
        )
    assert "\n" not in str(err.value)


def test_deepseek_v4_refuses_speculation() -> None:
    with pytest.raises(ValueError, match=r'--speculative-method \(speculative.method\)="ngram" is invalid: '
                                         r'allowed "none" for DeepSeek-V4 models'):  # fmt: skip
        Engine(EngineConfig(model="builtin:tiny-dsv4", page_size=128, speculative=NGRAM))


def test_speculation_off_by_default() -> None:
    engine = tiny_engine()
    assert engine.scheduler.proposer is None
    out = engine.generate([_prompts()[0]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(out[0].output_ids) == 8 and engine.stats.spec_num_proposed == 0
