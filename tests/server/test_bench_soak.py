"""``kvcanary bench soak`` end to end (the short version; the long one is the command):
misbehaving clients on loopback, every request ends as its kind expects, nothing leaks, the
canary stays silent, memory stays flat; and a leak injected into the engine fails it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcanary.bench.soak import KINDS, SoakConfig, bench_soak, soak_ok
from kvcanary.canary.config import CanaryConfig
from kvcanary.cli.command import main
from kvcanary.config import EngineConfig
from kvcanary.engine.scheduler import Scheduler

# A small SWA pool and short chunks: window eviction, chunked prefill and retraction happen.
CONFIG = dict(model="builtin:tiny-swa", page_size=4, max_total_tokens=1024, chunked_prefill_size=32,
              max_running_requests=6)  # fmt: skip


def test_soak_short_run_is_clean() -> None:
    cfg = SoakConfig(duration_s=20, concurrency=6, seed=3, request_timeout_s=60)
    s = bench_soak(EngineConfig(**CONFIG, canary=CanaryConfig(mode="log")), cfg, progress=False)
    assert soak_ok(s), {k: v for k, v in s.items() if k != "rss_curve_mib"}
    assert set(s["requests_by_kind"]) == set(KINDS)  # every kind was tried
    assert s["errors"] == 0 and s["answered"] > 0 and s["engine_loop_error"] == ""
    assert s["refused_as_expected"] == s["requests_by_kind"]["invalid"] + s["requests_by_kind"]["oversized"]
    assert 0 < s["server_aborts"] <= s["clients_left"]  # who left was aborted, if still running
    assert s["canary_protected_tokens"] > 0 and s["canary_violations"] == 0
    assert s["leaked_full_slots"] == s["leaked_swa_slots"] == s["leaked_req_rows"] == 0
    assert s["rss_start_mib"] > 0 and len(s["rss_curve_mib"]) >= 10


def test_soak_fails_on_a_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort that forgets to give its KV back (the bug the soak exists for)."""
    real = Scheduler.abort_request

    def leaky(self: Scheduler, rid: int):  # type: ignore[no-untyped-def]
        req = next((r for r in self.running if r.rid == rid), None)
        if req is None:
            return real(self, rid)
        self.running.remove(req)  # dropped without kv.release: its slots and row leak
        req.finish_reason = "abort"
        return req

    monkeypatch.setattr(Scheduler, "abort_request", leaky)
    cfg = SoakConfig(duration_s=8, concurrency=4, seed=5, request_timeout_s=60)
    # A KV pool that six leaked requests (<= 64 + 24 tokens, two copies) cannot fill, so the
    # req->token pool (max_running_requests rows) is what runs dry, however the machine's
    # load paces the aborts; with 1024 tokens the KV pool sometimes ran out first.
    s = bench_soak(EngineConfig(**{**CONFIG, "max_total_tokens": 4096}), cfg, progress=False)
    assert s["server_aborts"] > 0
    assert s["leaked_full_slots"] > 0 and s["leaked_req_rows"] > 0
    # The leaked rows run the req->token pool dry: the engine dies, and the soak says so.
    assert "req_to_token pool exhausted" in s["engine_loop_error"] and s["errors"] > 0
    assert not soak_ok(s)


def test_soak_cli_bad_flag_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "soak", "--model", "builtin:tiny-swa", "--duration", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvcanary bench soak: --duration=0.0 is invalid: allowed a number of seconds > 0"
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--model", "builtin:tiny-mha", "--page-size", "4", "--duration", "4",
               "--concurrency", "2", "--no-progress", "--json", str(out)])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "requests_by_kind" in table and "rss_curve_mib" not in table
    data = json.loads(out.read_text())
    assert data["errors"] == 0 and data["rss_curve_mib"]
