"""Compile ahead (kvcanary.engine.warmup): after warm_engine(config) a real workload on that
configuration compiles no kernel; the compile watcher sees compiles; both size variants of a
split kernel are compiled while warming; workload defaults adapt to --input-len."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numba
import numpy as np
import pytest

from kvcanary import EngineConfig
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.wire import hashing
from kvcanary.cli.command import main
from kvcanary.cli.run import run_workload
from kvcanary.engine import warmup
from kvcanary.engine.warmup import (
    CompileLog,
    _Helper,
    loaded_kernels,
    print_compiles,
    share_lock_name,
    sharing_compiles,
    warm_engine,
    warmup_config,
    watch_compiles,
)
from kvcanary.jit import parallel as numba_parallel
from kvcanary.jit.calls import Callee
from kvcanary.workload import WorkloadSpec

# The demo's configuration (Makefile `demo`): window eviction, SWA tombstones, retraction.
DEMO = EngineConfig(model="builtin:tiny-swa", page_size=4, swa_full_tokens_ratio=0.125,
                    canary=CanaryConfig(mode="log", real_data="partial"))  # fmt: skip


def _kernel(name: str):  # type: ignore[no-untyped-def]
    """A fresh kernel that numba sees as kvcanary's own (module ``kvcanary.<name>``)."""

    def add_one(x):  # type: ignore[no-untyped-def]
        return x + 1

    add_one.__module__ = f"kvcanary.{name}"
    return numba.njit(add_one)


def test_watch_compiles_records_a_kvcanary_kernel_and_not_a_foreign_one() -> None:
    ours, foreign = _kernel("warmup_probe"), numba.njit(lambda x: x + 2)
    with watch_compiles() as log:
        assert ours(1) == 2 and foreign(1) == 3
        assert ours(5) == 6  # compiled once per signature
    (name,) = log.names()
    assert name.startswith("warmup_probe.") and name.endswith(".add_one")
    assert log.compile_s > 0


def test_print_compiles_reports_a_kernel_to_the_helper_protocol(capsys) -> None:  # type: ignore[no-untyped-def]
    ours = _kernel("warmup_printed")
    with print_compiles():
        assert ours(2) == 3
    assert capsys.readouterr().out.split() == ["start", _name(ours),
                                               "done", _name(ours)]  # fmt: skip


def _name(kernel) -> str:  # type: ignore[no-untyped-def]
    return f"{kernel.py_func.__module__[len('kvcanary.'):]}.{kernel.py_func.__qualname__}"


NO_CANARY = dataclasses.replace(DEMO, canary=CanaryConfig())


