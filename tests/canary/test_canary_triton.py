"""The Triton canary kernels and plan builder (``kvcanary.canary.kernels.triton_kernels``,
``plan_triton``): bit for bit equal to the numba and torch ones under Triton's interpreter on
CPU tensors, and compilable for CUDA.

``TRITON_INTERPRET=1`` must be set before triton is first imported, so the cases
(``triton_interpreted_cases.py``) run in a fresh process with it set; that process also
lists every kernel variant it launched (argument types, constexprs), and each is compiled
ahead of time for sm_90 here (no GPU needed: Triton ships ptxas), which catches what only
the compiler rejects (loop-carried types, unsupported constructs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("triton_interpreted_cases.py")
REPO = Path(__file__).resolve().parents[2]

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for module, name, sig, consts in json.load(open(sys.argv[1])):
    fn = getattr(importlib.import_module(module), name)
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32))
    print("compiled", name, consts)
"""


def test_triton_kernels_interpreted_and_compiled(tmp_path: Path) -> None:
    launches = tmp_path / "launches.json"
    env = os.environ | {"TRITON_INTERPRET": "1", "KVCANARY_TEST_TRITON_LAUNCHES": str(launches)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(CASES)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(done.stdout[-6000:])  # the case counts
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"skipped|failed|error", summary)
    counts = [int(n) for n in re.findall(r"(\d+) random cases compared", done.stdout)]
    assert len(counts) == 6 and sum(counts) >= 180, counts
    print(f"{sum(counts)} random cases compared in all")

    variants = json.loads(launches.read_text())
    names = {v[1] for v in variants}
    assert names >= {
        "_verify_entries", "_verify_reader_chains", "_verify_offsets", "_verify_rows",
        "_write_requests", "_write_marks",
        "_write_chains", "_write_serial", "_write_rows_and_store", "_plan_rows",
        "_translate_tokens", "_plan_verify", "_plan_holes",
    }, names  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(launches)], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.count("compiled") == len(variants)
    print(f"{len(variants)} Triton kernel variants compiled for sm_90")
