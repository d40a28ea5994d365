"""What each canary mode does on a real vLLM, and the connector's plumbing (the plugin
name, options, the refusal of abort mode where vLLM cannot honour it)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_harness as H
from log_lines import log_lines

from kvcanary.canary.errors import KVCanaryViolation
from kvcanary.integrations.vllm.options import parse_options


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


def _corrupt_table(llm: object, victim_of: str, thief: str) -> None:
    """Point ``thief``'s second group-0 block-table entry at ``victim_of``'s (worker side)."""
    batch = H.worker(llm).model_runner.input_batch
    table = batch.block_table.block_tables[0].block_table
    rt = batch.req_id_to_index[H.internal_id(llm, thief)]
    rv = batch.req_id_to_index[H.internal_id(llm, victim_of)]
    table.cpu[rt, 1] = table.cpu[rv, 1]


def test_options_parse_and_refuse_typos() -> None:
    opts = parse_options({"mode": "raise", "v_half": "true", "ring_capacity": "64"})
    assert opts.canary.mode == "raise" and opts.canary.v_half and opts.canary.ring_capacity == 64
    assert parse_options(None).canary.real_data == "partial"  # vLLM default: fingerprints on
    with pytest.raises(ValueError, match="unknown key"):
        parse_options({"moed": "log"})
    with pytest.raises(ValueError, match="kv-canary"):
        parse_options({"mode": "bogus"})


def test_plugin_registers_the_connector_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcanary.integrations.vllm import CONNECTOR_NAME, register

    register()  # idempotent (vLLM already ran it through the entry point)
    assert CONNECTOR_NAME in KVConnectorFactory._registry
    cls = KVConnectorFactory._registry[CONNECTOR_NAME]()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    assert cls.__name__ == "KVCanaryConnector" and supports_hma(cls)


def test_raise_mode_fails_the_step(checkpoints: dict[str, Path]) -> None:
    with H.vllm_engine(checkpoints["llama"], canary={"mode": "raise"}) as llm:
        for rid, seed in (("a", 11), ("b", 12)):
            H.add_request(llm, rid, _prompt(seed, 90), 30)
        for _ in range(3):
            H.step(llm)
        _corrupt_table(llm, "b", "a")
        with pytest.raises(Exception) as info:
            H.step(llm)
        chain = H.error_chain(info.value)
        assert any(isinstance(x, KVCanaryViolation) or "kv_canary violation" in str(x)
                   for x in chain), chain  # fmt: skip


def test_abort_mode_recompute_repairs_the_request(checkpoints: dict[str, Path]) -> None:
    """abort + kv_load_failure_policy=recompute: the violating block goes to vLLM as a KV
    load error; vLLM drops the step's output of the request holding it and recomputes from
    that block, so the final output equals a clean run's."""
    prompt = _prompt(13, 100)
    with H.vllm_engine(checkpoints["llama"]) as llm:
        (clean,) = H.generate(llm, [prompt], 30)
    # A handler on the "vllm" logger, which does not propagate once vLLM has configured
    # logging: caplog (root) would see its lines only by the order tests ran in.
    with log_lines("vllm") as scheduler_log, H.vllm_engine(
            checkpoints["llama"], canary={"mode": "abort", "real_data": "all"},
            policy="recompute") as llm:  # fmt: skip
        H.add_request(llm, "a", prompt, 30)
        for _ in range(5):
            H.step(llm)
        conn = _flip_first_k_byte(llm, "a")
        outputs = []
        while llm.llm_engine.has_unfinished_requests():
            outputs += H.step(llm)
        conn.worker.flush()
        rows = conn.worker.violations
    assert rows and all(r.launch_tag == "TAIL_K_FULL" for r in rows)
    recovered = [x for x in scheduler_log.lines if "Recovered from KV load failure" in x]
    assert recovered, scheduler_log.lines
    (final,) = [o for o in outputs if o.finished]
    assert list(final.outputs[0].token_ids) == clean


def test_abort_mode_fail_policy_fails_only_the_request(checkpoints: dict[str, Path]) -> None:
    """abort + kv_load_failure_policy=fail (vLLM's default): the request holding the block
    finishes with an error, the other one completes."""
    with H.vllm_engine(checkpoints["llama"], canary={"mode": "abort", "real_data": "all"},
                       policy="fail") as llm:  # fmt: skip
        for rid, seed in (("a", 14), ("b", 15)):
            H.add_request(llm, rid, _prompt(seed, 90), 30)
        for _ in range(3):
            H.step(llm)
        _flip_first_k_byte(llm, "a")
        finished = {}
        while llm.llm_engine.has_unfinished_requests():
            for o in H.step(llm):
                if o.finished:
                    finished[o.request_id] = o
    assert set(finished) == {"a", "b"}
    assert finished["a"].outputs[0].finish_reason == "error", finished["a"]
    assert len(finished["b"].outputs[0].token_ids) == 30
    assert finished["b"].outputs[0].finish_reason == "length"


