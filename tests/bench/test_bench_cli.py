"""`kvcanary bench overhead` and `kvcanary bench engine` on tiny settings: what they report,
and one-line errors for bad flags (no timing is asserted); `kvcanary bench vllm`'s flags
(the bench itself needs the vLLM venv)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcanary.bench.vllm_peer import VllmPeer, VllmPeerError
from kvcanary.cli.command import main
from kvcanary.integrations.vllm.bench import (
    add_bench_vllm_flags,
    check_bench_vllm_args,
    hook_shares,
    paired_overheads,
    tok_s_figures,
)


@pytest.fixture(autouse=True)
def keep_torch_threads():  # --threads sets them for the process
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bench_overhead_reports_each_model_batch_phase_and_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "overhead.json"
    assert main(["bench", "overhead", "--model", "builtin:tiny-swa,builtin:tiny-mha",
                 "--batches", "1,3", "--input-len", "40", "--output-len", "3", "--prefill-len", "48",
                 "--repeats", "2", "--variants", "none,log,log+partial", "--threads", "1",
                 "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    rows = {(r["model"], r["batch"], r["phase"], r["variant"]): r for r in data["rows"]}
    keys = [(m, b, p, v) for m in ("builtin:tiny-swa", "builtin:tiny-mha")
            for b, p in ((1, "decode"), (3, "decode"), (1, "prefill"))
            for v in ("none", "log", "log+partial")]  # fmt: skip
    assert list(rows) == keys
    for (_, batch, phase, variant), r in rows.items():
        assert r["identical_outputs"] and r["violations"] == 0
        assert r["tokens_per_s"] > 0
        # decode: output_len - 1 forwards of the whole batch; prefill: one 48-token forward
        assert (r["forwards"], r["mean_batch"]) == ((2, batch) if phase == "decode" else (1, 1))
        assert r["kv_read_bytes_per_forward"] > 0
        if variant == "none":
            assert (r["overhead_pct"], r["canary_bytes_per_forward"]) == (0.0, 0)
        else:
            assert r["canary_vs_kv_read_pct"] == pytest.approx(
                100 * r["canary_bytes_per_forward"] / r["kv_read_bytes_per_forward"], rel=1e-3)
    for m in ("builtin:tiny-swa", "builtin:tiny-mha"):
        log, partial = rows[m, 3, "decode", "log"], rows[m, 3, "decode", "log+partial"]
        assert 0 < log["canary_bytes_per_forward"] < partial["canary_bytes_per_forward"]
    # A forward of 3 decoding requests reads more KV than one of 1.
    assert (rows["builtin:tiny-swa", 3, "decode", "none"]["kv_read_bytes_per_forward"]
            > rows["builtin:tiny-swa", 1, "decode", "none"]["kv_read_bytes_per_forward"])  # fmt: skip
    assert (data["repeats"], data["torch_threads"], data["prefill_len"]) == (2, 1, 48)
    printed = capsys.readouterr().out
    assert "canary/KV %" in printed and "tiny-mha" in printed



def test_bench_overhead_time_canary_times_the_canarys_own_calls(tmp_path: Path) -> None:
    """--time-canary: every canary row gains the host time of the canary's calls (per
    forward, and over the paired none step); none has no canary to time. Without the
    flag the columns are absent (their timers would cost the canary variants)."""
    out = tmp_path / "overhead.json"
    args = ["bench", "overhead", "--model", "builtin:tiny-swa", "--batches", "2",
            "--input-len", "40", "--output-len", "4", "--prefill-len", "0", "--repeats", "1",
            "--variants", "none,log,log+partial", "--no-progress", "--json", str(out)]  # fmt: skip
    assert main([*args, "--time-canary"]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert (rows["none"]["canary_host_us_per_forward"], rows["none"]["canary_host_pct"]) == (0.0, 0.0)
    for v in ("log", "log+partial"):
        assert rows[v]["canary_host_us_per_forward"] > 0 and 0 < rows[v]["canary_host_pct"] < 100
    assert main(args) == 0
    assert all("canary_host_pct" not in r for r in json.loads(out.read_text())["rows"])

@pytest.mark.parametrize("schedule", ["lockstep", "blocks"])
def test_bench_overhead_schedule_orders_the_engines_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: str
) -> None:
    """lockstep: the variants' engines take turns every step; blocks: each runs a case to
    its end before the next starts, the first engine rotated every repeat. Either way the
    same steps are paired: identical outputs, the same forwards per row."""
    from kvcanary.engine.engine import Engine

    order: list[int] = []
    step = Engine.step

    def recorded(self: Engine) -> Any:
        order.append(id(self))
        return step(self)

    monkeypatch.setattr(Engine, "step", recorded)
    out = tmp_path / "overhead.json"
    assert main(["bench", "overhead", "--model", "builtin:tiny-swa", "--batches", "2",
                 "--input-len", "24", "--output-len", "4", "--prefill-len", "0", "--repeats", "2",
                 "--variants", "none,log,log+partial", "--threads", "1", "--schedule", schedule,
                 "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["schedule"] == schedule
    assert [(r["variant"], r["forwards"], r["identical_outputs"], r["violations"])
            for r in data["rows"]] == [(v, 3, True, 0) for v in ("none", "log", "log+partial")]  # fmt: skip
    # The runs of consecutive steps of one engine, warm-up (always lockstep) included.
    runs: list[tuple[int, int]] = []
    for engine in order:
        if runs and runs[-1][0] == engine:
            runs[-1] = (engine, runs[-1][1] + 1)
        else:
            runs.append((engine, 1))
    per_engine = len(order) // 3
    if schedule == "lockstep":
        assert all(n == 1 for _, n in runs)
    else:
        warm = per_engine - 2 * runs[-1][1]  # every engine: warm-up steps, then 2 repeats
        assert all(n == 1 for _, n in runs[: 3 * warm])
        repeats = runs[3 * warm :]
        assert len(repeats) == 6 and len({n for _, n in repeats}) == 1 and repeats[0][1] > 1
        first, second = [e for e, _ in repeats[:3]], [e for e, _ in repeats[3:]]
        assert sorted(first) == sorted(second) and len(set(first)) == 3
        assert second == first[1:] + first[:1]  # rotated by one


def test_bench_engine_matches_transformers_and_notes_a_missing_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, missing = tmp_path / "engine.json", tmp_path / "no-venv" / "python"
    assert main(["bench", "engine", "--batches", "1,2", "--input-len", "24", "--output-len", "5",
                 "--repeats", "1", "--vllm-python", str(missing), "--threads", "1",
                 "--prefill-tokens", "8", "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["prefill_tokens"] == 8  # (12..24-token prompts: ours prefills them in chunks)
    assert [(r["batch"], r["system"], r["mismatches"]) for r in data["rows"]] == [
        (1, "kvcanary", "0/1"), (1, "transformers", "0/1"),
        (2, "kvcanary", "0/2"), (2, "transformers", "0/2"),
    ]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 for r in data["rows"])
    assert data["vllm"].startswith(f"skipped: {missing} not found")
    assert "make test-vllm" in data["vllm"]
    assert f"skipped: {missing} not found" in capsys.readouterr().out


def test_a_vllm_worker_that_cannot_start_is_an_error_with_its_reason(tmp_path: Path) -> None:
    """This venv has no vLLM: the worker reports the import error instead of hanging."""
    with pytest.raises(VllmPeerError, match="vLLM worker: ModuleNotFoundError: No module named 'vllm'"):
        VllmPeer(sys.executable, str(tmp_path), max_model_len=64, max_num_seqs=2, start_timeout_s=120)


@pytest.mark.parametrize(("argv", "expected"), [
    (["overhead", "--batches", "1,x"], '--batches="1,x" is invalid: allowed comma-separated'),
    (["overhead", "--batches", "0,8"], '--batches="0,8" is invalid'),
    (["overhead", "--batches", "8,8"], '--batches="8,8" is invalid'),
    (["overhead", "--output-len", "1"], "--output-len=1 is invalid: allowed an integer >= 2"),
    (["overhead", "--prefill-len", "-1"], "--prefill-len=-1 is invalid: allowed an integer >= 0"),
    (["overhead", "--prefill-len", "5000"],
     "--prefill-len=5000 is invalid: allowed --prefill-len + 1 <= 4096"),
    (["overhead", "--repeats", "0"], "--repeats=0 is invalid: allowed an integer >= 1"),
    (["overhead", "--variants", "log"], '--variants="log" is invalid: allowed a comma-separated subset'),
    (["overhead", "--model", ","], '--model="" is invalid'),
    (["overhead", "--input-len", "0"], "--input-len=0 is invalid: allowed an integer >= 1"),
    (["overhead", "--threads", "0"], "--threads=0 is invalid: allowed an integer >= 1"),
    (["overhead", "--schedule", "x"], '--schedule="x" is invalid: allowed lockstep | blocks'),
    (["engine", "--batches", "16,a"], '--batches="16,a" is invalid'),
    (["engine", "--repeats", "0"], "--repeats=0 is invalid: allowed an integer >= 1"),
    (["engine", "--output-len", "0"], "--output-len=0 is invalid: allowed an integer >= 1"),
    (["engine", "--input-len", "5000"], "--input-len=5000 is invalid"),
    (["engine", "--batches", "16,64", "--prefill-tokens", "32"],
     "--prefill-tokens=32 is invalid: allowed an integer >= the largest batch size"),
])  # fmt: skip
def test_bad_flags_are_one_line_naming_the_flag(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    def no_engine(*_: Any, **__: Any) -> None:
        raise AssertionError("the engine must not start")

    monkeypatch.setattr("kvcanary.bench.overhead.Engine", no_engine)
    monkeypatch.setattr("kvcanary.bench.engine_vs_hf.Engine", no_engine)
    assert main(["bench", *argv, "--no-progress"]) == 2
    assert expected in _one_error_line(capsys)


def test_bench_engine_warms_every_system_at_every_batch_size() -> None:
    """Untimed warm-up: each system once per batch size on prompts cut to 8 tokens (first
    calls at a shape pack weights), then the timed rounds on the full prompts."""
    from kvcanary.bench import engine_vs_hf

    spec = engine_vs_hf.EngineBenchSpec(batches=(1, 3), repeats=2, input_len=20)
    prompts = {1: [list(range(20))], 3: [list(range(15 + i)) for i in range(3)]}
    calls: list[tuple[str, int, int]] = []

    def system(name: str):  # type: ignore[no-untyped-def]
        def generate(ps: list[list[int]]) -> tuple[float, list[list[int]]]:
            calls.append((name, len(ps), max(len(p) for p in ps)))
            return 1.0, [[0] for _ in ps]

        return generate

    results = engine_vs_hf._rounds(spec, prompts, {"a": system("a"), "b": system("b")}, progress=False)
    warm = [("a", 1, 8), ("b", 1, 8), ("a", 3, 8), ("b", 3, 8)]
    timed = [("a", 1, 20), ("b", 1, 20), ("a", 3, 17), ("b", 3, 17)] * 2
    assert calls == warm + timed
    assert all(len(results[b, s][0]) == 2 for b in (1, 3) for s in "ab")


def test_bench_vllm_flags_control_engine_and_bad_values() -> None:
    """``kvcanary bench vllm``'s flags parse without vLLM: the control engine (a second plain
    engine, the noise floor) is on unless ``--no-control``; bad values name the flag."""
    ap = argparse.ArgumentParser()
    add_bench_vllm_flags(ap)
    assert ap.parse_args([]).control is True
    assert ap.parse_args(["--no-control"]).control is False
    assert ap.parse_args([]).connector_control is True
    assert ap.parse_args(["--no-connector-control"]).connector_control is False
    check_bench_vllm_args(ap.parse_args([]))
    with pytest.raises(ValueError, match=r"--rounds=0 is invalid: allowed an integer >= 1"):
        check_bench_vllm_args(ap.parse_args(["--rounds", "0"]))
    with pytest.raises(ValueError, match=r"--canary='\[1\]' is invalid: allowed a JSON object"):
        check_bench_vllm_args(ap.parse_args(["--canary", "[1]"]))


def test_bench_vllm_hook_shares_take_each_hooks_best_pass() -> None:
    """The hook figures of ``kvcanary bench vllm`` come from each hook's best pass: a pass
    slowed by another job (here the second full pass's ``head``) does not raise them; a
    decode step's share is (full - prefill) / decode steps. The paired shares take each
    round's hooks against the plain passes of that round, the median over the rounds."""
    times = {"plain": {"prefill": [0.010, 0.012, 0.011], "full": [0.110, 0.130, 0.121]}}
    hooks = {"prefill": [{"head": 0.0010, "tail": 0.0006}, {"head": 0.0012, "tail": 0.0005},
                         {"head": 0.0011, "tail": 0.0006}],
             "full": [{"head": 0.0110, "tail": 0.0056}, {"head": 0.0900, "tail": 0.0055},
                      {"head": 0.0121, "tail": 0.0061}]}  # fmt: skip
    r = hook_shares(times, hooks, output_len=11)
    assert r["plain_decode_step_ms"] == 10.0  # (110 - 10) ms / 10 decode steps
    assert r["canary_decode_ms"] == {"head": 1.0, "tail": 0.5}  # (11 - 1) / 10, (5.5 - 0.5) / 10
    assert r["canary_decode_total_ms"] == 1.5
    assert r["canary_vs_plain_decode_step_pct"] == 15.0
    assert r["canary_prefill_pass_ms"] == 1.5  # 1.0 + 0.5, each hook's best
    assert r["canary_vs_plain_prefill_pct"] == 15.0
    # Paired, each round's hooks against its plain passes: decode 15.0 / 100, 93.8 / 118,
    # 16.5 / 110 ms -> median 15 %; prefill 1.6 / 10, 1.7 / 12, 1.7 / 11 -> 15.45 %.
    assert r["paired_canary_vs_plain_decode_step_pct"] == 15.0
    assert r["paired_canary_vs_plain_prefill_pct"] == 15.5


def test_bench_vllm_tok_s_figures_tell_the_connector_interface_from_the_canary() -> None:
    """Each engine's best passes give its tok/s; the control engine gives the noise floor,
    the no-op connector engine what vLLM's connector interface costs against plain and
    what the canary costs beyond it; without those engines, neither section."""
    times = {"plain": {"prefill": [0.20, 0.10], "full": [1.10, 1.30]},
             "canary": {"prefill": [0.125, 0.13], "full": [1.375, 1.5]},
             "control": {"prefill": [0.10, 0.11], "full": [1.20, 1.20]},
             "connector": {"prefill": [0.11, 0.12], "full": [1.20, 1.21]}}  # fmt: skip
    r = tok_s_figures(times, n_in=100, n_out=10)
    assert r["prefill_tok_s"] == {"plain": 1000.0, "canary": 800.0, "overhead_pct": 25.0}
    assert r["decode_tok_s"] == {"plain": 10.0, "canary": 8.0, "overhead_pct": 25.0}  # 10 / 1.25
    assert r["noise_floor"]["decode_tok_s"] == {"plain": 10.0, "control": 9.1, "difference_pct": 10.0}
    c = r["connector_control"]["decode_tok_s"]  # 10 / (1.2 - 0.11)
    assert c == {"plain": 10.0, "connector": 9.2, "interface_pct": 9.0,
                 "canary_beyond_interface_pct": 14.7}  # fmt: skip
    assert r["connector_control"]["prefill_tok_s"]["interface_pct"] == 10.0  # 1000 / 909.1
    bare = tok_s_figures({k: times[k] for k in ("plain", "canary")}, n_in=100, n_out=10)
    assert set(bare) == {"prefill_tok_s", "decode_tok_s", "paired"}
    assert set(bare["paired"]["decode_pct"]) == {"canary_vs_plain"}


def test_bench_vllm_paired_figures_are_the_median_of_each_rounds_ratio() -> None:
    """The paired figures compare two engines' passes of the same round (decode: full -
    prefill of that round) and take the median ratio: a round slow for every engine (the
    second) moves none of them, and they can differ from the best passes' ratio."""
    times = {"plain": {"prefill": [0.10, 0.40, 0.10], "full": [1.10, 4.40, 1.00]},
             "canary": {"prefill": [0.11, 0.44, 0.12], "full": [1.31, 5.24, 1.32]},
             "control": {"prefill": [0.10, 0.41, 0.09], "full": [1.05, 4.51, 1.09]},
             "connector": {"prefill": [0.10, 0.42, 0.11], "full": [1.12, 4.42, 1.11]}}  # fmt: skip
    p = paired_overheads(times)
    assert p["rounds"] == 3
    # canary / plain: prefill 1.1, 1.1, 1.2 -> 1.1; decode 1.2 / 1.0, 4.8 / 4.0, 1.2 / 0.9
    assert p["prefill_pct"]["canary_vs_plain"] == 10.0
    assert p["decode_pct"]["canary_vs_plain"] == 20.0
    # control / plain decode 0.95, 1.025, 1.1111 -> 1.025; prefill 1.0, 1.025, 0.9 -> 1.0
    assert p["decode_pct"]["control_vs_plain"] == 2.5
    assert p["prefill_pct"]["control_vs_plain"] == 0.0
    # canary / connector decode 1.2 / 1.02, 4.8 / 4.0, 1.2 / 1.0 -> 1.1765, 1.2, 1.2
    assert p["decode_pct"]["canary_vs_connector"] == 20.0
    assert p["decode_pct"]["connector_vs_plain"] == 2.0  # 1.02, 1.0, 1.1111 -> 1.02
