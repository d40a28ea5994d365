"""Fault injection: every fault class is reported with its expected tag and reason on every
pool it applies to, the same workloads without injection report nothing, injections replay
from the seed, and bad perturbation setups are refused with a clear message."""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch
from engine_utils import tiny_engine

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.observe.token_oracle import TokenOracleExpectations, oracle_tokens_t
from kvcanary.canary.perturb import (
    PERTURB_MODES,
    PerturbConfig,
    applies_to,
    expected_detection,
    install_perturbation,
)
from kvcanary.cli.selftest import FaultCase, engine_config, run_case, run_selftest
from kvcanary.engine.engine import Engine
from kvcanary.engine.forward_batch import ForwardBatch, ForwardMode
from kvcanary.engine.sampling import oracle_token

LOG_PARTIAL = CanaryConfig(mode="log", real_data="partial")


@pytest.fixture(autouse=True)
def quiet_canary_log():
    """The injected faults' reports are the expected outcome; keep pytest's output short."""
    log = logging.getLogger("kvcanary.canary")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def test_reduced_campaign_detects_every_class_on_every_pool_and_clean_runs_are_silent() -> None:
    summary = run_selftest(seeds=[0], progress=False)
    assert summary["ok"], summary["missed"]
    classes = {(r["fault"], r["model"].removeprefix("builtin:")) for r in summary["matrix"]}
    swa_only = {"swa_mapping", "premature_window_eviction"}
    per_group = {"real_kv_used", "real_kv_unused_cache", "real_kv_post_forward", "lost_kv_store"}
    # Groups holding fingerprinted KV bytes (tiny-swa-all's FULL group is records-only).
    byte_groups = {"tiny-mha": ["full"], "tiny-swa": ["full", "swa"], "tiny-swa-all": ["swa"]}
    spec = {"draft_position_shift", "draft_chunk_rotation", "rejected_kv_kept",
            "rollback_frees_cached", "draft_page_leak"}  # fmt: skip
    expected = {(mode, "spec:builtin:tiny-mha") for mode in spec}  # the speculative workload's
    for pool in ("tiny-mha", "tiny-swa", "tiny-swa-all"):
        for mode in PERTURB_MODES:
            if mode in spec or (mode in swa_only and pool == "tiny-mha"):
                continue
            groups = byte_groups[pool] if mode in per_group else [None]
            expected |= {(f"{mode}[{g}]" if g else mode, pool) for g in groups}
    assert classes == expected  # 8 on the MHA pool, 14 on the SWA pool, 10 all-sliding, 5 spec
    for row in summary["fault_runs"]:
        exp = expected_detection(row["mode"], row["target_group"])
        assert row["injected"] and row["detected"], row
        assert exp.matches(row["detected_tag"], row["detected_reasons"])
        if row["mode"] == "draft_chunk_rotation":  # the draft's catch-up serves the other
            # requests' chunks first; its first read is a few forwards on (test_spec_faults
            # checks that the forward of the first read reports it)
            assert 1 <= row["steps_to_detection"] <= 4
        else:
            assert row["steps_to_detection"] in (0, 1)  # the forward that reads the fault (or next)
    for row in summary["clean_runs"]:
        assert row["violations"] == 0 and row["ok"] and row["error"] is None
        assert row["protected_tokens"] > 0 and row["sweep_passes"] > 0
    swa_clean = next(r for r in summary["clean_runs"] if r["model"] == "builtin:tiny-swa")
    assert swa_clean["swa_divergence"]["swa_out_of_window_tokens"] > 0  # the window slid


def test_dsv4_campaign_detects_every_sub_pool_class_and_clean_run_is_silent() -> None:
    """builtin:tiny-dsv4, default classes: a byte flip per group holding KV bytes (SWA, the
    C4 / C128 / indexer entries, the three compress-state rings) before and after a forward,
    the cached-slot flip on the sweepable SWA group, and the two SWA-mapping faults; the
    modes expected under HEAD_K_FULL (the pool has no FULL group) and lost_kv_store (no store
    check on a DSV4 pool) are left out."""
    summary = run_selftest(models=["builtin:tiny-dsv4"], seeds=[0], progress=False)
    assert summary["ok"], summary["missed"]
    groups = ["swa", "c4", "c128", "indexer", "c4_state", "c128_state", "indexer_state"]
    expected = {f"{m}[{g}]" for m in ("real_kv_used", "real_kv_post_forward") for g in groups}
    expected |= {"real_kv_unused_cache[swa]", "swa_mapping", "premature_window_eviction"}
    assert {r["fault"] for r in summary["matrix"]} == expected
    for row in summary["fault_runs"]:
        assert row["injected"] and row["detected"], row
        assert expected_detection(row["mode"], row["target_group"]).matches(
            row["detected_tag"], row["detected_reasons"])
    (clean,) = summary["clean_runs"]
    assert clean["violations"] == 0 and clean["error"] is None and clean["sweep_passes"] > 0