def test_helper_process_warms_a_configuration_into_the_shared_cache(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The helper (``python -m kvcanary.engine.warmup``, config pickled on stdin) runs a warm-up to
    the end, and a new process then finds every kernel of it in the on-disk cache."""
    log = CompileLog()
    helper = _Helper(NO_CANARY, str(tmp_path), log)
    assert helper.proc.wait(timeout=600) == 0
    helper.stop()
    in_fresh_process("test_warmup", "no_canary_loads_only_scenario")


def no_canary_loads_only_scenario() -> None:
    with watch_compiles() as log:
        report = warm_engine(NO_CANARY, progress=False, helper=False)
    assert report.skipped is None and log.names() == []
    assert any("rmsnorm" in name for name, _ in loaded_kernels())  # loaded, not compiled


def _cached_kernel():  # type: ignore[no-untyped-def]
    """A new dispatcher (no signature held) of a real cached kvcanary kernel: what it
    compiles, its cache can load again in any later run."""
    return numba.njit(cache=True)(hashing.chain_hash_nb.py_func)


I64 = (numba.int64,) * 3


def _call_sharing(kernel, lock_dir: str, done: list[float]) -> threading.Thread:  # type: ignore[no-untyped-def]
    def call() -> None:
        with sharing_compiles(lock_dir):
            assert kernel(1, 2, 3) == hashing.chain_hash_nb(1, 2, 3)
        done.append(time.monotonic())

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_sharing_compiles_waits_while_another_process_compiles_the_kernel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A compile of a kernel and signature whose lock the other side holds waits until it is
    released, then loads (or compiles) it. (Threads stand in for the two processes: numba's
    compiler lock is per process, so only the waiting is tested here.)"""
    kernel = _cached_kernel()
    lock = tmp_path / share_lock_name(kernel.py_func, I64)
    with open(lock, "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the other process, compiling it for int64s
        done: list[float] = []
        thread = _call_sharing(kernel, str(tmp_path), done)
        time.sleep(0.5)
        assert thread.is_alive() and not kernel.signatures  # waiting, not compiling
        released = time.monotonic()
        fcntl.flock(held, fcntl.LOCK_UN)
    thread.join(timeout=60)
    assert done and done[0] >= released
    assert kernel.signatures == [I64]


def test_sharing_compiles_gives_up_waiting_after_the_timeout(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(warmup, "_SHARE_WAIT_S", 0.2)
    kernel = _cached_kernel()
    with open(tmp_path / share_lock_name(kernel.py_func, I64), "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # never released while the call runs
        done: list[float] = []
        _call_sharing(kernel, str(tmp_path), done).join(timeout=60)
        assert done and kernel.signatures == [I64]


def _driver_kernel(name: str):  # type: ignore[no-untyped-def]
    """A fresh kvcanary-named kernel with a parallel variant's arguments: the serial
    kernel's address, then its arguments."""

    def drive(fn, x):  # type: ignore[no-untyped-def]
        return x + 1

    drive.__module__ = f"kvcanary.{name}"
    return numba.njit(drive)


def test_compiling_both_compiles_the_variant_not_taken() -> None:
    serial, parallel = _kernel("warmup_serial"), _driver_kernel("warmup_parallel")
    x = np.int64(3)
    numba_parallel.run(Callee(serial, numba.int64, numba.int64), parallel, False, x)
    assert len(serial.signatures) == 1 and len(parallel.signatures) == 0
    with numba_parallel.compiling_both():
        numba_parallel.run(Callee(serial, numba.int64, numba.int64), parallel, False, x)
    threaded = numba_parallel.parallel_threads() > 1
    assert len(parallel.signatures) == (1 if threaded else 0)  # never used on one thread


def in_fresh_process(module: str, scenario: str) -> None:
    """Run ``module.scenario()`` in a new interpreter: no kernel loaded by an earlier test
    of this worker can hide one a warm-up missed."""
    code = f"import {module}; {module}.{scenario}()"
    here = str(Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{here!r}]; {code}"],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


def after_warmup_scenario() -> None:
    report = warm_engine(DEMO, progress=False)
    assert report.skipped is None
    warm = loaded_kernels()
    assert any("fused_rows" in name for name, _ in warm)  # the canary's HEAD / TAIL
    assert any("ops.cpu.decode" in name for name, _ in warm)  # the compiled decode forward
    # Longer prompts, more requests, a larger decode batch than the warm-up's.
    spec = WorkloadSpec(num_requests=24, input_len=200, output_len=24, shared_prefix_len=64)
    with watch_compiles() as log:
        summary, _ = run_workload(DEMO, spec, progress=False)
    assert summary["canary_violations"] == 0 and summary["canary_protected_tokens"] > 0
    assert log.names() == []
    assert sorted(map(str, loaded_kernels() - warm)) == []


def test_after_warmup_a_workload_needs_no_new_kernel() -> None:
    in_fresh_process("test_warmup", "after_warmup_scenario")


def test_warmup_config_keeps_what_selects_kernels_and_shrinks_the_rest() -> None:
    warm, prompt_len, new_tokens = warmup_config(DEMO)
    for name in ("model", "page_size", "swa_full_tokens_ratio", "dtype", "device",
                 "enable_prefix_cache", "graph_batch_sizes"):  # fmt: skip
        assert getattr(warm, name) == getattr(DEMO, name)
    assert warm.canary.mode == "log" and warm.canary.real_data == "partial"
    assert warm.max_total_tokens < DEMO.max_total_tokens
    assert prompt_len > 32 + 2 * DEMO.page_size  # past tiny-swa's 32-token window
    assert warm.chunked_prefill_size == 256  # real-sized chunks (the demo's are 512)
    assert prompt_len > warm.chunked_prefill_size  # prefilled in two chunks
    assert new_tokens > DEMO.page_size


def test_warmup_command_writes_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "warm.json"
    assert main(["warmup", "--model", "builtin:tiny-swa", "--kv-canary", "log", "--json",
                 str(out), "--no-progress"]) == 0  # fmt: skip
    body = json.loads(out.read_text())
    assert body["skipped"] is None and body["model"] == "builtin:tiny-swa"
    assert body["kernels_compiled"] == len(body["compiled"])


@pytest.mark.parametrize(("input_len", "given", "expected"), [
    (64, None, 32), (256, None, 128), (1000, None, 128), (1, None, 0), (64, 10, 10)])  # fmt: skip
def test_shared_prefix_default_adapts_to_input_len(input_len: int, given: int | None,
                                                   expected: int) -> None:  # fmt: skip
    spec = WorkloadSpec.from_flags(4, input_len, 8, given, 0)
    assert spec.shared_prefix_len == expected


def test_explicit_shared_prefix_too_long_is_still_an_error() -> None:
    with pytest.raises(ValueError, match="--shared-prefix-len=128 is invalid"):
        WorkloadSpec.from_flags(4, 64, 8, 128, 0)
