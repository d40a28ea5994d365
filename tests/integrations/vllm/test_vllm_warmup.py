"""Cold start on a real vLLM: the connector compiles (or loads from numba's cache) every
kernel the canary calls while the worker starts (``register_kv_caches``), so the first
``generate`` compiles nothing and loads nothing: no compile inside a forward. Each case
runs in a fresh interpreter, so no kernel an earlier test loaded can hide a miss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_harness as H


def first_generate_scenario(ckpt: str, options_json: str) -> None:
    from kvcanary.engine.warmup import loaded_kernels, watch_compiles

    options = json.loads(options_json)
    prompts = H.shared_prefix_prompts(3, 6, prefix_len=40, tail=(3, 60))
    with H.vllm_engine(Path(ckpt), canary=options, num_blocks=96) as llm:
        conn = H.connector(llm)
        assert conn.warmup is not None and conn.warmup.skipped is None, conn.warmup
        ready = loaded_kernels()
        assert any(".fused_rows." in name for name, _ in ready)
        with watch_compiles() as log:
            H.generate(llm, prompts, max_tokens=24)
        conn.worker.flush()
        stats, fast_steps = conn.worker.stats(), conn.worker.num_fast_steps
    assert stats["violations"] == 0 and stats["verify_entries"] > 0
    # vLLM's own attention metadata takes the one-call HEAD (its dtypes and layouts are
    # the ones steps.metadata_args reads): every decode step of the 24 tokens
    assert fast_steps >= 20, (fast_steps, stats["steps"])
    assert log.names() == []
    assert sorted(map(str, loaded_kernels() - ready)) == []


@pytest.mark.parametrize(("family", "options"), [
    ("llama", {"mode": "log"}),
    ("gemma3", {"mode": "raise", "real_data": "partial", "v_half": True}),
])  # fmt: skip
def test_first_generate_compiles_nothing(checkpoints: dict[str, Path], family: str,
                                         options: dict[str, object]) -> None:  # fmt: skip
    code = (f"import sys; sys.path[:0] = {sys.path!r}; import conftest, test_vllm_warmup as t; "
            f"t.first_generate_scenario({str(checkpoints[family])!r}, {json.dumps(options)!r})")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
