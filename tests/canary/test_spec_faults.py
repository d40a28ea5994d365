"""Speculative decoding's fault classes (kvcanary.canary.perturb: draft_position_shift,
draft_chunk_rotation, rejected_kv_kept, rollback_frees_cached, draft_page_leak) injected
into the real engine: the first reported row has the expected tag and reason, names the
slot and position, comes from the right canary (the draft's lines end with ``pool=draft``)
and is reported by the forward that first reads the bad KV; the engine's bookkeeping stays
sound. Clean speculative runs (ngram, draft model; high and low acceptance) report nothing."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from engine_utils import tiny_engine

from kvcanary import Engine, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.explain import explain
from kvcanary.canary.perturb import PerturbConfig, expected_detection, install_perturbation
from kvcanary.canary.perturb.faults import Injection
from kvcanary.config import SpeculativeConfig

CANARY = CanaryConfig(mode="log", real_data="all", verify_tokens=True, sweep_interval=1)
TARGET = "builtin:tiny-mha"
LOW_ACCEPTANCE_DRAFT = "builtin:tiny-swa"  # another model: most drafts rejected
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)


def _draft(model: str = LOW_ACCEPTANCE_DRAFT) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", num_speculative_tokens=4, draft_model=model)


def _engine(spec: SpeculativeConfig, model: str = TARGET) -> Engine:
    return tiny_engine(model=model, speculative=spec, canary=CANARY, page_size=2,
                       chunked_prefill_size=16)  # fmt: skip


def _prompts(seed: int = 0) -> list[list[int]]:
    """A repetitive prompt (ngram drafts), a random one, two sharing a 24-token prefix (the
    first is cached by a first wave)."""
    rng = random.Random(seed)
    pat = [rng.randrange(256) for _ in range(5)]
    shared = [rng.randrange(256) for _ in range(24)]
    return [pat * 7 + [rng.randrange(256) for _ in range(3)], [rng.randrange(256) for _ in range(37)],
            shared + pat * 3, shared + [rng.randrange(256) for _ in range(9)]]  # fmt: skip


class _Reads:
    """Each forward a canary saw: its step and ``{req row: prefix_len}`` (taken in the
    perturber's pre-forward hook, before the fault)."""

    def __init__(self, perturber: Any):
        self.batches: list[tuple[int, dict[int, int]]] = []
        pre = perturber.pre_forward

        def logged(fb: Any) -> None:
            rows = dict(zip(fb.req_pool_indices.tolist(), fb.prefix_lens.tolist(), strict=True))
            self.batches.append((perturber.canary.step, rows))
            pre(fb)

        perturber.pre_forward = logged

    def first_read(self, inj: Injection) -> int:
        """The first forward from the injection on whose committed prefix holds the
        injected (row, position)."""
        row, pos = inj.detail["req_pool_idx"], inj.detail["position"]
        return next(s for s, rows in self.batches if s >= inj.step and rows.get(row, 0) > pos)


def _run(mode: str, spec: SpeculativeConfig, seed: int = 0) -> dict[str, Any]:
    """Wave 1 caches a prefix; the fault is armed for wave 2 (max one injection), which runs to
    the end. The injection, the canary it attached to, its first row and the forward that
    reported it, the outputs, the other canary's rows."""
    engine = _engine(spec)
    prompts = _prompts(seed)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine.generate(prompts[2:3], SamplingParams(max_new_tokens=4, ignore_eos=True))
    perturber = install_perturbation(engine, PerturbConfig.single(mode, 1.0, warmup_steps=0, max_injections=1,
                                                                  seed=seed))  # fmt: skip
    canary = perturber.canary
    reads = _Reads(perturber)
    rids = [engine.add_request(p, sp) for p in prompts]
    first, done = None, {}
    while engine.has_unfinished():
        before = canary.step
        done.update({o.rid: o.output_ids for o in engine.step()})
        if first is None and canary.violations:
            first = canary.violations[0]
            assert first.step - 1 - canary.pump.delay_steps >= before - 1
    canary.flush()
    engine.check_integrity()  # the engine's own bookkeeping stayed sound
    assert perturber.injections, f"{mode}: nothing injected"
    other = [c for c in engine.canaries if c is not canary]
    return {"engine": engine, "canary": canary, "inj": perturber.injections[0], "first": first,
            "detected_at": None if first is None else first.step - 1 - canary.pump.delay_steps,
            "reads": reads, "outputs": [done[r] for r in rids],
            "other_rows": [r for c in other for r in c.violations], "prompts": prompts}  # fmt: skip


def _greedy(prompts: list[list[int]], seed: int = 0) -> list[list[int]]:
    engine = tiny_engine(model=TARGET, page_size=2, chunked_prefill_size=16)
    engine.generate(prompts[2:3], SamplingParams(max_new_tokens=4, ignore_eos=True))
    return [o.output_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))]


