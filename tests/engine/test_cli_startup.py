"""Start-up rough edges of the CLI: each reproduces what a new user hit (a traceback, a
message blaming the wrong knob, a bar stuck at 0 %), then checks the clean behaviour."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import pytest

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.cli.command import build_parser, main
from kvcanary.engine.errors import KVPoolTooSmallError, RequestTooLargeError
from kvcanary.engine.kv_manager import pool_need
from kvcanary.engine.pool_check import check_engine_pools, check_pools
from kvcanary.engine.request import Req
from kvcanary.utils import ceil_page
from kvcanary.workload import WorkloadSpec, make_prompts

SMALL = ["--num-requests", "3", "--input-len", "96", "--shared-prefix-len", "16",
         "--output-len", "24", "--no-progress"]  # fmt: skip


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # one line, no traceback
    assert "Traceback" not in err
    return lines[0]


def test_python_dash_m_kvcanary_runs_the_cli() -> None:
    r = subprocess.run([sys.executable, "-m", "kvcanary", "--help"], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "usage: kvcanary" in r.stdout and "serve" in r.stdout


def test_bad_env_var_is_one_line_and_help_still_works(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setenv("KVCANARY_KV_CANARY_RING_CAPACITY", "abc")
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0
    assert "--kv-canary-ring-capacity" in capsys.readouterr().out
    assert main(["run", *SMALL]) == 2
    line = _one_error_line(capsys)
    assert 'KVCANARY_KV_CANARY_RING_CAPACITY="abc" is invalid: allowed an integer >= 1' in line
    # A command that never builds a canary config reports it too (every command reads them).
    assert main(["explain", "/nonexistent"]) == 2
    assert "KVCANARY_KV_CANARY_RING_CAPACITY" in _one_error_line(capsys)


def test_input_len_beyond_the_context_is_refused_before_the_engine_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_engine(*_: Any, **__: Any) -> None:
        raise AssertionError("the engine must not start")

    monkeypatch.setattr("kvcanary.cli.run.Engine", no_engine)
    assert main(["run", "--input-len", "100000", "--shared-prefix-len", "0", "--no-progress"]) == 2
    line = _one_error_line(capsys)
    assert "--input-len=100000 is invalid" in line
    assert "allowed --input-len + --output-len <= 4096" in line
    monkeypatch.setattr("kvcanary.bench.overhead.Engine", no_engine)
    assert main(["bench", "overhead", "--input-len", "100000", "--shared-prefix-len", "0",
                 "--no-progress"]) == 2  # fmt: skip
    assert "--input-len=100000 is invalid" in _one_error_line(capsys)


def test_max_total_tokens_320_names_the_swa_pool_and_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--max-total-tokens", "320", "--no-progress"]) == 2
    line = _one_error_line(capsys)
    assert "KV pool too small: the SWA pool" in line
    assert "holds 80 tokens" in line
    for flag in ("--swa-full-tokens-ratio", "--max-total-tokens", "--chunked-prefill-size"):
        assert flag in line


def test_full_pool_too_small_names_max_total_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "builtin:tiny-mha", "--max-total-tokens", "64", *SMALL]) == 2
    line = _one_error_line(capsys)
    assert "the full pool (--max-total-tokens 64) holds 64 tokens" in line
    longest = max(map(len, make_prompts(WorkloadSpec(3, 96, 24, 16), 259)))
    assert f"raise --max-total-tokens to {ceil_page(longest + 24 - 1, 4)} or more" in line


def test_a_mid_run_pool_error_is_one_line_too(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    def too_small(*_: Any, **__: Any) -> None:
        raise KVPoolTooSmallError("KV pool too small: request 1 cannot be scheduled even alone")

    monkeypatch.setattr("kvcanary.cli.run.Engine.generate", too_small)
    assert main(["run", *SMALL]) == 2
    assert "request 1 cannot be scheduled even alone" in _one_error_line(capsys)


def test_suggested_ratio_is_enough_and_page_size_is_named_when_it_binds() -> None:
    with pytest.raises(ValueError) as e:
        check_pools(num_full_tokens=320, num_swa_tokens=80, prompt_len=250, max_new_tokens=64,
                    chunked_prefill_size=512, page_size=4, window=32, max_total_tokens=320,
                    swa_full_tokens_ratio=0.25, prefix_cache=True)  # fmt: skip
    ratio = float(str(e.value).split("--swa-full-tokens-ratio to ")[1].split()[0])
    swa = Engine(EngineConfig(max_total_tokens=320, swa_full_tokens_ratio=ratio)).runner.allocator
    assert swa.size_swa >= 252  # what the message says is needed
    assert "--page-size" not in str(e.value).split(": raise")[1]
    # 64-token pages make a long decode hold its page, the window and a page of eviction
    # slack rounded out to pages (192 > 128); pages of 1 hold 34.
    with pytest.raises(ValueError, match=r"need 192: .* or lower --page-size$"):
        check_pools(num_full_tokens=1024, num_swa_tokens=128, prompt_len=40, max_new_tokens=200,
                    chunked_prefill_size=512, page_size=64, window=32, max_total_tokens=1024,
                    swa_full_tokens_ratio=0.125, prefix_cache=True)  # fmt: skip


def test_a_shorter_prompt_can_bind_the_swa_pool() -> None:
    # 16-token pages, 40 new tokens: a 16-token prompt needs 48 SWA tokens (the prefix cache
    # takes its page and keeps only the window locked), a 15-token one 64 (no whole page to
    # cache: its own window eviction keeps a page of slack).
    assert [pool_need(n, 40, 64, 16, 32, prefix_cache=True).num_swa_tokens for n in (15, 16)] == [64, 48]
    engine = Engine(EngineConfig(page_size=16, max_total_tokens=256, swa_full_tokens_ratio=48.5 / 256,
                                 chunked_prefill_size=64, graph_batch_sizes=()))  # fmt: skip
    check_engine_pools(engine, [16], 40)
    with pytest.raises(ValueError, match=r"a request of 15 prompt \+ 40 new tokens .* need 64"):
        check_engine_pools(engine, [16, 15, 16], 40)


# (model, prompt_len, new tokens, chunk, page): the lone request runs at the computed bound
# and the check refuses one page less (so the bound is neither loose nor strict).
BOUNDS = [
    ("builtin:tiny-mha", 100, 20, 512, 4),
    ("builtin:tiny-swa", 100, 20, 32, 4),
    ("builtin:tiny-swa", 100, 20, 512, 4),
    ("builtin:tiny-swa", 10, 100, 512, 4),
    ("builtin:tiny-swa", 120, 16, 64, 16),
]


@pytest.mark.parametrize("model,prompt_len,new,chunk,page", BOUNDS)
def test_pool_bounds_are_exact(model: str, prompt_len: int, new: int, chunk: int, page: int) -> None:
    window = None if model.endswith("mha") else 32
    need = pool_need(prompt_len, new, chunk, page, window, prefix_cache=True)

    def engine(full: int, swa: int) -> Engine:
        return Engine(EngineConfig(model=model, page_size=page, max_total_tokens=full,
                                   swa_full_tokens_ratio=swa / full if swa else 1.0,
                                   chunked_prefill_size=chunk, graph_batch_sizes=(),
                                   max_context_len=1024))  # fmt: skip

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    full = need.num_full_tokens if window is None else 2048
    swa = need.num_swa_tokens
    (out,) = engine(full, swa).generate([[1] * prompt_len], params)
    assert len(out.output_ids) == new
    tighter = engine(*((full - page, 0) if window is None else (full, swa - page)))
    with pytest.raises(RequestTooLargeError):  # admission applies the same bound
        tighter.add_request([1] * prompt_len, params)
    # Measured, not assumed: queued past admission, the request really cannot run.
    tighter.scheduler.waiting.append(Req(rid=1, prompt_ids=[1] * prompt_len, params=params))
    with pytest.raises(KVPoolTooSmallError):
        while tighter.has_unfinished():
            tighter.step()


def test_progress_bar_counts_tokens_and_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    positions: list[tuple[float, float]] = []

    class Recorder:
        def __init__(self, total: int, **_: Any) -> None:
            self.total, self.n = total, 0

        def update(self, k: float) -> None:
            self.n += k
            positions.append((self.n, self.total))

        def close(self) -> None:
            pass

    from kvcanary.cli import run

    monkeypatch.setattr(run, "tqdm", Recorder)
    spec = WorkloadSpec(num_requests=2, input_len=64, output_len=20, shared_prefix_len=0)
    run.run_workload(EngineConfig(model="builtin:tiny-mha", max_total_tokens=1024), spec)
    total = positions[0][1]
    assert positions[-1] == (total, total)
    moving = [n for n, _ in positions if 0 < n < total]
    assert len(moving) >= 15  # about one move per decode step, not one per finished request
    assert moving == sorted(moving)


def _subparsers(p: argparse.ArgumentParser, path: str = "kvcanary") -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((f"{path} {name}", sub))
                out += _subparsers(sub, f"{path} {name}")
    return out


def test_every_subcommand_has_a_description_and_every_flag_help() -> None:
    missing = []
    for name, sub in _subparsers(build_parser()):
        if not sub.description:
            missing.append(f"{name}: no description")
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            text = (action.help or "").replace("(default: %(default)s)", "").strip()
            if not text:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}: no help")
    assert missing == []


def test_selftest_fault_that_applies_to_no_chosen_model_is_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["selftest", "--faults", "swa_mapping", "--models", "builtin:tiny-mha",
                 "--no-progress"]) == 2  # fmt: skip
    line = _one_error_line(capsys)
    assert '--faults="swa_mapping"' in line and "builtin:tiny-mha" in line
    assert "builtin:tiny-swa" in line  # where it would apply


def test_selftest_fault_needing_a_full_group_on_dsv4_is_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["selftest", "--faults", "page_shift", "--models", "builtin:tiny-dsv4",
                 "--no-progress"]) == 2  # fmt: skip
    line = _one_error_line(capsys)
    assert '--faults="page_shift"' in line and "FULL group" in line


def test_messages_print_values_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--kv-canary-v-half", *SMALL]) == 2
    line = _one_error_line(capsys)
    assert "=true is invalid" in line and 'is "none"' in line
    assert "True" not in line and "'" not in line
