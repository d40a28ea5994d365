"""Prefill + decode workers in one process over the in-memory link: the same protocol and
code paths as two processes, fast enough to cover every feature and fault."""

from __future__ import annotations

import dataclasses

import pytest
from disagg_testlib import assert_side_clean, greedy, prompts, tiny_config

from kvcanary import Engine, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.disagg.cluster import InProcessDisagg
from kvcanary.disagg.config import DisaggConfig, DisaggFaults
from kvcanary.disagg.protocol import DisaggError

INPROC = DisaggConfig(transfer_backend="inproc")


def _colocated(config, batches, params):
    engine = Engine(config)
    return [o.output_ids for batch in batches for o in engine.generate(batch, params)]


def _disagg(prefill, decode, batches, params, disagg=INPROC, faults=None):
    pair = InProcessDisagg(prefill, decode, disagg, faults)
    outs = [o for batch in batches for o in pair.generate(batch, params, timeout_s=60)]
    return outs, pair.shutdown()


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha"])
def test_outputs_equal_colocated(model) -> None:
    config = tiny_config(model)
    batch = prompts(6, 40, 120, seed=1)
    outs, reports = _disagg(config, config, [batch], greedy(16))
    assert [o.output_ids for o in outs] == _colocated(config, [batch], greedy(16))
    assert all(o.finish_reason == "length" for o in outs)
    assert reports["decode"]["tail_prealloc"] == (model == "builtin:tiny-swa")
    assert reports["decode"]["transfers"] == reports["prefill"]["transfers"] == 6
    assert reports["decode"]["stats"]["num_extend_forwards"] == 0  # decode never prefilled
    assert_side_clean(reports["prefill"])
    assert_side_clean(reports["decode"])


def test_decode_prefix_cache_hits_multi_turn() -> None:
    """Turn 2 extends turn 1 (prompt + outputs): the decode side holds that prefix, so the
    transfer covers only the rest; the window starts inside the hit (delta path) or after
    it (tail path with a prefix)."""
    config = tiny_config()
    (first,) = prompts(1, 130, 130, seed=2)
    turn1 = _colocated(config, [[first]], greedy(16))[0]
    turn2 = [first + turn1 + [5, 6, 7, 8, 9] * k for k in (1, 12)]  # window start 116 / 172
    outs, reports = _disagg(config, config, [[first], turn2], greedy(16))
    assert [o.output_ids for o in outs] == _colocated(config, [[first], turn2], greedy(16))
    assert [o.num_cached_prompt_tokens for o in outs] == [0, 144, 144]
    assert_side_clean(reports["prefill"])
    assert_side_clean(reports["decode"])


def test_sampled_outputs_equal_colocated() -> None:
    """The sampler's generator state travels with the first token."""
    config = tiny_config()
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, ignore_eos=True)
    batch = prompts(3, 30, 60, seed=3)
    outs, _ = _disagg(config, config, [batch], params)
    assert [o.output_ids for o in outs] == _colocated(config, [batch], params)


def test_requests_finished_by_their_first_token() -> None:
    """max_new_tokens=1 (and a prefill pool too small for a prompt) on the decode side."""
    config = tiny_config()
    batch = prompts(3, 30, 60, seed=8) + [[7] * 300]
    params = [greedy(1), greedy(5), greedy(1), greedy(3)]
    small_prefill = dataclasses.replace(config, max_total_tokens=256)
    outs, reports = _disagg(small_prefill, config, [batch], params)
    assert [o.output_ids for o in outs[:3]] == _colocated(config, [batch[:3]], params[:3])
    assert [o.finish_reason for o in outs] == ["length", "length", "length", "error"]
    assert "prefill pool holds 256" in outs[3].error
    assert_side_clean(reports["prefill"])
    assert_side_clean(reports["decode"])


def _violations(report) -> list[dict]:
    return report["canary"]["violations"]


def test_byte_flip_on_prefill_reported_on_decode_only() -> None:
    config = tiny_config(canary=CanaryConfig(mode="log", real_data="partial"))
    outs, reports = _disagg(config, config, [prompts(2, 40, 60, seed=4)], greedy(4),
                            faults=DisaggFaults(real_kv_post_forward=True))  # fmt: skip
    assert _violations(reports["prefill"]) == []
    rows = _violations(reports["decode"])
    assert rows and all(r["fail_reasons"] == ("verify_real_kv_hash",) for r in rows)
    assert min(r["step"] for r in rows) == 1  # the decode side's first forward
    assert all(o.finish_reason == "length" for o in outs)


