"""Shared helpers for engine tests: tiny configs, workloads and memory checks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.engine.graph_runner import GraphRunner


def make_prompts(num: int, min_len: int, max_len: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return [
        prefix + [rng.randrange(256) for _ in range(rng.randint(min_len, max_len) - shared)]
        for _ in range(num)
    ]


def tiny_engine(**overrides: Any) -> Engine:
    base: dict[str, Any] = dict(model="builtin:tiny-swa", page_size=4, max_total_tokens=4096,
                                max_context_len=1024)
    base.update(overrides)
    return Engine(EngineConfig(**base))


def start_decoding(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 24) -> list[int]:
    """Submit ``prompts`` and step until every request is decoding (no forward finishes one);
    their ids."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    while True:
        assert engine.step() == []
        running = engine.running_requests()
        if len(running) == len(rids) and all(r.kv_len == len(r.prompt_ids) + len(r.output_ids) - 1
                                             for r in running):  # fmt: skip
            return rids


def slot_of(engine: Engine, running_index: int, position: int) -> int:
    """The full slot of ``position`` of the ``running_index``-th running request."""
    row = engine.running_requests()[running_index].req_pool_idx
    return int(engine.runner.req_to_token_pool.req_to_token[row, position])


def greedy_outputs(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 24,
                   waves: int = 1) -> list[list[int]]:
    """Greedy outputs, prompts submitted in ``waves`` consecutive generate() calls (so later
    waves can hit the prefix cache filled by earlier ones)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    size = -(-len(prompts) // waves)
    outs = []
    for i in range(0, len(prompts), size):
        outs += engine.generate(prompts[i : i + size], params)
    return [o.output_ids for o in outs]


def assert_all_memory_free(engine: Engine) -> None:
    """After every request finished: integrity holds, and once the prefix cache lets go of
    what it holds, every slot and row is back on the free lists."""
    sched = engine.scheduler
    assert not sched.has_unfinished()
    engine.check_integrity()
    if sched.kv.prefix_cache is not None:
        sched.kv.prefix_cache.free_all()
    alloc = engine.runner.allocator
    if engine.runner.is_swa:
        assert alloc.full_available_size() == alloc.size_full
        assert alloc.swa_available_size() == alloc.size_swa
        assert int((alloc.full_to_swa_index_mapping[:-1] != 0).sum()) == 0
    else:
        assert alloc.available_size() == alloc.size
    pool = engine.runner.req_to_token_pool
    assert pool.available_size() == pool.size
    engine.check_integrity()


class ReplayedGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` (no GPU in CI): replay runs the recorded
    work again, with the capturing step's host metadata, into the same output."""

    def __init__(self, run: Any, out: torch.Tensor):
        self.run, self.out, self.replays = run, out, 0

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.run())


def stand_in_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> list[ReplayedGraph]:
    """Make the GraphRunner take its CUDA-graph path on the CPU: each capture runs the two
    warm-ups for real, as ``GraphRunner._capture`` does, then records the capturing step's
    work in a :class:`ReplayedGraph` (appended to the returned list)."""
    graphs: list[ReplayedGraph] = []

    def capture(self: GraphRunner, fb: Any) -> tuple[ReplayedGraph, torch.Tensor]:
        for _ in range(2):  # the warm-up runs before a capture execute for real
            warm = self._run_model(fb)
        graphs.append(ReplayedGraph(lambda: self._run_model(fb), torch.empty_like(warm)))
        return graphs[-1], graphs[-1].out

    monkeypatch.setattr(GraphRunner, "_uses_cuda_graphs", lambda self: True)
    monkeypatch.setattr(GraphRunner, "_capture", capture)
    return graphs
