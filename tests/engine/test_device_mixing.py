"""No op of the engine mixes host and device tensors (CUDA's "Expected all tensors to be
on the same device"), checked without a GPU: the engine runs on ``cpu:0``, which
:class:`~device_mix.DeviceMixChecker` treats as a separate device (see there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from device_mix import DeviceMixChecker
from engine_utils import make_prompts, stand_in_cuda_graphs

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.canary.config import CanaryConfig

BASE: dict[str, Any] = dict(device="cpu:0", page_size=4, max_total_tokens=4096, max_context_len=1024)
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def test_the_checker_flags_what_cuda_refuses() -> None:
    m = DeviceMixChecker()
    with m:
        d, h, idx = torch.zeros(4, device="cpu:0"), torch.zeros(4), torch.tensor([1, 2])
        assert d.device == torch.device("cpu", 0) and h.device == torch.device("cpu")
        _ = d[idx] + torch.tensor(1.0)  # host indices, a host scalar: fine
        d[1:3] = torch.ones(2)  # a copy_: fine
        _ = torch.cat([d, h.to(d.device)])
        assert m.violations == []
        _ = torch.where(h > 0, d, torch.full_like(d, -1))  # the first CUDA crash (last_locs)
        _ = d.index_select(0, idx)
        d[idx] = torch.ones(2)
        _ = h[d.long()]
    assert len(m.violations) == 4, m.violations


def _run(config: dict[str, Any], prompts: list[list[int]], params: Any = GREEDY,
         quarantine: bool = False) -> Engine:  # fmt: skip
    m = DeviceMixChecker()
    with m:
        engine = Engine(EngineConfig(**config))
        if not quarantine:
            engine.generate(prompts, params)
        else:
            for p in prompts:
                engine.add_request(p, params)
            for _ in range(40):
                engine.step()
                if len(engine.scheduler.running) >= 2 and engine.scheduler.running[1].kv_len > 5:
                    break
            kv, victim = engine.kv, engine.scheduler.running[1]
            # Host slot tensors, as a caller may hand them in.
            full = torch.tensor([int(kv.req_to_token[victim.req_pool_idx, 5])])
            swa = torch.tensor([int(kv.swa().full_to_swa_index_mapping[full])]) if kv.spec.windowed else None
            engine.abort_requests_referencing(full, swa)
            if engine.scheduler.running:
                engine.abort_request(engine.scheduler.running[-1].rid)
            while engine.has_unfinished():
                engine.step()
        engine.check_integrity()
    assert m.violations == [], "\n".join(m.violations)
    return engine


PROMPTS = make_prompts(4, 20, 60, shared=16, seed=1)


@pytest.mark.parametrize(
    "config",
    [
        dict(model="builtin:tiny-swa", chunked_prefill_size=16),
        dict(model="builtin:tiny-mha", page_size=1),
        dict(model="builtin:tiny-swa-all", graph_batch_sizes=(), enable_prefix_cache=False),
    ],
    ids=["swa-chunked", "mha-p1", "swa-all-eager"],
)
def test_engine_paths(config: dict[str, Any]) -> None:
    _run(BASE | config, PROMPTS)
    _run(BASE | config, make_prompts(4, 40, 60, shared=32, seed=5), quarantine=True)


def test_sampling_and_logprobs() -> None:
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_k=20,
                             top_p=0.9, logprobs=3),
              SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)]  # fmt: skip
    _run(BASE | dict(model="builtin:tiny-swa"), PROMPTS[:2], params)


@pytest.mark.parametrize("model", ["builtin:tiny-mha", "builtin:tiny-swa"])
def test_retraction_with_host_offload(model: str) -> None:
    config = BASE | dict(model=model, chunked_prefill_size=64, max_total_tokens=320,
                         swa_full_tokens_ratio=0.5, enable_host_offload=True)  # fmt: skip
    prompts = make_prompts(8, 40, 120, shared=48, seed=7)
    engine = _run(config, prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert engine.stats.num_retractions > 0


def test_dsv4_with_host_offload() -> None:
    config = BASE | dict(model="builtin:tiny-dsv4", page_size=128, max_total_tokens=1024,
                         swa_full_tokens_ratio=1.0, chunked_prefill_size=0,
                         enable_prefix_cache=False, enable_host_offload=True)  # fmt: skip
    engine = _run(config, make_prompts(3, 250, 250, seed=3), SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert engine.stats.num_retractions > 0


def test_graph_replay_path_with_the_canary(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_replay_cuda_graph`` (capture stood in for: the warm-up runs, then each replay
    runs the model again) with the canary's torch kernels."""

    stand_in_cuda_graphs(monkeypatch)
    canary = CanaryConfig(mode="log", backend="torch", real_data="partial", graph_safe=True,
                          health_check_interval=0)  # fmt: skip
    engine = _run(BASE | dict(model="builtin:tiny-swa", graph_batch_sizes=(1, 2, 4), canary=canary), PROMPTS)
    assert engine.runner.canary is not None and engine.stats.graph_replays > 0


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_host_bookkeeping_equals_the_device_paths(prefix_cache: bool) -> None:
    """The engine on the host ("cpu": a decode step's allocation, window eviction, frees and
    SWA mapping in numpy) and on the stand-in device ("cpu:0": the torch ops), one workload
    whose windows slide (prompts and outputs past the 32-token window), with and without the
    prefix cache: the same tokens, SWA slots evicted / tombstoned, free lists and mapping."""
    config = dict(model="builtin:tiny-swa", page_size=4, max_total_tokens=480, max_context_len=1024,
                  swa_full_tokens_ratio=0.5, chunked_prefill_size=64,
                  enable_prefix_cache=prefix_cache)  # fmt: skip
    prompts = make_prompts(6, 40, 100, shared=24, seed=11)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    runs = []
    for device in ("cpu", "cpu:0"):
        engine = Engine(EngineConfig(device=device, **config))
        outputs = [o.output_ids for o in engine.generate(prompts, params)]
        swa = engine.kv.swa()
        runs.append((
            outputs, engine.stats.num_swa_slots_evicted, engine.stats.num_swa_slots_tombstoned,
            swa.full_attn_allocator.free_pages.tolist(), swa.swa_attn_allocator.free_pages.tolist(),
            swa.full_to_swa_index_mapping.tolist(),
        ))  # fmt: skip
        engine.check_integrity()
    assert runs[0][2 if prefix_cache else 1] > 0  # windows slid: SWA slots left them
    assert runs[0] == runs[1]
