"""SWA divergence reporter: the log record (format / tolerant parse / find_last / find_all),
the two metrics, the delayed handler (logged at T+1 with T's counters), the assertion
helper, and the three signals on real tiny-swa runs (present when sequences outgrow the
window, absent when they never leave it). It never changes a forward."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch
from engine_utils import tiny_engine

from kvcanary import SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.observe.delayed import DelayedDeviceHostHandler
from kvcanary.canary.observe.swa_divergence import (
    SwaDivergenceLog,
    SwaDivergenceReporter,
    VerifyTotals,
    assert_swa_divergence_observed,
    swa_full_idx_divergence,
    swa_out_of_window_tokens,
)
from kvcanary.canary.wire.constants import PoolKind

SAMPLE = SwaDivergenceLog(forward_ct=120, verify_full=10000, verify_swa=4200,
                          swa_full_idx_divergence=512, swa_out_of_window_tokens=8192)  # fmt: skip
SAMPLE_LINE = (
    'kv_canary_swa_divergence={"forward_ct":120,"verify_full":10000,"verify_swa":4200,'
    '"swa_full_idx_divergence":512,"swa_out_of_window_tokens":8192}'
)


def _line(div: int, oow: int, full: int = 100, swa: int = 40, ct: int = 1) -> str:
    rec = SwaDivergenceLog(forward_ct=ct, verify_full=full, verify_swa=swa,
                           swa_full_idx_divergence=div, swa_out_of_window_tokens=oow)  # fmt: skip
    return f"[2026-01-01 00:00:00 TP0] {rec.format()}\n"


# ------------------------------------------------------------------ the record


def test_format_is_sglangs_compact_json_line() -> None:
    assert SAMPLE.format() == SAMPLE_LINE
    assert SwaDivergenceLog.parse(f"INFO 12:00 {SAMPLE_LINE} trailing") == SAMPLE


def test_parse_is_tolerant() -> None:
    old = 'kv_canary_swa_divergence={"forward_ct":3,"verify_full":9,"verify_swa":4,"swa_full_idx_divergence":1}'
    assert SwaDivergenceLog.parse(old) == SwaDivergenceLog(
        forward_ct=3, verify_full=9, verify_swa=4, swa_full_idx_divergence=1
    )  # an older line without swa_out_of_window_tokens: 0
    extra = SAMPLE_LINE.replace("}", ',"schema":2}')
    assert SwaDivergenceLog.parse(extra) == SAMPLE  # unknown keys ignored
    assert SwaDivergenceLog.parse("no sample here") is None
    assert SwaDivergenceLog.parse("kv_canary_swa_divergence={broken") is None
    assert SwaDivergenceLog.parse('kv_canary_swa_divergence={"forward_ct":"x"}') is None
    assert SwaDivergenceLog.parse("kv_canary_swa_divergence=[1,2]") is None


def test_find_all_and_find_last() -> None:
    text = _line(0, 0, ct=1) + "noise\nkv_canary_swa_divergence={bad\n" + _line(5, 7, ct=2)
    found = SwaDivergenceLog.find_all(text)
    assert [r.forward_ct for r, _ in found] == [1, 2]
    assert all(m.startswith("kv_canary_swa_divergence={") for _, m in found)
    last = SwaDivergenceLog.find_last(text)
    assert last is not None and last[0].swa_full_idx_divergence == 5
    assert SwaDivergenceLog.find_last("nothing") is None and SwaDivergenceLog.find_all("") == []


# ------------------------------------------------------------------ the metrics


def _table() -> tuple[torch.Tensor, torch.Tensor]:
    """Two requests (rows 1, 2): row 1 slots 1..4, row 2 slots 5..8; a mapping where slot 1
    left the window (0), slots 2 and 6 moved (10, 11), the rest are the identity."""
    r2t = torch.zeros(3, 6, dtype=torch.int32)
    r2t[1, :4] = torch.tensor([1, 2, 3, 4])
    r2t[2, :4] = torch.tensor([5, 6, 7, 8])
    r2t[2, 4:] = torch.tensor([2, 2])  # stale entries past seq_len
    lut = torch.arange(13, dtype=torch.int64)
    lut[1], lut[2], lut[6], lut[-1] = 0, 10, 11, -1
    return lut, r2t


@pytest.mark.parametrize(
    ("rows", "seq_lens", "divergence", "out_of_window"),
    [
        ([1, 2], [4, 4], 2, 1),
        ([1, 2], [1, 4], 1, 1),  # positions past seq_len (slots 2..4 of row 1) do not count
        ([2], [4], 1, 0),
        ([2, 0], [4, 1], 1, 0),  # a padding row (req_to_token row 0 -> slot 0 -> mapping 0)
        ([], [], 0, 0),
    ],
)
def test_metrics(rows: list[int], seq_lens: list[int], divergence: int, out_of_window: int) -> None:
    lut, r2t = _table()
    args = (lut, r2t, torch.tensor(rows, dtype=torch.int64), torch.tensor(seq_lens, dtype=torch.int64))
    got_div, got_oow = swa_full_idx_divergence(*args), swa_out_of_window_tokens(*args)
    assert got_div.dtype == got_oow.dtype == torch.int32 and got_div.shape == (1,)
    assert (int(got_div[0]), int(got_oow[0])) == (divergence, out_of_window)


def test_identity_mapping_has_no_divergence() -> None:
    _, r2t = _table()
    lut = torch.arange(13, dtype=torch.int64)
    args = (lut, r2t, torch.tensor([1, 2]), torch.tensor([4, 4]))
    assert int(swa_full_idx_divergence(*args)[0]) == 0 == int(swa_out_of_window_tokens(*args)[0])


def test_reporter_logs_at_t_plus_1_with_the_staging_steps_counters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lut, r2t = _table()
    totals = VerifyTotals(torch.device("cpu"))
    reporter = SwaDivergenceReporter(5, totals, DelayedDeviceHostHandler(torch.device("cpu")), lut, r2t)
    fb = SimpleNamespace(req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([3, 3]),
                         extend_seq_lens=torch.tensor([1, 1]))  # fmt: skip
    with caplog.at_level(logging.INFO, "kvcanary.canary"):
        for step in range(1, 7):
            totals.observe(PoolKind.FULL, 10)
            totals.observe(PoolKind.SWA, 4)
            totals.observe(PoolKind.C4, 99)  # not counted
            reporter.step(step, fb)
            if step == 5:
                assert "kv_canary_swa_divergence" not in caplog.text  # staged only
                lut[3] = 12  # changes after staging must not leak into the step-5 line
    assert [r.getMessage() for r in caplog.records] == [
        'kv_canary_swa_divergence={"forward_ct":5,"verify_full":50,"verify_swa":20,'
        '"swa_full_idx_divergence":2,"swa_out_of_window_tokens":1}'
    ]
    assert reporter.peak() == {"samples": 1, "swa_full_idx_divergence": 2, "swa_out_of_window_tokens": 1}


def test_reporter_without_an_swa_group_logs_zero_metrics(caplog: pytest.LogCaptureFixture) -> None:
    totals = VerifyTotals(torch.device("cpu"))
    reporter = SwaDivergenceReporter(1, totals, DelayedDeviceHostHandler(torch.device("cpu")),
                                     None, torch.zeros(2, 4, dtype=torch.int32))  # fmt: skip
    with caplog.at_level(logging.INFO, "kvcanary.canary"):
        reporter.step(1, None)
        reporter.handler.flush()
    record = SwaDivergenceLog.parse(caplog.text)
    assert record == SwaDivergenceLog(forward_ct=1, verify_full=0, verify_swa=0, swa_full_idx_divergence=0)


# ------------------------------------------------------------------ the assertion helper


def test_helper_passes_on_a_good_log_and_reads_the_peak() -> None:
    text = _line(3, 9, 100, 40) + _line(0, 0, 200, 80)  # a trailing in-window sample
    assert assert_swa_divergence_observed(text).verify_full == 200


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        (_line(3, 0), {}, "window never slid"),
        (_line(0, 5), {}, "never diverged"),
        (_line(3, 5, 100, 40) + _line(3, 5, 100, 100), {}, "no verify lag"),
        (_line(1, 1), dict(min_swa_full_idx_divergence=2), "swa_full_idx_divergence=1 < 2"),
        ("unrelated log\n", {}, "No kv_canary swa_divergence line"),
    ],
)
def test_helper_failures_name_the_signal(text: str, kwargs: dict, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        assert_swa_divergence_observed(text, **kwargs)


def test_helper_thresholds_and_lag_can_be_relaxed() -> None:
    text = _line(1, 1, 100, 100)
    assert_swa_divergence_observed(text, require_verify_lag=False)
    assert_swa_divergence_observed(_line(0, 0), min_swa_out_of_window_tokens=0,
                                   min_swa_full_idx_divergence=0)  # fmt: skip


def test_helper_retries_a_live_log_until_the_signals_hold() -> None:
    reads = iter(["starting\n", "starting\n" + _line(0, 0), "starting\n" + _line(0, 0) + _line(2, 4)])
    calls = []

    def source() -> str:
        calls.append(1)
        return next(reads)

    record = assert_swa_divergence_observed(source, flush_wait_seconds=0, max_retries=5)
    assert record.swa_out_of_window_tokens == 4 and len(calls) == 3
    with pytest.raises(AssertionError, match=r"No kv_canary swa_divergence line found .* after 3 read"):
        assert_swa_divergence_observed(lambda: "", flush_wait_seconds=0, max_retries=3)


# ------------------------------------------------------------------ on the engine


def _run_logged(caplog: pytest.LogCaptureFixture, prompt_len: int, max_new_tokens: int,
                **config) -> tuple[str, list[list[int]]]:  # fmt: skip
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(prompt_len)] for _ in range(6)]
    engine = tiny_engine(model="builtin:tiny-swa", max_total_tokens=1024, swa_full_tokens_ratio=0.25,
                         **config)  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO, "kvcanary.canary"):
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return caplog.text, [o.output_ids for o in outs]


def test_three_signals_on_a_run_that_outgrows_the_window(caplog: pytest.LogCaptureFixture) -> None:
    text, outs = _run_logged(caplog, 40, 40,
                             canary=CanaryConfig(mode="log", swa_divergence_interval=5))
    last = assert_swa_divergence_observed(text)
    assert last.verify_swa < last.verify_full
    # Purely an observer: the same run without it produces the same tokens.
    _, plain = _run_logged(caplog, 40, 40, canary=CanaryConfig(mode="log"))
    assert outs == plain


def test_no_out_of_window_tokens_on_a_run_inside_the_window(caplog: pytest.LogCaptureFixture) -> None:
    text, _ = _run_logged(caplog, 12, 12,
                          canary=CanaryConfig(mode="log", swa_divergence_interval=2))
    samples = [r for r, _ in SwaDivergenceLog.find_all(text)]
    assert samples and all(s.swa_out_of_window_tokens == 0 for s in samples)
    assert samples[-1].verify_swa == samples[-1].verify_full  # the window never clipped
    with pytest.raises(AssertionError, match="window never slid"):
        assert_swa_divergence_observed(text)


def test_interval_defaults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcanary.config import EngineConfig

    monkeypatch.setenv("KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL", "20")
    assert EngineConfig().canary.swa_divergence_interval == 20
    assert CanaryConfig(swa_divergence_interval=3).swa_divergence_interval == 3
    monkeypatch.setenv("KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL", "-1")
    with pytest.raises(ValueError, match='KVCANARY_SWA_DIVERGENCE_STATS_INTERVAL="-1" is invalid'):
        EngineConfig()
