#!/usr/bin/env bash
# One-shot CUDA check of kvcanary on a GPU machine (H100/H200), run from the repository root:
#     bash tools/gpu/check.sh            ($OUT: folder for the results; <= 8 files)
# Total wall time is capped by KVC_BUDGET_S (default 420 s); each step has its own timeout
# (min(step max, budget left)); a step that fails or times out does not stop the others.
# Local dry run on the CPU (Triton under the interpreter):
#     KVC_DEVICE=cpu PY=.venv/bin/python OUT=/tmp/out bash tools/gpu/check.sh
# Results in $OUT: log.txt, steps.json (rc / seconds / highlights of every step),
# engine_cuda.json, triton_cuda.json, runs.json, overhead_graphs.json, overhead_eager.json,
# selftest.json.
# Switches (1 = on): KVC_ONLY_ENGINE (stop after the engine check), KVC_SKIP_TRITON,
# KVC_SKIP_RUN2 (no second `kvcanary run`), KVC_06B (bench overhead on the 0.6B preset too,
# overhead_06b.json), KVC_SKIP_ST2 (no graph-safe selftest), KVC_PYTEST=0 (no CPU suite).
# On an H200 (2026-11-26; docs/ARCHITECTURE.md, "On a GPU") it ran in ~90 s with
# KVC_PYTEST=0 KVC_SKIP_TRITON=1 KVC_SKIP_RUN2=1 KVC_SKIP_ST2=1 KVC_06B=1.

PY=${PY:-python3}
DEV=${KVC_DEVICE:-cuda}
BUDGET=${KVC_BUDGET_S:-420}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvc_gpu_out.XXXXXX")}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/log.txt
: >"$LOG"
START=$(date +%s)
H=$(mktemp -d "${TMPDIR:-/tmp}/kvc_gpu.XXXXXX")
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export KVC_DEVICE=$DEV
unset TRITON_INTERPRET
: >"$H/steps.tsv"

# step NAME MAX_S CMD...: run CMD under timeout, output appended to the log
step() {
    local name=$1 max=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    local t=$((max < left - 5 ? max : left - 5))
    if ((t < 15)); then
        echo "=== [$name] SKIPPED: ${left}s of the budget left" | tee -a "$LOG"
        printf '%s\tskipped\t0\n' "$name" >>"$H/steps.tsv"
        return
    fi
    echo "=== [$name] $(date +%T) (+$(($(date +%s) - START))s) timeout ${t}s: $*" | tee -a "$LOG"
    local s=$(date +%s)
    timeout -k 5 "$t" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local d=$(($(date +%s) - s))
    echo "=== [$name] rc=$rc in ${d}s$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo ' (TIMED OUT)')" | tee -a "$LOG"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$d" >>"$H/steps.tsv"
}