def test_dsv4_byte_flip_targets() -> None:
    """On a DSV4 pool the target group is required and any of its groups may be named;
    the sweep / store-check modes only per-position groups with a store check serve."""
    def dsv4() -> Engine:
        return Engine(engine_config("builtin:tiny-dsv4"))

    with pytest.raises(ValueError, match="target_group=None is invalid: allowed one of c128, "):
        install_perturbation(dsv4(), PerturbConfig(real_kv_used_prob=0.1))
    with pytest.raises(ValueError, match=re.escape("target_group='c4' is invalid for "
                                                   "['real_kv_unused_cache']")):  # fmt: skip
        install_perturbation(dsv4(), PerturbConfig(real_kv_unused_cache_prob=0.1, target_group="c4"))
    with pytest.raises(ValueError, match="lost_kv_store on group 'swa' needs the canary's store check"):
        install_perturbation(dsv4(), PerturbConfig(lost_kv_store_prob=0.1, target_group="swa"))
    with pytest.raises(ValueError, match="target_group='c4_state'; allowed one of full, swa"):
        expected_detection("lost_kv_store", "c4_state")
    assert expected_detection("real_kv_used", "c4_state").tags == ("TAIL_K_C4_STATE",)
    assert not applies_to("page_shift", has_swa_group=True, has_full_group=False)
    assert applies_to("swa_mapping", has_swa_group=True, has_full_group=False)


def test_expected_table_and_where_classes_apply() -> None:
    assert expected_detection("real_kv_used", "swa").tags == ("TAIL_K_SWA",)
    assert expected_detection("real_kv_unused_cache", "full").tags == ("SWEEP_K_FULL",)
    assert expected_detection("next_token_swap").reasons == ("write_token",)
    assert expected_detection("swa_mapping").matches("HEAD_K_SWA", ("verify_position",))
    assert not expected_detection("swa_mapping").matches("HEAD_K_FULL", ("verify_position",))
    with pytest.raises(ValueError, match="target_group"):
        expected_detection("real_kv_used")
    assert not applies_to("swa_mapping", has_swa_group=False)
    assert not applies_to("premature_window_eviction", has_swa_group=False)
    assert expected_detection("lost_kv_store", "swa").matches("TAIL_K_SWA", ("write_kv_store",))
    assert expected_detection("premature_window_eviction").matches(
        "HEAD_K_SWA", ("verify_not_resident",)
    )
    # the handed-over cached page has no SWA part to move: MHA pools only
    assert all(applies_to(m, has_swa_group=True) for m in PERTURB_MODES if m != "rollback_frees_cached")
    assert not applies_to("rollback_frees_cached", has_swa_group=True)
    assert applies_to("rollback_frees_cached", has_swa_group=False)


def test_same_seed_injects_the_same_faults() -> None:
    def injections(seed: int) -> list[object]:
        engine = tiny_engine(model="builtin:tiny-swa", canary=CanaryConfig(mode="log"),
                             graph_batch_sizes=())
        config = PerturbConfig(req_to_token_prob=0.5, page_shift_prob=0.3, stale_reuse_prob=0.3,
                               warmup_steps=3, seed=seed)  # fmt: skip
        perturber = install_perturbation(engine, config)
        rng = random.Random(1)
        prompts = [[rng.randrange(256) for _ in range(30)] for _ in range(3)]
        engine.generate(prompts)
        return [(i.mode, i.step, i.detail) for i in perturber.injections]

    first = injections(7)
    assert first and first == injections(7)
    assert first != injections(8)
    assert min(step for _, step, _ in first) >= 3  # nothing during the warm-up


def test_warmup_and_enable_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine(model="builtin:tiny-mha", canary=CanaryConfig(mode="log"))
    install_perturbation(engine, PerturbConfig(req_to_token_prob=0.2, warmup_steps=2))
    with caplog.at_level(logging.INFO, "kvcanary.canary"):
        engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 2)
    text = caplog.text
    assert text.count("kv_canary perturb: disabled during warmup window (first 2 forward steps)") == 1
    assert text.count("kv_canary perturb: enabled after warmup window at step=2") == 1


def test_max_injections_caps_each_mode() -> None:
    engine = tiny_engine(model="builtin:tiny-mha",
                         canary=CanaryConfig(mode="log", real_data="partial"))
    perturber = install_perturbation(
        engine, PerturbConfig(real_kv_used_prob=1.0, warmup_steps=0, max_injections=2)
    )
    engine.generate([[3] * 20, [4] * 24])
    assert perturber.counts["real_kv_used"] == 2