def test_abort_mode_is_refused_for_several_kv_cache_groups(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(Exception) as info, H.vllm_engine(checkpoints["gemma3"],
                                                         canary={"mode": "abort"}):  # fmt: skip
        pass
    chain = [str(e) for e in H.error_chain(info.value)]
    assert any("one KV cache group" in x for x in chain), chain


def _flip_first_k_byte(llm: Any, rid: str) -> Any:
    """Flip the first K byte of the first slot of request ``rid``'s second block (layer 0 of
    the first KV cache group, KV head 0: K is stored transposed, so element 0 of slot 0 is
    the block's first byte) in vLLM's own cache tensor; returns the connector."""
    conn = H.connector(llm)
    block = H.scheduler(llm).kv_cache_manager.get_block_ids(H.internal_id(llm, rid))[0][1]
    pool = conn.worker.pools[0]
    kv = pool.layers[0]
    raw = kv.view(kv.shape[0], -1).view(torch.uint8)
    raw[block, 0] ^= 0xFF  # slot 0, K element 0 of KV head 0
    return conn


def test_head_runs_in_bind_and_no_layer_calls_the_connector(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM binds the metadata inside the step's forward context, so HEAD runs in
    ``bind_connector_metadata`` and no layer calls ``wait_for_layer_load`` /
    ``save_kv_layer`` (vLLM asks ``has_connector_metadata()`` before every layer; gemma3:
    four layers, four KV cache groups); every group is still verified in every step. A
    host that binds outside a forward context gets HEAD in the first layer's
    ``wait_for_layer_load``, and the later layers skip both calls."""
    import kvcanary.integrations.vllm.connector as connector_module

    calls: list[tuple[int, str, str]] = []
    heads: list[tuple[int, bool]] = []  # (step, inside bind)
    with H.vllm_engine(checkpoints["gemma3"], canary={"mode": "raise"}) as llm:
        conn = H.connector(llm)
        for name in ("wait_for_layer_load", "save_kv_layer"):
            method = getattr(conn, name)

            def spy(layer: str, *a: Any, _m: Any = method, _n: str = name, **k: Any) -> Any:
                calls.append((conn.worker.num_steps, _n, layer))
                return _m(layer, *a, **k)

            setattr(conn, name, spy)
        in_bind = [False]
        bind, before_forward = conn.bind_connector_metadata, conn.worker.before_forward

        def bind_spy(meta: Any) -> None:
            in_bind[0] = True
            try:
                bind(meta)
            finally:
                in_bind[0] = False

        def head_spy(metadata: Any) -> None:
            heads.append((conn.worker.num_steps, in_bind[0]))
            before_forward(metadata)

        conn.bind_connector_metadata, conn.worker.before_forward = bind_spy, head_spy
        first = conn.worker.num_steps
        H.generate(llm, [_prompt(1, 40), _prompt(2, 70)], max_tokens=8)
        steps = conn.worker.num_steps - first
        assert steps >= 8
        assert calls == []
        assert heads == [(s, True) for s in range(first, first + steps)]
        # Without a forward context at bind: HEAD in the first layer's wait_for_layer_load.
        monkeypatch.setattr(connector_module, "is_forward_context_available", lambda: False)
        heads.clear()
        first = conn.worker.num_steps
        H.generate(llm, [_prompt(3, 50)], max_tokens=8)
        steps = conn.worker.num_steps - first
        stats = conn.worker.stats()
    assert steps >= 8
    assert heads == [(s, False) for s in range(first, first + steps)]
    layer0 = calls[0][2]
    assert "layers.0." in layer0
    expected = [(s, n, layer0) for s in range(first, first + steps)
                for n in ("wait_for_layer_load", "save_kv_layer")]  # fmt: skip
    assert calls == expected
    assert stats["violations"] == 0
    for spec, group in zip(conn.specs, stats["groups"], strict=True):
        tag = "HEAD_K_SWA" if spec.sliding_window else "HEAD_K_FULL"
        assert group["verify_entries_by_tag"].get(tag, 0) > 0, (spec, group)