def _assert_expected(mode: str, first: Any) -> None:
    assert first is not None, f"{mode}: no row"
    assert expected_detection(mode).matches(first.launch_tag, first.fail_reasons), first


def test_draft_position_off_by_one_is_reported_by_the_draft_canary_at_its_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcanary.canary"):
        r = _run("draft_position_shift", _draft())
    inj, first = r["inj"], r["first"]
    _assert_expected("draft_position_shift", first)
    assert r["canary"] is r["engine"].draft_canary
    assert (first.launch_tag, first.fail_reasons) == ("HEAD_K_FULL", ("write_position",))
    # the slot got the record of position + 1; its seed says it should hold `position`
    assert (first.slot_idx, first.position, first.expected_aux) == (
        inj.detail["slot"], inj.detail["position"] + 1, inj.detail["position"])
    assert r["detected_at"] == inj.step  # the draft's own write check, in the same forward
    lines = [m.splitlines()[0] for m in caplog.messages if "kv_canary violation:" in m]
    assert lines and all(line.endswith(" pool=draft") for line in lines)
    assert r["other_rows"] == []  # the target's canary: silent
    assert r["outputs"] == _greedy(r["prompts"])  # every draft verified: outputs exact
    report = explain(caplog.text)
    assert report["by_pool"] == {"draft": len(lines)}
    causes = {c["cause"]: c for c in report["causes"]}
    assert causes["draft_position_shift"]["count"] >= 1 and all(c.startswith("draft_") for c in causes)
    assert "outputs unaffected" in causes["draft_position_shift"]["explanation"]
    assert any("pool=draft" in h and "draft positions" in h for h in report["hints"])


def test_draft_chunk_boundary_input_rotation_is_a_token_mismatch_on_the_draft_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcanary.canary"):
        r = _run("draft_chunk_rotation", _draft())
    inj, first = r["inj"], r["first"]
    _assert_expected("draft_chunk_rotation", first)
    assert r["canary"] is r["engine"].draft_canary
    assert (first.launch_tag, first.fail_reasons) == ("HEAD_K_FULL", ("verify_token",))
    assert (first.slot_idx, first.position) == (inj.detail["slot"], inj.detail["position"])
    assert (first.stored_token, first.expected_token) == (inj.detail["new_token"], inj.detail["original_token"])
    assert r["detected_at"] == r["reads"].first_read(inj) > inj.step  # the next chunk reads it
    assert r["other_rows"] == []
    assert r["outputs"] == _greedy(r["prompts"])
    report = explain(caplog.text)
    assert set(report["by_pool"]) == {"draft"}
    rotated = next(c for c in report["causes"] if c["cause"] == "draft_wrong_token")
    # its example is the first such line: the injected slot and position
    assert f"slot_idx={inj.detail['slot']} position={inj.detail['position']} " in rotated["example"]
    assert all(c["cause"].startswith("draft_") for c in report["causes"])


