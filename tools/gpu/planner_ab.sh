#!/usr/bin/env bash
# The compiled graph-safe planner on CUDA: engine check (capture, outputs, fault in graph),
# then bench overhead with it off / on, side by side per model, and a kernel count of an eager
# decode step (profile_step.py). Run from the repository root on a GPU machine ($OUT set).
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
KVC_ONLY_ENGINE=1 KVC_BUDGET_S=120 KVC_PYTEST=0 bash tools/gpu/check.sh > $OUT/engine_log.txt 2>&1
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/engine_cuda.json"))
for k, v in d.get("configs", {}).items():
    print(k, {x: v.get(x) for x in ("cuda_graphs_captured", "capture_failed", "canary_graph_capturable", "outputs_identical_to_none_eager", "error")}, (v.get("canary") or {}).get("violations"))
print("fault_in_graph", {k: d.get("fault_in_graph", {}).get(k) for k in ("detected", "violations_after_injection", "error")})
PY
grep -i "recompile\|warn" $OUT/engine_log.txt | head -5
echo "engine check done at +$(( $(date +%s) - T0 ))s"
for c in off on; do
  KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS=$c timeout 110 python3 -m kvcanary bench overhead --device cuda \
    --model builtin:tiny-swa,builtin:qwen3-0.6b-shape --variants none,log+graph-safe --repeats 5 \
    --no-progress --json $OUT/ov_$c.json 2>&1 | grep -E "decode|prefill" | grep -v prefill_len
  echo "overhead compile=$c done at +$(( $(date +%s) - T0 ))s"
done
KVCANARY_KV_CANARY_COMPILE_STATIC_PLANS=on timeout 60 python3 tools/gpu/profile_step.py builtin:tiny-swa $OUT/prof_on.json 2>&1 | grep -E "^log" | cut -c1-160
echo "all done at +$(( $(date +%s) - T0 ))s"
