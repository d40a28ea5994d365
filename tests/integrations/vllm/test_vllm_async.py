"""The canary under vLLM's async scheduling (``AsyncScheduler``: a decode step is planned
before its input token, the previous step's sampled one, is known to the scheduler).

vLLM's CPU build turns async scheduling off in ``CpuPlatform.check_and_update_config``
(``vllm/platforms/cpu.py``: ``scheduler_config.async_scheduling = False``, "async
scheduling is not required on CPU"); nothing else in its CPU path refuses it. The fixture
``async_scheduling`` wraps that hook for the test's engines only so that it turns the option
back on after the platform's own settings: the engine then runs vLLM's ``AsyncScheduler``,
the batch queue of two, and the model runner's async input path (the sampled ids of the
previous step copied into its input-id buffer, ``GPUModelRunner._prepare_input_ids``).

* clean: the outputs are those of a synchronous engine, nothing is reported, the token of
  every position planned without one arrives a step later (or with its request's finish),
  and the records of those positions then hold the tokens the requests produced (the
  forward's input ids); with the model runner's input ids not found, the records are
  settled with the scheduler's tokens.
* fault: the forward of one decode step takes another input id than the one the scheduler
  records as sampled (injected into the model runner's input-id buffer): reported as
  ``verify_token`` at that position's slot once the scheduler's token arrives; the same
  with synchronous scheduling, in the next step (the records carry the forward's ids in
  both).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_harness as H

CANARY = {"mode": "log", "real_data": "partial", "verify_tokens": True}
N_REQS, PROMPT, OUT = 4, 40, 24


@pytest.fixture
def async_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def with_async(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(with_async))


def _prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 300) for _ in range(PROMPT + 3 * i)] for i in range(N_REQS)]


def _run(llm: Any, prompts: list[list[int]]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Every prompt as request ``r{i}``, stepped to the end: (outputs, the block ids of
    each request's last step)."""
    for i, p in enumerate(prompts):
        H.add_request(llm, f"r{i}", p, OUT)
    sched = H.scheduler(llm)
    outputs: dict[str, list[int]] = {}
    blocks: dict[str, list[int]] = {}
    while llm.llm_engine.has_unfinished_requests():
        for o in H.step(llm):
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
        for rid in list(sched.requests):
            blocks[rid.split("-")[0]] = list(sched.kv_cache_manager.get_block_ids(rid)[0])
    return outputs, blocks