# ------------------------------------------------------------------ helper files
cat >"$H/kvc_cuda_shim.py" <<'PYEOF'
"""pytest plugin (-p kvc_cuda_shim): run tests/canary/triton_interpreted_cases.py with the
Triton side on $KVC_SHIM_DEVICE (default cuda) through compiled kernels. The cases build CPU
tensors; kernels_triton.verify/write and plan_triton.build_plans_triton are wrapped to copy
their arguments to the device, launch, and copy every mutated tensor back (records, ring,
counters; plans come back to the CPU), so numba / torch (CPU) and Triton (device) results
are compared exactly as under the interpreter. Summary JSON: $KVC_SHIM_JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
import triton.runtime.jit as _jit

if not hasattr(_jit, "mangle_type"):  # imported by the cases module (launch recording only)
    _jit.mangle_type = lambda arg, specialize=False: "i64"

from kvcanary.canary.kernels import triton_kernels as KT  # noqa: E402
from kvcanary.canary.plan import triton_plan as PT  # noqa: E402
from kvcanary.canary.report.ring import RunCounters, ViolationRing  # noqa: E402

DEV = torch.device(os.environ.get("KVC_SHIM_DEVICE", "cuda"))
INTERPRETED = KT.is_interpreted()
T0 = time.time()
SUMMARY: dict = {
    "device": str(DEV),
    "device_name": torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu",
    "torch": torch.__version__,
    "triton": __import__("triton").__version__,
    "triton_interpreted": INTERPRETED,
    "launches_on_device": {"verify": 0, "write": 0, "build_plans": 0, "raised": 0},
    "cases_compared": {},
    "tests": {},
}


def _to(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # NamedTuple (CanaryPlans)
        return type(x)(*[_to(e, dev) for e in x])
    if isinstance(x, (list, tuple)):
        return type(x)(_to(e, dev) for e in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {f.name: _to(getattr(x, f.name), dev) for f in dataclasses.fields(x)
                   if isinstance(getattr(x, f.name), torch.Tensor)}
        return dataclasses.replace(x, **changes)
    return x


def _ring_to(ring: ViolationRing) -> ViolationRing:
    r = ViolationRing(ring.capacity, device=DEV)
    r._storage.copy_(ring._storage)
    r.write_index.copy_(ring.write_index)
    return r


def _ring_back(r: ViolationRing, ring: ViolationRing) -> None:
    ring._storage.copy_(r._storage.cpu())
    ring.write_index.copy_(r.write_index.cpu())


def _counters_to(c: RunCounters | None) -> RunCounters | None:
    if c is None:
        return None
    d = RunCounters(device=DEV)
    d.kernel_runs.copy_(c.kernel_runs)
    d.slots_processed.copy_(c.slots_processed)
    return d


def _counters_back(d: RunCounters | None, c: RunCounters | None) -> None:
    if c is not None and d is not None:
        c.kernel_runs.copy_(d.kernel_runs.cpu())  # in place: the numpy views stay valid
        c.slots_processed.copy_(d.slots_processed.cpu())


def _wrap_kernel(name: str):
    orig = getattr(KT, name)

    def launch(records, plan, ring, launch_tag, *, real_kv_sources=(), counters=None, **kw):
        if INTERPRETED and DEV.type == "cpu":
            dev_records = records.clone()
        else:
            dev_records = records.to(DEV)
        dev_ring, dev_counters = _ring_to(ring), _counters_to(counters)
        sources = [_to(s, DEV) for s in real_kv_sources]
        SUMMARY["launches_on_device"][name] += 1
        try:
            orig(dev_records, _to(plan, DEV), dev_ring, launch_tag, real_kv_sources=sources,
                 counters=dev_counters, **kw)
        except Exception:
            SUMMARY["launches_on_device"]["raised"] += 1
            raise
        finally:  # also after a raise: the tests check nothing changed
            records.copy_(dev_records.cpu())
            _ring_back(dev_ring, ring)
            _counters_back(dev_counters, counters)

    launch.__wrapped__ = orig
    return launch


_orig_build = PT.build_plans_triton


def build_plans_triton(inputs, verify_capacity, window, lut, offset, check_residency=True):
    SUMMARY["launches_on_device"]["build_plans"] += 1
    plans = _orig_build(_to(inputs, DEV), verify_capacity, window,
                        None if lut is None else lut.to(DEV), offset, check_residency)
    return _to(plans, torch.device("cpu"))


class _States(dict):
    """test_out_of_range_raises_before_any_change reads _states[cpu]: give it the device's."""

    def __getitem__(self, key):
        if key == torch.device("cpu") and DEV.type != "cpu":
            key = next(k for k in self if k.type == DEV.type)
        return dict.__getitem__(self, key)


KT.verify = _wrap_kernel("verify")
KT.write = _wrap_kernel("write")
PT.build_plans_triton = build_plans_triton
KT._states = _States(KT._states)
if not INTERPRETED:  # the cases module refuses to import otherwise
    KT.is_interpreted = lambda: True
    PT.is_interpreted = lambda: True


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        mod = getattr(item, "module", None)
        if mod is not None and hasattr(mod, "_counted") and not hasattr(mod._counted, "_shim"):
            orig = mod._counted

            def counted(name, num_cases, _orig=orig):
                SUMMARY["cases_compared"][name] = num_cases
                _orig(name, num_cases)

            counted._shim = True
            mod._counted = counted


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        entry = {"outcome": report.outcome, "s": round(report.duration, 2)}
        if report.outcome == "failed":
            entry["error"] = str(report.longrepr)[-1500:]
        SUMMARY["tests"][report.nodeid.split("::")[-1] + ("" if report.when == "call"
                                                           else f"[{report.when}]")] = entry
        _save()


