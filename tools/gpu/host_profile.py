"""Where a decode step's wall time goes on a GPU (host side): our engine with CUDA graphs, no
canary and the graph-safe canary, batch 1 and 32, tiny-swa and the 0.6B preset. Per case:
the median step time, and a cProfile of 16 decode steps (top functions by own and by
cumulative time), and how many times the host waited on the device (torch.cuda.synchronize,
Tensor.item / tolist / cpu copies are counted by cProfile's callers of the same name).

    python3 tools/gpu/host_profile.py OUT.json [cuda|cpu]
"""

import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time

import torch

from kvcanary.canary.config import CanaryConfig
from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.engine.engine import Engine

out, dev = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
res = {}
for model in (
    sys.argv[3].split(",")
    if len(sys.argv) > 3
    else ("builtin:tiny-swa", "builtin:qwen3-0.6b-shape")
):
    for label, canary in (
        ("none", CanaryConfig(mode="none")),
        ("log_graph_safe", CanaryConfig(mode="log", graph_safe=True)),
    ):
        for bs in (1, 32):
            e = Engine(
                EngineConfig(
                    model=model,
                    device=dev,
                    page_size=16,
                    max_total_tokens=bs * 200 + 1024,
                    swa_full_tokens_ratio=1.0,
                    canary=canary,
                )
            )
            random.seed(0)
            for _ in range(bs):
                e.add_request(
                    [random.randrange(3, 250) for _ in range(64)],
                    SamplingParams(max_new_tokens=60, ignore_eos=True),
                )
            for _ in range(12):
                e.step()
            sync()
            ts = []
            for _ in range(16):
                t0 = time.perf_counter()
                e.step()
                sync()
                ts.append(time.perf_counter() - t0)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(16):
                e.step()
            sync()
            prof.disable()
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(22)
            st.sort_stats("cumulative").print_stats(28)
            key = f"{model.split(':')[1]}_{label}_b{bs}"
            res[key] = {
                "step_ms_median": round(statistics.median(ts) * 1e3, 3),
                "profile": s.getvalue()[-9000:],
            }
            print(key, res[key]["step_ms_median"], "ms/step", flush=True)
            del e
with open(out, "w") as f:
    json.dump(res, f, indent=1)