@pytest.mark.parametrize("spec", [_draft(), NGRAM], ids=["draft", "ngram"])
def test_a_rejected_drafts_kv_read_as_accepted_is_a_token_mismatch(
    spec: SpeculativeConfig, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvcanary.canary"):
        r = _run("rejected_kv_kept", spec)
    inj, first = r["inj"], r["first"]
    _assert_expected("rejected_kv_kept", first)
    assert r["canary"] is r["engine"].canary
    assert (first.launch_tag, first.fail_reasons) == ("HEAD_K_FULL", ("verify_token",))
    assert (first.slot_idx, first.position) == (inj.detail["slot"], inj.detail["position"])
    assert first.stored_token != first.expected_token  # the rejected draft vs the bonus token
    assert r["detected_at"] == r["reads"].first_read(inj) == inj.step + 1
    assert r["other_rows"] == []
    report = explain(caplog.text)
    assert report["by_pool"] == {"target": report["violations"]}
    # the first row's cause (later rows chain on from the kept record: req_to_token_remap)
    assert "wrong_token" in {c["cause"] for c in report["causes"]}
    assert any("rejected draft's KV read as accepted" in h for h in report["hints"])


def test_a_rollback_freeing_a_cached_page_is_caught_by_the_radix_sweep() -> None:
    r = _run("rollback_frees_cached", _draft())
    inj, first = r["inj"], r["first"]
    _assert_expected("rollback_frees_cached", first)
    assert r["canary"] is r["engine"].canary
    assert first.launch_tag == "SWEEP_K_FULL" and "verify_position" in first.fail_reasons
    # the cached page now holds the writer's record (its position), read in the same step
    assert (first.slot_idx, first.position) == (inj.detail["slot"], inj.detail["position"])
    assert r["detected_at"] == inj.step
    assert r["other_rows"] == []


def test_a_draft_page_leaked_into_a_target_row_is_reported_by_the_target() -> None:
    r = _run("draft_page_leak", _draft())
    inj, first = r["inj"], r["first"]
    _assert_expected("draft_page_leak", first)
    assert r["canary"] is r["engine"].canary
    assert first.launch_tag == "HEAD_K_FULL"
    assert first.slot_idx == inj.detail["slot"] != inj.detail["original_slot"]
    assert r["detected_at"] == r["reads"].first_read(inj) == inj.step  # this forward's HEAD
    assert r["other_rows"] == []


def test_the_draft_modes_refuse_engines_without_a_draft_model() -> None:
    engine = _engine(NGRAM)
    for mode in ("draft_position_shift", "draft_page_leak"):
        with pytest.raises(ValueError, match="draft"):
            install_perturbation(engine, PerturbConfig.single(mode))
    with pytest.raises(ValueError, match="mixes draft-pool modes"):
        install_perturbation(engine, PerturbConfig(draft_position_shift_prob=1.0, rejected_kv_kept_prob=1.0))
    plain = tiny_engine(model=TARGET, canary=CANARY)
    with pytest.raises(ValueError, match="needs speculative decoding"):
        install_perturbation(plain, PerturbConfig.single("rejected_kv_kept"))
    swa = _engine(NGRAM, model="builtin:tiny-swa")
    with pytest.raises(ValueError, match="without an SWA group"):
        install_perturbation(swa, PerturbConfig.single("rollback_frees_cached"))


@pytest.mark.parametrize("spec", [_draft(), _draft(TARGET), NGRAM],
                         ids=["draft-low-acceptance", "draft-high-acceptance", "ngram"])  # fmt: skip
def test_clean_speculative_runs_report_nothing(spec: SpeculativeConfig) -> None:
    engine = _engine(spec)
    prompts = _prompts(1) + _prompts(2)
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for wave in (prompts[:3], prompts[3:]):
        engine.generate(wave, sp)
        engine.check_integrity()
    st = engine.stats
    rate = st.spec_num_accepted / st.spec_num_proposed
    if spec.draft_model == TARGET:
        assert rate == 1.0
    elif spec.method == "draft":
        assert rate < 0.3
    assert sum(c.step for c in engine.canaries) > 100  # forwards checked
    assert [r for c in engine.canaries for r in c.violations] == []