def _save():
    path = os.environ.get("KVC_SHIM_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(SUMMARY, f, indent=1)


def pytest_sessionfinish(session, exitstatus):
    SUMMARY["exitstatus"] = int(exitstatus)
    SUMMARY["wall_s"] = round(time.time() - T0, 1)
    outcomes = [t["outcome"] for t in SUMMARY["tests"].values()]
    SUMMARY["passed"], SUMMARY["failed"] = outcomes.count("passed"), outcomes.count("failed")
    SUMMARY["total_cases_identical"] = sum(
        n for k, n in SUMMARY["cases_compared"].items())
    _save()
    print("kvc_cuda_shim summary:", json.dumps({k: v for k, v in SUMMARY.items()
                                                 if k != "tests"}), file=sys.stderr)
PYEOF
cat >"$H/test_kvc_cuda_extra.py" <<'PYEOF'
"""More random worlds than triton_interpreted_cases.py (also multi-block sizes), Triton on
the device vs numba on the CPU, counting identical / different cases instead of stopping at
the first difference."""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "tests", "canary"))
import kvc_cuda_shim as S  # noqa: E402
from canary_testlib import IMPLS  # noqa: E402
from test_canary_kernels_equivalence import (  # noqa: E402
    make_verify_plan, make_world, make_write_plan, run,
)

from kvcanary.canary.kernels import triton_kernels as kernels_triton  # noqa: E402


def test_random_worlds_counted(monkeypatch):
    monkeypatch.setitem(IMPLS, "triton", kernels_triton)
    n = int(os.environ.get("KVC_EXTRA_CASES", "200"))
    same, diff, errors, bad = 0, 0, 0, []
    for seed in range(10_000, 10_000 + n):
        rng = random.Random(seed)
        num_slots = rng.randint(2, 40) if seed % 4 else rng.randint(300, 1200)
        w = make_world(rng, num_slots, rng.randint(0, 4))
        vplan, wplan = make_verify_plan(rng, w), make_write_plan(rng, w)
        args = (w, vplan, wplan, rng.choice([1, 3, 64, 256, 4096]), rng.randint(0, 3),
                rng.random() < 0.5, rng.random() < 0.5)
        want = run("numba", *args)
        try:
            got = run("triton", *args)
        except Exception as e:  # noqa: BLE001
            errors += 1
            bad.append([seed, repr(e)[:200]])
            continue
        if got == want:
            same += 1
        else:
            diff += 1
            bad.append([seed, num_slots])
    S.SUMMARY["extra_random_worlds"] = {"identical": same, "different": diff, "errors": errors,
                                        "first_bad": bad[:10]}
    print(f"extra random worlds: {same} identical, {diff} different, {errors} errors")
    assert diff == 0 and errors == 0, bad[:10]
