"""One decode step of our engine on CUDA, eager: kernels and GPU time of the canary's HEAD /
TAIL (graph-safe plans, Triton) vs the model's, from torch.profiler."""
import json, sys, random, torch
from torch.profiler import profile, ProfilerActivity, record_function
from kvcanary.config import EngineConfig, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.engine.engine import Engine
import kvcanary.canary.manager as M
model = sys.argv[1]; out = sys.argv[2]; DEV = sys.argv[3] if len(sys.argv) > 3 else "cuda"
res = {}
for name, canary in (("log_graph_safe", CanaryConfig(mode="log", graph_safe=True)), ("log", CanaryConfig(mode="log"))):
    for bs in (1, 32):
        e = Engine(EngineConfig(model=model, device=DEV, graph_batch_sizes=(), page_size=16, max_total_tokens=bs*160+256, canary=canary))
        random.seed(0)
        for _ in range(bs):
            e.add_request([random.randrange(3, 250) for _ in range(64)], SamplingParams(max_new_tokens=40, ignore_eos=True))
        for _ in range(12): e.step()
        (torch.cuda.synchronize() if DEV == "cuda" else None)
        oh, ot = M.CanaryManager.head, M.CanaryManager.tail
        def head(self, b):
            with record_function("canary_head"): return oh(self, b)
        def tail(self, b):
            with record_function("canary_tail"): return ot(self, b)
        M.CanaryManager.head, M.CanaryManager.tail = head, tail
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(3): e.step()
            (torch.cuda.synchronize() if DEV == "cuda" else None)
        M.CanaryManager.head, M.CanaryManager.tail = oh, ot
        ev = p.events()
        kernels = [x for x in ev if x.device_type.name == "CUDA"]
        def under(rng):
            spans = [(x.time_range.start, x.time_range.end) for x in ev if x.name == rng and x.device_type.name == "CPU"]
            ks = [k for k in kernels if any(k.correlation_id and s <= getattr(k, "cpu_time_range", k.time_range).start <= t for s, t in spans)]
            return len(spans), ks
        tot = {"kernels_per_step": len(kernels) / 3, "gpu_us_per_step": sum(k.device_time for k in kernels) / 3}
        # attribute kernels by their launching CPU op's parent range
        ka = p.key_averages()
        rows = {r.key: (r.count, r.cpu_time_total, getattr(r, "device_time_total", 0)) for r in ka if r.key in ("canary_head", "canary_tail")}
        tot["ranges"] = {k: {"count": v[0], "cpu_us_total": v[1], "device_us_total": v[2]} for k, v in rows.items()}
        tot["top_kernels"] = [(r.key[:60], r.count, round(getattr(r, "device_time_total", 0), 1)) for r in sorted(ka, key=lambda r: -getattr(r, "device_time_total", 0))[:12]]
        res[f"{name}_b{bs}"] = tot
        print(name, bs, json.dumps(tot)[:600], flush=True)
json.dump(res, open(out, "w"), indent=1)