@pytest.mark.parametrize(
    ("model", "engine_kw", "config", "message"),
    [
        ("builtin:tiny-swa", dict(canary=LOG_PARTIAL),
         PerturbConfig(real_kv_used_prob=0.1), "target_group=None is invalid"),
        ("builtin:tiny-mha", dict(canary=LOG_PARTIAL),
         PerturbConfig(real_kv_used_prob=0.1, target_group="swa"), "target_group='swa' is invalid"),
        ("builtin:tiny-mha", {}, PerturbConfig(real_kv_post_forward_prob=0.1),
         "['real_kv_post_forward'] flips real KV bytes: --kv-canary-real-data=none"),
        ("builtin:tiny-mha", dict(canary=CanaryConfig(mode="log", real_data="partial",
                                                      sweep_interval=2),
                                  enable_prefix_cache=False),
         PerturbConfig(real_kv_unused_cache_prob=0.1), "needs a prefix cache"),
        ("builtin:tiny-mha", dict(canary=LOG_PARTIAL),
         PerturbConfig(real_kv_unused_cache_prob=0.1), "--kv-canary-sweep-interval=0"),
        ("builtin:tiny-mha", {}, PerturbConfig(swa_mapping_prob=0.1), "needs a pool with an SWA group"),
        ("builtin:tiny-mha", {}, PerturbConfig(next_token_swap_prob=0.1), "token_oracle=True"),
    ],
)  # fmt: skip
def test_bad_perturbation_setups_are_refused(model: str, engine_kw: dict, config: PerturbConfig,
                                             message: str) -> None:  # fmt: skip
    engine = tiny_engine(model=model, **{"canary": CanaryConfig(mode="log"), **engine_kw})
    with pytest.raises(ValueError, match=re.escape(message)):
        install_perturbation(engine, config)
    assert engine.canary.perturber is None


def test_perturb_config_validation_and_no_canary() -> None:
    with pytest.raises(ValueError, match="PerturbConfig.req_to_token_prob=1.5 is invalid"):
        PerturbConfig(req_to_token_prob=1.5)
    with pytest.raises(ValueError, match="PerturbConfig.target_group='both'"):
        PerturbConfig(target_group="both")
    with pytest.raises(ValueError, match="PerturbConfig.mode='bogus'"):
        PerturbConfig.single("bogus")
    assert PerturbConfig.single("page_shift", 0.5).active_modes == ["page_shift"]
    with pytest.raises(ValueError, match='--kv-canary is "none"'):
        install_perturbation(tiny_engine(model="builtin:tiny-mha"), PerturbConfig())


def test_single_run_reports_injection_and_detection_steps() -> None:
    row, engine = run_case("builtin:tiny-swa", FaultCase("swa_mapping", "builtin:tiny-swa"))
    assert row["injected"] and row["detected"] and row["detected_tag"] == "HEAD_K_SWA"
    assert row["injection"]["original_swa_slot"] != row["injection"]["new_swa_slot"]
    assert row["detection_step"] == row["injection_step"]  # the HEAD verify of that forward
    engine.check_integrity()  # transient metadata faults leave the engine's bookkeeping sound


# ------------------------------------------------------------------ the token oracle's expectations


def test_vectorised_oracle_matches_the_sampler() -> None:
    rng = random.Random(0)
    rids = [rng.randrange(1, 2**40) for _ in range(500)]
    positions = [rng.randrange(0, 4096) for _ in range(500)]
    got = oracle_tokens_t(torch.tensor(rids), torch.tensor(positions), 259).tolist()
    assert got == [oracle_token(r, p, 259) for r, p in zip(rids, positions, strict=True)]


def test_oracle_expectations_accept_prompt_tokens_fed_by_decode() -> None:
    """Row 1 feeds the last prompt token by decode (its prompt has 5 tokens); row 2 an output
    token; row 3 is graph padding."""

    def t(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64)

    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=t([1, 2, 0]), seq_lens=t([5, 9, 1]),
        prefix_lens=t([4, 8, 0]), extend_seq_lens=t([1, 1, 1]),
        input_ids=t([42, oracle_token(11, 8, 259), 0]), positions=t([4, 8, 0]),
        out_cache_loc=t([17, 18, 0]), seq_lens_cpu=[5, 9, 1], prefix_lens_cpu=[4, 8, 0],
        extend_seq_lens_cpu=[1, 1, 1], rids=[10, 11, 0],
    )  # fmt: skip
    expect = TokenOracleExpectations(259, lambda rids: [{10: 5, 11: 3}.get(r, 0) for r in rids])
    tokens, positions = expect(fb)
    assert tokens[:2].tolist() == [42, oracle_token(11, 8, 259)]
    assert positions.tolist() == [4, 8, 0]