def test_transfer_one_page_off_reported_on_first_decode_forward() -> None:
    config = tiny_config(canary=CanaryConfig(mode="log", real_data="partial"))
    outs, reports = _disagg(config, config, [prompts(1, 60, 60, seed=5)], greedy(4),
                            faults=DisaggFaults(page_offset=1))  # fmt: skip
    assert _violations(reports["prefill"]) == []
    rows = _violations(reports["decode"])
    assert rows and min(r["step"] for r in rows) == 1
    first = {r["launch_tag"] for r in rows if r["step"] == 1}
    assert {"HEAD_K_FULL", "HEAD_K_SWA"} <= first  # the KV and the state channel were off
    assert any("verify_position" in r["fail_reasons"] for r in rows)
    assert_side_clean(reports["decode"], canary=False)  # memory bookkeeping still intact


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha"])
def test_decode_retraction_with_host_offload(model) -> None:
    """A decode pool too small for every request's outputs: requests are retracted to host
    memory and reloaded (never recomputed); outputs and the canary do not notice."""
    config = tiny_config(model)
    decode = dataclasses.replace(config, max_total_tokens=512, swa_full_tokens_ratio=1.0,
                                 enable_host_offload=True)  # fmt: skip
    batch = prompts(6, 50, 70, seed=6)
    outs, reports = _disagg(config, decode, [batch], greedy(64),
                            disagg=dataclasses.replace(INPROC, num_reserved_decode_tokens=0))  # fmt: skip
    assert [o.output_ids for o in outs] == _colocated(config, [batch], greedy(64))
    stats = reports["decode"]["stats"]
    assert stats["num_retractions"] > 0 and sum(o.num_retractions for o in outs) > 0
    assert stats["num_extend_forwards"] == 0  # reloaded from host, not recomputed
    assert_side_clean(reports["decode"])


def test_transfer_failure_fails_only_that_request_and_frees_its_memory() -> None:
    config = tiny_config()
    disagg = dataclasses.replace(INPROC, transfer_timeout_s=0.5)
    batch = prompts(3, 40, 60, seed=7)
    outs, reports = _disagg(config, config, [batch], greedy(8), disagg=disagg,
                            faults=DisaggFaults(drop_transfer_rids=(2,)))  # fmt: skip
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "timed out" in outs[1].error and outs[1].output_ids == []
    expected = _colocated(config, [batch], greedy(8))
    assert outs[0].output_ids == expected[0] and outs[2].output_ids == expected[2]
    assert_side_clean(reports["prefill"])
    assert_side_clean(reports["decode"])


def test_request_that_never_fits_fails_fast() -> None:
    config = tiny_config()
    decode = dataclasses.replace(config, max_total_tokens=256)
    outs, reports = _disagg(config, decode, [prompts(1, 400, 400)], greedy(4))
    assert outs[0].finish_reason == "error" and "decode pool holds" in outs[0].error
    assert_side_clean(reports["decode"], canary=False)


@pytest.mark.parametrize(
    "decode_overrides",
    [{"canary": CanaryConfig(mode="none")},  # records missing on one side
     {"canary": CanaryConfig(mode="raise")},  # records without the real-KV fingerprint
     {"page_size": 8}],
)  # fmt: skip
def test_layout_mismatch_is_refused(decode_overrides) -> None:
    """Pages and canary records must mean the same on both sides, or nothing is sent."""
    pair = InProcessDisagg(tiny_config(), tiny_config(**decode_overrides))
    with pytest.raises(DisaggError, match="layout differs"):
        pair.generate(prompts(1, 20, 20), greedy(2), timeout_s=10)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decode_side_outputs_equal_plain_colocated(method) -> None:
    """The decode worker speculates on transferred KV (the draft model, if any, prefills its
    own KV from the tokens); outputs equal plain greedy decoding, both canaries clean."""
    from kvcanary.config import SpeculativeConfig

    config = tiny_config("builtin:tiny-swa")
    spec = (SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
            if method == "ngram" else
            SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model="builtin:tiny-swa"))  # fmt: skip
    decode = dataclasses.replace(config, speculative=spec)
    batch = prompts(4, 40, 80, seed=3)
    outs, reports = _disagg(config, decode, [batch], greedy(24))
    assert [o.output_ids for o in outs] == _colocated(config, [batch], greedy(24))
    st = reports["decode"]["stats"]
    assert st["spec_num_proposed"] > 0 and st["spec_num_accepted"] > 0
    assert_side_clean(reports["prefill"])
    assert_side_clean(reports["decode"])
    draft = reports["decode"]["draft_canary"]
    if method == "draft":  # the draft's own canary, over its own pools
        assert draft["stats"]["violations"] == 0 and draft["stats"]["protected_tokens"] > 0
        # the draft is the target: verifies emit several tokens (plain: 23 decode forwards)
        assert st["num_decode_forwards"] < 23
    else:
        assert draft is None