PYEOF
cat >"$H/engine_check.py" <<'PYEOF'
"""Engine on $KVC_DEVICE (default cuda): CUDA-graph capture with / without the canary, greedy
outputs of each config against the eager no-canary baseline, canary counters, and a
req->token fault injected after capture (detected by the HEAD verify recorded in the graph?).
Usage: engine_check.py OUT.json"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
import traceback

import torch

from kvcanary import Engine
from kvcanary.config import CanaryConfig, EngineConfig, SamplingParams

DEV = os.environ.get("KVC_DEVICE", "cuda")
OUT = sys.argv[1]
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
captured_warnings: list[str] = []


class _Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if (record.levelno >= logging.WARNING and len(captured_warnings) < 40
                and "kv_canary violation" not in record.getMessage()):
            captured_warnings.append(f"{record.name}: {record.getMessage()[:300]}")


logging.getLogger().addHandler(_Keep())


def prompts(seed: int = 0, n: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(16)]
    return [shared + [rng.randrange(256) for _ in range(rng.randint(4, 64))] for _ in range(n)]


def config(canary: CanaryConfig | None, graphs: bool) -> EngineConfig:
    return EngineConfig(
        model="builtin:tiny-swa", page_size=4, max_total_tokens=4096, swa_full_tokens_ratio=0.25,
        chunked_prefill_size=64, seed=0, device=DEV,
        graph_batch_sizes=EngineConfig.graph_batch_sizes if graphs else (),
        canary=canary or CanaryConfig(),
    )  # fmt: skip


def canary(**kw) -> CanaryConfig:
    base = dict(mode="log", stats_interval=8, health_check_interval=8, swa_divergence_interval=8)
    return CanaryConfig(**(base | kw))


def graph_info(engine: Engine) -> dict:
    gr = engine.scheduler.graph_runner
    if gr is None:
        return {"graph_runner": False}
    hooks = engine.runner.canary
    return {
        "graph_runner": True,
        "cuda_graphs_captured": len(getattr(gr, "graphs", {})),
        "capture_failed": bool(getattr(gr, "capture_failed", False)),
        "uses_cuda_graphs": bool(gr._uses_cuda_graphs()),
        "canary_graph_capturable": None if hooks is None else bool(hooks.graph_capturable),
        "replays": gr.num_replays,
    }


def canary_info(engine: Engine) -> dict | None:
    if engine.canary is None:
        return None
    st = engine.canary.stats()
    keep = ("protected_tokens", "verify_entries", "write_entries", "violations",
            "violations_reported", "violations_by_reason", "violations_by_tag",
            "verify_overflow_steps", "steps", "launch_tags_active", "swa_divergence")
    return {k: st[k] for k in keep if k in st}


CONFIGS = {
    "none_eager": (None, False),
    "none_graphs": (None, True),
    "log_graphsafe_graphs": (canary(graph_safe=True), True),
    "log_graphsafe_eager": (canary(graph_safe=True), False),
    "log_graphs(not graph-safe: eager replay)": (canary(), True),
    "log_partial_graphsafe_graphs(store check: eager replay)":
        (canary(graph_safe=True, real_data="partial"), True),
    "raise_graphsafe_v_half_tokens_graphs": (
        canary(mode="raise", graph_safe=True, v_half=True, verify_tokens=True), True),
}


def run_config(name: str, cfg: EngineConfig, ps: list[list[int]]) -> tuple[dict, list]:
    t0 = time.time()
    engine = Engine(cfg)
    t1 = time.time()
    outs = engine.generate(ps, SamplingParams(max_new_tokens=40, temperature=0.0))
    if DEV == "cuda":
        torch.cuda.synchronize()
    t2 = time.time()
    res = {"build_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2),
           "decode_forwards": engine.stats.num_decode_forwards,
           "graph_replays_stat": engine.stats.graph_replays,
           **graph_info(engine), "canary": canary_info(engine)}
    return res, [o.output_ids for o in outs]


def fault_in_graph() -> dict:
    """Capture decode graphs with the graph-safe canary, then point a running request's
    committed req->token entry at another of its slots (host write, between replays): the
    HEAD verify inside the next replays must report it (verify_chain_hash / position)."""
    logging.getLogger("kvcanary.canary").setLevel(logging.ERROR)  # the expected reports
    engine = Engine(config(canary(graph_safe=True, health_check_interval=0), True))
    for p in prompts(seed=7, n=6):
        engine.add_request(p, SamplingParams(max_new_tokens=60, temperature=0.0))
    steps = 0
    gr = engine.scheduler.graph_runner
    while steps < 200 and engine.has_unfinished():
        engine.step()
        steps += 1
        running = [r for r in engine.running_requests() if r.kv_len >= 24]
        if (len(running) == len(engine.running_requests()) >= 2 and gr is not None
                and gr.num_replays >= 3):
            break
    before = graph_info(engine)
    engine.canary.flush()
    violations_before = len(engine.canary.violations)
    r2t = engine.canary.runtime.req_to_token_pool.req_to_token
    victim = engine.running_requests()[0]
    row, pos, donor_pos = victim.req_pool_idx, 20, 10  # pos inside the SWA window too
    original, donor = int(r2t[row, pos]), int(r2t[row, donor_pos])
    r2t[row, pos] = donor
    for _ in range(4):
        if engine.has_unfinished():
            engine.step()
    engine.canary.flush()
    rows = engine.canary.violations[violations_before:]
    r2t[row, pos] = original
    return {
        "steps_before_injection": steps, "graph_state_at_injection": before,
        "injected": {"req_pool_idx": row, "position": pos, "original_slot": original,
                     "new_slot": donor},
        "violations_before": violations_before,
        "violations_after_injection": len(rows),
        "detected": bool(rows),
        "first_rows": [[r.launch_tag, list(r.fail_reasons), r.slot_idx, r.position]
                       for r in rows[:6]],
        "graph_state_after": graph_info(engine),
    }


def save(report: dict) -> None:
    with open(OUT, "w") as f:
        json.dump(report, f, indent=1, default=str)


def main() -> int:
    report: dict = {"device": DEV, "torch": torch.__version__,
                    "cuda_available": torch.cuda.is_available(), "configs": {}}
    if DEV == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    ps = prompts()
    outputs: dict[str, list] = {}
    for name, (can, graphs) in CONFIGS.items():
        try:
            res, outs = run_config(name, config(can, graphs), ps)
            outputs[name] = outs
        except Exception as e:  # noqa: BLE001
            res = {"error": repr(e)[:500], "traceback": traceback.format_exc()[-2000:]}
        report["configs"][name] = res
        print(name, json.dumps(res), flush=True)
        save(report)  # partial results survive a timeout
    base = outputs.get("none_eager")
    if base is not None:
        for name, outs in outputs.items():
            same = sum(a == b for a, b in zip(outs, base, strict=True))
            first_div = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                         for a, b in zip(outs, base, strict=True)]
            report["configs"][name]["outputs_identical_to_none_eager"] = f"{same}/{len(base)}"
            report["configs"][name]["first_divergent_token"] = [d for d in first_div if d is not None][:12]
    try:
        report["fault_in_graph"] = fault_in_graph()
    except Exception as e:  # noqa: BLE001
        report["fault_in_graph"] = {"error": repr(e)[:500], "traceback": traceback.format_exc()[-2000:]}
    print("fault_in_graph", json.dumps(report["fault_in_graph"]), flush=True)
    report["warnings"] = captured_warnings
    save(report)
    errors = [n for n, r in report["configs"].items() if "error" in r]
    return 1 if errors or not report["fault_in_graph"].get("detected") else 0


if __name__ == "__main__":
    sys.exit(main())
PYEOF
cat >"$H/selftest_dev.py" <<'PYEOF'
"""`kvcanary selftest` (no --device flag) with every engine on $KVC_DEVICE (default cuda)."""
import dataclasses
import os
import sys

import kvcanary.cli.selftest as st

_orig = st.engine_config
st.engine_config = lambda *a, **k: dataclasses.replace(_orig(*a, **k), device=os.environ.get("KVC_DEVICE", "cuda"))
from kvcanary.cli.command import main  # noqa: E402

sys.exit(main(["selftest", *sys.argv[1:]]))
PYEOF
cat >"$H/env_check.py" <<'PYEOF'
"""Versions, the GPU, optional packages, and one trivial Triton kernel compiled and run."""
import importlib
import json
import os
import platform
import sys

import torch

info = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["capability"] = torch.cuda.get_device_capability(0)
    free, total = torch.cuda.mem_get_info()
    info["mem_free_gib"] = round(free / 2**30, 1)
for mod in ("triton", "numba", "numpy", "safetensors", "transformers", "tqdm", "tabulate",
            "prometheus_client", "hypothesis", "xdist", "fastapi", "uvicorn", "httpx", "openai",
            "pydantic", "tokenizers"):
    try:
        info[mod] = getattr(importlib.import_module(mod), "__version__", "ok")
    except Exception as e:  # noqa: BLE001
        info[mod] = f"MISSING ({type(e).__name__})"
from kvcanary.canary.kernels import dispatch as kernels  # noqa: E402

info["kvcanary_triton_installed"] = kernels.triton_installed()
dev = os.environ.get("KVC_DEVICE", "cuda")
if dev == "cuda":
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _add(x, y, out, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(out + offs, tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)

        x = torch.arange(1000, device="cuda", dtype=torch.int64)
        out = torch.empty_like(x)
        _add[(4,)](x, x, out, 1000, BLOCK=256)
        info["triton_smoke"] = bool(torch.equal(out, 2 * x))
    except Exception as e:  # noqa: BLE001
        info["triton_smoke"] = f"FAILED {e!r}"[:400]
print(json.dumps(info, indent=1, default=str))
PYEOF
cat >"$H/summarize.py" <<'PYEOF'
"""steps.json (every step's rc / seconds and the highlights of each JSON), runs.json and
selftest.json (the two runs of each merged)."""
import json
import os
import re
import sys

H, OUT = sys.argv[1], sys.argv[2]


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001
        return {"missing": f"{type(e).__name__}: {e}"[:200]}


def merge(names, out_name):
    merged = {n: load(os.path.join(H, n + ".json")) for n in names}
    with open(os.path.join(OUT, out_name), "w") as f:
        json.dump(merged, f, indent=1)
    return merged


runs = merge(["run_graph_safe", "run_not_graph_safe"], "runs.json")
selftest = merge(["selftest", "selftest_graph_safe"], "selftest.json")
steps = []
with open(os.path.join(H, "steps.tsv")) as f:
    for line in f:
        name, rc, s = line.rstrip("\n").split("\t")
        steps.append({"step": name, "rc": rc, "s": int(s)})
hl = {}
eng = load(os.path.join(OUT, "engine_cuda.json"))
if "configs" in eng:
    hl["engine"] = {k: {x: v.get(x) for x in ("error", "cuda_graphs_captured", "capture_failed",
                                              "canary_graph_capturable",
                                              "outputs_identical_to_none_eager", "generate_s")
                        if x in v} | {"violations": (v.get("canary") or {}).get("violations")}
                    for k, v in eng["configs"].items()}
    f = eng.get("fault_in_graph", {})
    hl["fault_in_graph"] = {k: f.get(k) for k in ("detected", "violations_after_injection",
                                                  "graph_state_at_injection", "error")}
tri = load(os.path.join(OUT, "triton_cuda.json"))
hl["triton"] = {k: tri.get(k) for k in ("passed", "failed", "cases_compared",
                                        "extra_random_worlds", "triton_interpreted", "missing")}
for name, r in runs.items():
    hl[name] = {k: r.get(k) for k in ("canary_violations", "graph_replays", "decode_tokens_per_s",
                                      "wall_time_s", "missing")}
for name, s in selftest.items():
    hl[name] = {k: s.get(k) for k in ("ok", "missing")}
for name in ("overhead_graphs", "overhead_eager"):
    hl[name] = "written" if os.path.exists(os.path.join(OUT, name + ".json")) else "missing"
log = open(os.path.join(OUT, "log.txt"), errors="replace").read()
hl["log_capture_failed_lines"] = re.findall(r".*CUDA graph capture failed.*", log)[:5]
hl["log_traceback_count"] = log.count("Traceback (most recent call last)")
with open(os.path.join(OUT, "steps.json"), "w") as f:
    json.dump({"steps": steps, "highlights": hl}, f, indent=1, default=str)
print(json.dumps({"steps": steps}, indent=1))
PYEOF

# ------------------------------------------------------------------ the steps
{
    echo "kvcanary GPU check: device=$DEV python=$PY budget=${BUDGET}s start=$(date -u +%FT%TZ)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null) ($(git status --short 2>/dev/null | wc -l) changed paths)"
} | tee -a "$LOG"

# 1. the machine: GPU, versions, optional packages, one trivial Triton kernel
if [ "$DEV" = cuda ]; then step nvidia-smi 20 nvidia-smi -L; fi
step env 60 "$PY" "$H/env_check.py"

# 2. the engine on CUDA: graph capture with / without the canary (graph-safe or not), outputs
#    vs the eager no-canary baseline, canary counters, a req->token fault injected after
#    capture (detected by the HEAD verify recorded in the graph?)
step engine 150 "$PY" "$H/engine_check.py" "$OUT/engine_cuda.json"

if [ "${KVC_ONLY_ENGINE:-0}" = 1 ]; then
    cp "$H"/engine_check.py "$OUT"/ 2>/dev/null; rm -rf "$H"; exit 0
fi

# 3. the Triton kernels + plan builder compiled for the GPU vs numba / torch on the CPU: the
#    cases of tests/canary/triton_interpreted_cases.py (their CPU tensors copied to the device
#    around each Triton call by kvc_cuda_shim) + 200 more random worlds, counted
if [ "$DEV" = cpu ]; then TRI_ENV=(env TRITON_INTERPRET=1 KVC_SHIM_DEVICE=cpu); else TRI_ENV=(env); fi
[ "${KVC_SKIP_TRITON:-0}" = 1 ] || step triton_cases 150 "${TRI_ENV[@]}" PYTHONPATH="$PYTHONPATH:$H" KVC_SHIM_JSON="$OUT/triton_cuda.json" \
    KVC_EXTRA_CASES=200 "$PY" -m pytest -q -s -p no:cacheprovider -p kvc_cuda_shim --rootdir . \
    -c pyproject.toml tests/canary/triton_interpreted_cases.py "$H/test_kvc_cuda_extra.py" \
    -k "not cpu_tensors_without_interpreter"

# 4. kvcanary run with the canary in raise mode, CUDA graphs on, with and without graph-safe
RUN_ARGS=(--device "$DEV" --model builtin:tiny-swa --kv-canary raise --num-requests 16
    --input-len 128 --shared-prefix-len 32 --output-len 48 --kv-canary-stats-interval 16
    --kv-canary-health-check-interval 16 --kv-canary-swa-divergence-interval 16
    --log-level info --no-progress)
step run_graph_safe 90 "$PY" -m kvcanary run "${RUN_ARGS[@]}" --kv-canary-graph-safe \
    --json "$H/run_graph_safe.json"
[ "${KVC_SKIP_RUN2:-0}" = 1 ] || step run_not_graph_safe 90 "$PY" -m kvcanary run "${RUN_ARGS[@]}" --json "$H/run_not_graph_safe.json"

# 5. canary overhead, CUDA graphs on / off
OV_ARGS=(--device "$DEV" --model builtin:tiny-swa --variants none,log,log+partial,log+graph-safe
    --repeats 3 --no-progress)
step overhead_graphs 120 "$PY" -m kvcanary bench overhead "${OV_ARGS[@]}" --json "$OUT/overhead_graphs.json"
step overhead_eager 120 "$PY" -m kvcanary bench overhead "${OV_ARGS[@]}" --disable-graph \
    --json "$OUT/overhead_eager.json"

# 5b. the realistic preset (Qwen3-0.6B shapes), CUDA graphs on
if [ "${KVC_06B:-0}" = 1 ]; then
step overhead_06b 200 "$PY" -m kvcanary bench overhead --device "$DEV" --model builtin:qwen3-0.6b-shape \
    --variants none,log,log+partial,log+graph-safe --repeats 3 --no-progress --json "$OUT/overhead_06b.json"
fi

# 6. the fault-injection campaign on CUDA (selftest has no --device: selftest_dev.py moves its
#    engines), one seed, the default pools; then with graph-safe plans
step selftest 150 "$PY" "$H/selftest_dev.py" --num-seeds 1 --no-progress --json "$H/selftest.json"
[ "${KVC_SKIP_ST2:-0}" = 1 ] || step selftest_graph_safe 150 "$PY" "$H/selftest_dev.py" --num-seeds 1 --kv-canary-graph-safe \
    --no-progress --json "$H/selftest_graph_safe.json"

# 7. whatever budget is left: the CPU test suite on this machine's Python / torch / triton
#    (no server tests: no fastapi / uvicorn here); only the summary and failures go to the log
left=$((BUDGET - ($(date +%s) - START)))
if ((left > 75)) && [ "${KVC_PYTEST:-1}" = 1 ]; then
    step pytest $((left - 10)) bash -c "\"$PY\" -m pytest -q -n 16 -p no:cacheprovider -rfE \
        tests --ignore=tests/server --ignore=tests/integrations >\"$H/pytest.txt\" 2>&1; rc=\$?; \
        grep -E '^(FAILED|ERROR)|passed|failed' \"$H/pytest.txt\" | tail -60; exit \$rc"
else
    echo "=== [pytest] SKIPPED: ${left}s of the budget left" | tee -a "$LOG"
    printf 'pytest\tskipped\t0\n' >>"$H/steps.tsv"
fi

"$PY" "$H/summarize.py" "$H" "$OUT" 2>&1 | tee -a "$LOG"
echo "done in $(($(date +%s) - START))s; files in $OUT:" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"
rm -rf "$H"
