"""The GraphRunner's capture path with the canary on, run on the CPU with a stand-in for
``torch.cuda.CUDAGraph`` (no GPU here): what a graph does — run the recorded work again on
every replay, with the host metadata of the capturing step — is what the stand-in does, so
anything in the canary's HEAD / TAIL (or the model) that depends on per-step host data, or
a host part left out of the replay, shows as wrong outputs, violations or missed faults."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from engine_utils import ReplayedGraph, make_prompts, stand_in_cuda_graphs, tiny_engine

from kvcanary.canary.config import CanaryConfig
from kvcanary.config import SamplingParams
from kvcanary.engine.graph_runner import KEY_WIDTH_BUCKET, GraphRunner


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[ReplayedGraph]:
    graphs = stand_in_cuda_graphs(monkeypatch)
    # CUDA's key-width buckets (exact widths on the CPU): one graph serves many steps
    monkeypatch.setattr(GraphRunner, "key_width_for", lambda self, lens: min(
        -(-max(lens) // KEY_WIDTH_BUCKET) * KEY_WIDTH_BUCKET, self.max_keys))  # fmt: skip
    log = logging.getLogger("kvcanary.canary")
    level = log.level
    log.setLevel(logging.ERROR)
    yield graphs
    log.setLevel(level)


PROMPTS = make_prompts(6, 10, 40, seed=2)
PARAMS = SamplingParams(max_new_tokens=30, ignore_eos=True)


def _engine(**canary: Any) -> Any:
    return tiny_engine(graph_batch_sizes=(1, 2, 4, 8), canary=CanaryConfig(
        mode="log", real_data="partial", graph_safe=True, **canary))  # fmt: skip


def test_captured_decode_with_the_canary_is_silent_and_exact(captured: list[ReplayedGraph]) -> None:
    eager = tiny_engine(graph_batch_sizes=()).generate(PROMPTS, PARAMS)
    engine = _engine(sweep_interval=4, health_check_interval=8)
    assert engine.generate(PROMPTS, PARAMS) == eager
    assert captured and max(g.replays for g in captured) > 10  # one graph, many steps
    assert engine.canary.violations == [] and not engine.canary.forward_open
    # every forward went through the host parts: the canary counted each of them
    assert engine.canary.step == engine.scheduler.stats.num_forwards


def test_a_fault_between_replays_is_reported(captured: list[ReplayedGraph]) -> None:
    engine = _engine()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for p in PROMPTS[:4]:
        engine.add_request(p, params)
    for _ in range(40):
        if captured and captured[-1].replays >= 3:
            break
        engine.step()
    assert captured and captured[-1].replays >= 3  # a graph replayed across steps
    running = engine.running_requests()[0]
    r2t = engine.runner.req_to_token_pool.req_to_token
    slot = int(r2t[running.req_pool_idx, running.kv_len - 2])
    k = engine.runner.token_to_kv_pool.full_kv_pool.k_buffer[0]
    k.view(torch.uint8).view(k.shape[0], -1)[slot, 0] ^= 0xFF  # the engine's own KV memory
    engine.step()
    engine.canary.flush()
    rows = [r for r in engine.canary.violations if r.slot_idx == slot]
    assert rows and rows[0].launch_tag == "TAIL_K_FULL"
    assert "verify_real_kv_hash" in rows[0].fail_reasons