def _record_tokens(conn: Any, blocks: list[int], positions: range) -> list[int]:
    view = conn.worker.records[H.BLOCK_SIZE].k_head.view(torch.int64)
    return [int(view[blocks[p // H.BLOCK_SIZE] * H.BLOCK_SIZE + p % H.BLOCK_SIZE, 0])
            for p in positions]  # fmt: skip


@pytest.fixture(scope="module")
def sync_outputs(checkpoints: dict[str, Path]) -> dict[str, list[int]]:
    with H.vllm_engine(checkpoints["llama"]) as llm:
        assert not llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        return _run(llm, _prompts())[0]


@pytest.mark.parametrize("forward_ids", [True, False], ids=["forward_ids", "scheduler_only"])
def test_async_clean_run_checks_every_async_planned_token(
    checkpoints: dict[str, Path], async_scheduling: None, sync_outputs: dict[str, list[int]],
    forward_ids: bool,
) -> None:  # fmt: skip
    prompts = _prompts()
    with H.vllm_engine(checkpoints["llama"], canary=CANARY) as llm:
        assert type(H.scheduler(llm)).__name__ == "AsyncScheduler"
        assert H.worker(llm).model_runner.use_async_scheduling
        conn = H.connector(llm)
        # The connector found the model runner's input-id buffer (register_kv_caches).
        assert conn.worker.forward_input_ids is H.worker(llm).model_runner.input_ids.gpu
        if not forward_ids:
            conn.worker.forward_input_ids = None
        outputs, blocks = _run(llm, prompts)
        # The tokens of the requests' last positions went with their finish into the next
        # metadata the scheduler side builds (before any later step can read those slots):
        # an empty step's, handed to the worker as vLLM's next step would.
        from vllm.v1.core.sched.output import SchedulerOutput

        meta = H.scheduler(llm).connector.build_connector_meta(SchedulerOutput.make_empty())
        conn.bind_connector_metadata(meta)
        conn.worker.flush()
        stats = conn.worker.stats()
        assert outputs == sync_outputs
        assert stats["violations"] == 0, conn.worker.violations[:3]
        # Each request feeds OUT - 1 sampled tokens back, each planned before it was known;
        # all but the last one or two (the request finishes first) arrive while it runs.
        assert N_REQS * (OUT - 3) <= stats["async_arrived"] <= N_REQS * (OUT - 1)
        if forward_ids:
            assert stats["async_settled"] == 0  # the records carried the forward's ids
        else:
            assert stats["async_settled"] == stats["async_arrived"]
        for i, p in enumerate(prompts):
            rid = f"r{i}"
            # Position len(p) + j holds output j, up to the last one fed back: those that
            # arrived while the request ran and those that arrived with its finish (none is
            # -1), so every later read of them, a prefix hit's too, checks the token.
            got = _record_tokens(conn, blocks[rid], range(len(p), len(p) + OUT - 1))
            assert got == outputs[rid][: OUT - 1], rid


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_a_wrong_input_id_in_a_decode_forward_is_reported_as_verify_token(
    checkpoints: dict[str, Path], scheduling: str, request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """The fault: vLLM's input path puts another id than the one sampled into one
    request's decode input (as a wrong index in ``_prepare_input_ids``' scatter would). The
    scheduler commits the sampled id; the forward computed the slot's KV from the other one.
    The canary's record of that slot carries the forward's id. Async: when the scheduler's
    token arrives (a later step's metadata), that step's HEAD reports verify_token there;
    sync: the scheduler's token came with the step, and the next step's HEAD reports it."""
    if scheduling == "async":
        request.getfixturevalue("async_scheduling")
    prompts = _prompts(7)
    with H.vllm_engine(checkpoints["llama"], canary=CANARY) as llm:
        assert (type(H.scheduler(llm)).__name__ == "AsyncScheduler") == (scheduling == "async")
        conn = H.connector(llm)
        runner = H.worker(llm).model_runner
        assert conn.worker.forward_input_ids is runner.input_ids.gpu
        prepare = runner._prepare_input_ids
        injected: dict[str, Any] = {}
        calls = {"n": 0}

        def faulty_prepare(scheduler_output: Any, num_reqs: int, total: int, cu: Any) -> None:
            prepare(scheduler_output, num_reqs, total, cu)
            calls["n"] += 1
            target = next((r for r in runner.input_batch.req_ids[:num_reqs]
                           if r.startswith("r1-")), None)  # fmt: skip
            if injected or target is None or calls["n"] < 8:
                return
            i = runner.input_batch.req_ids.index(target)
            if scheduler_output.num_scheduled_tokens.get(target) != 1:
                return
            at = int(cu[i]) - 1
            ids = runner.input_ids.gpu
            true_id = int(ids[at])
            ids[at] = (true_id % 299) + 1  # another id of the vocabulary
            injected.update(req=target, position=int(runner.input_batch.num_computed_tokens_cpu[i]),
                            true=true_id, wrong=int(ids[at]),
                            blocks=list(runner.requests[target].block_ids[0]))  # fmt: skip

        runner._prepare_input_ids = faulty_prepare
        for i, p in enumerate(prompts):
            H.add_request(llm, f"r{i}", p, OUT)
        steps_after = None
        while llm.llm_engine.has_unfinished_requests():
            H.step(llm)
            conn.worker.flush()
            if injected and steps_after is None:
                steps_after = 0
            elif steps_after is not None:
                steps_after += 1
                if conn.worker.violations:
                    break
        assert injected and injected["true"] != injected["wrong"]
        rows = conn.worker.violations
        assert rows, injected
        pos, bs = injected["position"], H.BLOCK_SIZE
        slot = injected["blocks"][pos // bs] * bs + pos % bs
        token_rows = [r for r in rows if "verify_token" in r.fail_reasons]
        assert {(r.slot_idx, r.position, r.stored_token, r.expected_token) for r in token_rows} == {
            (slot, pos, injected["wrong"], injected["true"])
        }
        # Found within two engine steps of the faulty forward (async: the batch queue of
        # two, the step whose metadata brings the sampled token is planned one step later;
        # sync: the next step, whose HEAD reads the slot first).
        assert steps_after is not None and steps_after <= (2 if scheduling == "async" else 1), (
            steps_after)  # fmt: skip
