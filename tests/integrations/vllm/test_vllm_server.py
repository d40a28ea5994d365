"""vLLM's OpenAI-compatible server with the canary, as a user runs it (docs/VLLM.md
"Serving"): ``python -m vllm.entrypoints.openai.api_server --kv-transfer-config ...`` in a
subprocess on loopback, with vLLM's default multiprocess engine (API server, engine core
and worker in separate processes), driven by the ``openai`` SDK.

One server per module. The clean traffic test runs first (completions, chat, streaming,
concurrent requests over a shared prefix): zero violations, and the counters reach the
user through the summary file, its ``.prom`` file and vLLM's own ``/metrics``. The fault
test then flips a K byte in vLLM's KV cache tensor under a running request (vLLM's
``--worker-extension-cls`` + ``POST /collective_rpc``, vllm_server_hooks.py) and finds the
violation in the same three places and in the server's log. The last test stops the
server with SIGINT (``--shutdown-timeout``: vLLM's engine core and worker exit through their
shutdown, where the connector writes its final summary); no process of its group may
outlive the module, whatever fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import vllm_harness as H
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.canary.explain import explain

MODEL = "tiny-llama"
OPTIONS = {"mode": "log", "real_data": "partial", "stats_interval": 4}
START_TIMEOUT_S = 600  # engine start-up plus the canary's first kernel compile (cold cache)
HERE = Path(__file__).resolve().parent
# vLLM's sampling extensions: every answer runs to max_tokens, and BOS / EOS, should the
# random model pick them, stay in the text (one word per token: the counts below)
EXTRA = {"ignore_eos": True, "skip_special_tokens": False}


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    summary: Path
    log: Path

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120, max_retries=0)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return _samples(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def read_summary(self) -> dict[str, Any]:
        return json.loads(self.summary.read_text())

    def prom(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return _samples(Path(f"{self.summary}.prom").read_text())

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition -> {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def _total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
           **labels: str) -> float:  # fmt: skip
    return sum(v for (n, ls), v in samples.items()
               if n == name and all((k, want) in ls for k, want in labels.items()))  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (vLLM's graceful shutdown), then SIGKILL to the server's whole process group
    (API server, engine core, worker) if anything is left, and an error."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # any process of the server's group still alive?
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    raise AssertionError("vLLM server processes outlived SIGINT + 150 s; killed")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("vllm_server")
    ckpt = H.make_checkpoint(root, "llama")
    H.add_tokenizer(ckpt)
    summary, log = root / "kv-canary.json", root / "server.log"
    config = H.canary_transfer_config(summary_path=str(summary), **OPTIONS)
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--seed", "0",
           "--block-size", str(H.BLOCK_SIZE), "--max-num-seqs", "8", "--shutdown-timeout", "30",
           "--worker-extension-cls", "vllm_server_hooks.CanaryFaultHooks",
           "--kv-transfer-config", json.dumps(config)]  # fmt: skip
    path = [str(HERE), str(HERE.parents[1] / "model"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # vLLM's default (make test-vllm: 0)
           "VLLM_SERVER_DEV_MODE": "1",  # POST /collective_rpc (the fault test)
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "PYTHONPATH": os.pathsep.join(p for p in path if p)}  # fmt: skip
    # vLLM's default: /metrics reads the API server's own registry
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    srv = Server(proc, f"http://127.0.0.1:{port}", summary, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vLLM server exited ({proc.returncode}):\n{srv.log_tail()}")
            try:
                if httpx.get(f"{srv.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"no /health in {START_TIMEOUT_S} s:\n{srv.log_tail()}")
            time.sleep(1)
        yield srv
    finally:
        _stop(proc)


def _prefix(n: int) -> str:
    return " ".join(f"t{1 + (7 * i) % 300}" for i in range(n))


def test_clean_traffic(server: Server) -> None:
    client = server.client()
    prefix = _prefix(80)  # two and a half blocks: later requests hit the first two cached
    extra = EXTRA

    out = client.completions.create(model=MODEL, prompt=f"{prefix} t5 t6", max_tokens=12,
                                    temperature=0, extra_body=extra)  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == 82 and len(choice.text.split()) == 12, choice.text

    chat = client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0, extra_body=extra,
        messages=[{"role": "system", "content": prefix}, {"role": "user", "content": "t9 t10"}],
    )  # fmt: skip
    msg = chat.choices[0].message
    assert msg.role == "assistant" and len((msg.content or "").split()) == 10, msg
    assert chat.usage.completion_tokens == 10

    chunks = list(client.completions.create(model=MODEL, prompt=f"{prefix} t7", max_tokens=16,
                                            temperature=0, stream=True, extra_body=extra))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text.split()) == 16 and chunks[-1].choices[0].finish_reason == "length", text

    def one(i: int) -> Any:
        return server.client().completions.create(
            model=MODEL, prompt=f"{prefix} t{20 + i} t{40 + i}", max_tokens=8 + i,
            temperature=0.8, seed=i, extra_body=extra,
        )  # fmt: skip

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(one, range(6)))
    for i, o in enumerate(outs):
        assert o.usage.completion_tokens == 8 + i and len(o.choices[0].text.split()) == 8 + i

    metrics = server.metrics()
    assert _total(metrics, "vllm:prefix_cache_hits_total", model_name=MODEL) >= 7 * 64
    # The canary's counters on vLLM's /metrics (KVCanaryConnector.get_kv_connector_stats ->
    # KVCanaryPromMetrics, in the API server process); reports follow steps by <= 1 s.
    deadline = time.monotonic() + 10
    while _total(metrics, "vllm:kvcanary_steps_total") < 4 and time.monotonic() < deadline:
        time.sleep(1)
        metrics = server.metrics()
    assert _total(metrics, "vllm:kvcanary_steps_total", model_name=MODEL, engine="0") >= 4
    assert _total(metrics, "vllm:kvcanary_protected_tokens_total") > 8 * 82
    assert _total(metrics, "vllm:kvcanary_verify_entries_total", launch_tag="TAIL_K_FULL") > 0
    assert _total(metrics, "vllm:kvcanary_violations_recorded_total") == 0
    assert _total(metrics, "vllm:kvcanary_violations_total") == 0

    s = server.read_summary()  # rewritten every stats_interval (4) steps
    assert s["installed"] and s["stats"]["steps"] >= 4 and s["stats"]["verify_entries"] > 0
    assert s["stats"]["violations"] == 0 and s["violations"] == [], s["violations"][:3]
    prom = server.prom()
    assert _total(prom, "kvcanary_protected_tokens_total") == s["stats"]["protected_tokens"] > 0
    assert _total(prom, "kvcanary_violations_recorded_total") == 0
    assert "kv_canary violation" not in server.log.read_text(errors="replace")


def test_kv_fault_reaches_the_user(server: Server) -> None:
    """A K byte flipped under a running request: reported in the next step, in log mode
    the request still completes, and the violation shows in every documented place."""
    client = server.client()
    max_tokens = 400
    for _ in range(5):  # the server may finish the request before the call reaches it
        stream = client.completions.create(model=MODEL, prompt=_prefix(40),
                                           max_tokens=max_tokens, temperature=0, stream=True,
                                           extra_body=EXTRA)  # fmt: skip
        it = iter(stream)
        received = [next(it) for _ in range(3)]
        r = httpx.post(f"{server.url}/collective_rpc", timeout=60,
                       json={"method": "kvcanary_flip_k_byte", "args": ["5"]})  # fmt: skip
        assert r.status_code == 200, r.text
        (flipped,) = r.json()["results"]  # one worker
        received += list(it)
        if flipped:
            break
    assert len(flipped) == 1, flipped  # the streaming request alone
    slot = flipped[0]["slot"]
    text = "".join(c.choices[0].text for c in received if c.choices)
    assert len(text.split()) == max_tokens  # log mode: the request is served to the end

    deadline = time.monotonic() + 10
    while not server.read_summary()["violations"] and time.monotonic() < deadline:
        time.sleep(0.5)
    rows = server.read_summary()["violations"]
    assert rows and {r["slot_idx"] for r in rows} == {slot}, rows[:3]
    assert all(r["launch_tag"] == "TAIL_K_FULL" and "verify_real_kv_hash" in r["fail_reasons"]
               for r in rows), rows[:3]  # fmt: skip
    prom = server.prom()
    assert _total(prom, "kvcanary_violations_total", launch_tag="TAIL_K_FULL",
                  fail_reason="verify_real_kv_hash") >= len(rows)  # fmt: skip
    metrics = server.metrics()
    assert _total(metrics, "vllm:kvcanary_violations_total", model_name=MODEL,
                  launch_tag="TAIL_K_FULL", fail_reason="verify_real_kv_hash") >= len(rows)  # fmt: skip
    assert _total(metrics, "vllm:kvcanary_violations_recorded_total") >= len(rows)

    log = server.log.read_text(errors="replace")
    analysis = explain(log)
    assert analysis["violations"] >= len(rows) and f"slot_idx={slot} " in log
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_sigint_stops_every_process_and_writes_the_final_summary(server: Server) -> None:
    """Runs last: stops the module's server."""
    steps = _total(server.metrics(), "vllm:kvcanary_steps_total")
    # Both files removed while the server is idle (no step, so no periodic write): they
    # exist again only if the shutdown wrote them. (Comparing their mtime with the time
    # before the signal flaked: the kernel stamps files with a coarse clock, up to a tick
    # behind time.time().)
    prom = Path(f"{server.summary}.prom")
    server.summary.unlink()
    prom.unlink()
    _stop(server.proc)  # raises if a process of the server's group survives
    assert server.proc.returncode == 0, server.log_tail()
    assert server.summary.exists() and prom.exists()
    s = server.read_summary()
    assert s["stats"]["steps"] >= steps > 0 and s["violations"]
    assert not Path(f"{server.summary}.tmp").exists()
