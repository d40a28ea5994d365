"""The canary under vLLM's default multiprocess engine (engine core and workers in their own
processes, as ``vllm serve`` runs), with one worker and with two tensor-parallel workers
(each holds a shard of the KV heads, and its own records, fingerprints and reports).

Each case runs mp_worker_script.py in a child process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``
there, whatever this process runs with): a clean workload, then one K byte flipped in the
KV cache tensor of one worker only, read once by a prefix hit. Checked: the clean phase
gives vLLM's outputs without the canary, verifies >= 10^5 slots on every rank and reports
nothing; the fault is reported once, by
the faulted rank only, named by rank (log line, its summary file, its Prometheus text)
when there are several workers; a single worker's files and line keep their format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mp_worker_script import FAULT_OFFSET
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.canary.explain import explain
from kvcanary.canary.wire.violation import VIOLATION_LINE_PREFIX, parse_violation_line
from kvcanary.integrations.vllm.options import rank_summary_path

SCRIPT = Path(__file__).with_name("mp_worker_script.py")
MIN_VERIFIED = 100_000


def _run_child(ckpt: Path, out: Path, tp: int, fault_rank: int) -> str:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # make test-vllm sets 0 for this process
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with functions
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:  # vLLM's auto binding wants a NUMA node per worker; this machine has one
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this checkout's modules
    log = out / "log.txt"
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), str(ckpt), str(out), "--tp", str(tp),
             "--fault-rank", str(fault_rank)],
            env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900, check=False,
        )  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _samples(path: Path) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(path.read_text())
            for s in family.samples]  # fmt: skip


@pytest.mark.parametrize(("tp", "fault_rank"), [(1, 0), (2, 1)], ids=["tp1", "tp2"])
def test_fault_on_one_rank_is_reported_once_by_that_rank(
    checkpoints: dict[str, Path], tmp_path: Path, tp: int, fault_rank: int
) -> None:
    log = _run_child(checkpoints["llama"], tmp_path, tp, fault_rank)
    result = json.loads((tmp_path / "result.json").read_text())
    fault = result["fault"]
    ranks = range(tp)

    assert result["outputs_identical"]  # vLLM's outputs with the canary as without
    # every worker knows its rank; the clean phase: silent, >= 10^5 verified slots per rank
    for phase in ("clean", "before_hit", "final"):
        assert [c["rank"] for c in result[phase]] == [c["worker_rank"] for c in result[phase]]
        assert [c["rank"] for c in result[phase]] == list(ranks)
        assert {c["world_size"] for c in result[phase]} == {tp}
    for c in result["clean"] + result["before_hit"]:
        assert c["violations"] == 0, c
        assert c["verify_entries"] >= MIN_VERIFIED, c
    print(f"tp={tp}: clean verified slots per rank "
          f"{[c['verify_entries'] for c in result['clean']]}")  # fmt: skip
    # one scheduler: every rank's block table held the same blocks for the request
    assert all(ids == result["block_ids"][0] for ids in result["block_ids"])
    assert fault["rank"] == fault_rank and fault["num_kv_heads"] == 2 // tp  # its shard
    slot = fault["slot"]
    assert slot == fault["block"] * 32 + FAULT_OFFSET

    # the hit read the flipped slot once: one row, on the faulted rank only
    final = {c["rank"]: c for c in result["final"]}
    assert [final[r]["violations"] for r in ranks] == [int(r == fault_rank) for r in ranks]

    # the log: one violation line, with the rank when there are several workers
    lines = [line for line in log.splitlines() if VIOLATION_LINE_PREFIX in line]
    assert len(lines) == 1, lines
    row = parse_violation_line(lines[0])
    assert row is not None and row.slot_idx == slot and row.position == 32 + FAULT_OFFSET
    if tp > 1:
        assert lines[0].endswith(f" rank={fault_rank}"), lines[0]
    else:
        assert "rank=" not in lines[0]
    analysis = explain(log)
    assert analysis["violations"] == 1 and not analysis["unparsed"]

    # the summaries: one file per rank (rank 0: the configured path), none clobbered
    summary = tmp_path / "kv-canary.json"
    paths = [Path(rank_summary_path(str(summary), r, tp)) for r in ranks]
    assert [c["summary_path"] for c in result["final"]] == [str(p) for p in paths]
    written = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("kv-canary"))
    assert written == sorted([p.name for p in paths] + [f"{p.name}.prom" for p in paths])
    for r, path in zip(ranks, paths, strict=True):
        data = json.loads(path.read_text())
        assert (data["rank"], data["world_size"]) == (r, tp)
        rows = data["violations"]
        if r != fault_rank:  # written every 50 steps (at shutdown too, if vLLM lets it)
            assert result["clean"][r]["verify_entries"] <= data["stats"]["verify_entries"]
            assert data["stats"]["verify_entries"] <= final[r]["verify_entries"]
            assert rows == [], rows
            continue
        # written in the step that reported it, the last one
        assert data["stats"]["verify_entries"] == final[r]["verify_entries"]
        assert len(rows) == 1, rows
        assert rows[0]["launch_tag"] == "TAIL_K_FULL"
        assert rows[0]["fail_reasons"] == ["verify_real_kv_hash"]
        assert rows[0]["slot_idx"] == slot

    # the Prometheus text: a rank label on every sample when there are several workers
    for r, path in zip(ranks, paths, strict=True):
        samples = _samples(Path(f"{path}.prom"))
        assert samples
        for _, labels, _ in samples:
            assert labels.get("rank") == (str(r) if tp > 1 else None), labels
        violations = [(labels["launch_tag"], labels["fail_reason"], v)
                      for name, labels, v in samples if name == "kvcanary_violations_total"]  # fmt: skip
        recorded = [v for name, _, v in samples if name == "kvcanary_violations_recorded_total"]
        if r == fault_rank:
            assert violations == [("TAIL_K_FULL", "verify_real_kv_hash", 1.0)]
            assert recorded == [1.0]
        else:
            assert violations == [] and recorded == [0.0]
