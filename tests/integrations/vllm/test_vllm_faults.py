"""Fault campaign against a real vLLM: each fault is injected into vLLM's own state (the
worker's block table and KV cache tensors, the scheduler's block pool and its hash -> block
map, the sliding-window manager's blocks) between two engine steps, and the canary must
report it with the expected tag and reason in the very next step.

    fault                                   where it is injected
    block-table entry -> another live block worker: input_batch.block_table (group 0)
    KV byte flipped in a live block         worker: the layer's KV cache tensor
    KV byte flipped in a cached free block  worker tensor; the block only in the prefix cache
    phantom prefix hit                      scheduler: block_pool.cached_block_hash_to_block
    sliding-window block reused in window   scheduler: SlidingWindowManager frees a block
                                            still inside a running request's window (with
                                            real_data none too: the HEAD alias check)
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import vllm_harness as H

from kvcanary.canary.explain import explain

CANARY = {"mode": "log", "real_data": "all", "verify_tokens": True}
RESULTS: dict[str, dict[str, Any]] = {}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


def _new_rows(conn: Any, before: int) -> list[Any]:
    conn.worker.flush()
    return conn.worker.violations[before:]


def _steps_to_detection(llm: Any, conn: Any, before: int, limit: int = 3) -> tuple[int, list[Any]]:
    for i in range(1, limit + 1):
        H.step(llm)
        rows = _new_rows(conn, before)
        if rows:
            return i, rows
    return 0, []


def _record(name: str, steps: int, rows: list[Any], want_tags: set[str], want_reason: str,
            slots: set[int] | None, log: str) -> None:  # fmt: skip
    """Check the rows, and that ``kvcanary explain`` reads the logged lines back."""
    analysis = explain(log)
    assert analysis["violations"] >= len(rows) > 0 and not analysis["unparsed"]
    hits = [r for r in rows if r.launch_tag in want_tags and want_reason in r.fail_reasons
            and (slots is None or r.slot_idx in slots)]  # fmt: skip
    RESULTS[name] = {
        "steps": steps,
        "rows": len(rows),
        "tags": sorted({r.launch_tag for r in hits}),
        "reasons": sorted({x for r in hits for x in r.fail_reasons}),
        "first": None if not hits else H_line(hits[0]),
        "explain": [c["cause"] for c in analysis["causes"]][:2],
    }
    assert steps == 1, (name, steps, rows[:3])
    assert hits, (name, [(r.launch_tag, r.fail_reasons, r.slot_idx) for r in rows[:5]])


def H_line(row: Any) -> str:  # noqa: N802 (reads as the log line it mirrors)
    return (f"{row.launch_tag} {'+'.join(row.fail_reasons)} slot={row.slot_idx} "
            f"position={row.position}")  # fmt: skip


def _decoding(llm: Any, prompts: dict[str, list[int]], max_tokens: int, steps: int) -> None:
    for rid, p in prompts.items():
        H.add_request(llm, rid, p, max_tokens)
    for _ in range(steps):
        H.step(llm)


# --------------------------------------------------------------------------- full attention


def test_block_table_entry_points_at_another_live_block(checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    with H.vllm_engine(checkpoints["llama"], canary=CANARY) as llm:
        _decoding(llm, {"a": _prompt(1, 100), "b": _prompt(2, 90)}, 40, 3)
        conn, w = H.connector(llm), H.worker(llm)
        batch = w.model_runner.input_batch
        a, b = H.internal_id(llm, "a"), H.internal_id(llm, "b")
        table = batch.block_table.block_tables[0].block_table
        ra, rb = batch.req_id_to_index[a], batch.req_id_to_index[b]
        victim = int(table.cpu[rb, 1])
        assert victim != int(table.cpu[ra, 1]) and victim != 0
        before = len(conn.worker.violations)
        table.cpu[ra, 1] = victim  # a reads b's block for its positions 32..63
        steps, rows = _steps_to_detection(llm, conn, before)
        bs = H.BLOCK_SIZE
        _record("block-table entry -> another live block", steps, rows, {"HEAD_K_FULL"},
                "verify_chain_hash", set(range(victim * bs, (victim + 1) * bs)), caplog.text)  # fmt: skip


def test_cpu_attention_isa_is_the_one_vllm_picked(checkpoints: dict[str, Path]) -> None:
    """The ISA the connector predicts for each group (which decides whether the canary can
    read the group's KV layout) is the one vLLM's CPU attention set on its layers."""
    with H.vllm_engine(checkpoints["llama"], canary=CANARY) as llm:
        conn = H.connector(llm)
        ctx = H.worker(llm).model_runner.compilation_config.static_forward_context
        for spec in conn.specs:
            assert spec.cpu_attn_isa in ("vec", "vec16"), spec  # this machine: no AMX
            assert {getattr(ctx[n], "isa", None) for n in spec.layer_names} == {spec.cpu_attn_isa}
            assert conn.worker.pools[spec.index].layers[0].dim() == 4  # the CPU layout


def test_kv_byte_flipped_in_live_block(checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    with H.vllm_engine(checkpoints["llama"], canary=CANARY) as llm:
        _decoding(llm, {"a": _prompt(3, 100)}, 40, 3)
        conn = H.connector(llm)
        block = H.scheduler(llm).kv_cache_manager.get_block_ids(H.internal_id(llm, "a"))[0][1]
        before = len(conn.worker.violations)
        # HEAD / TAIL run fused (one compiled call each): the real-KV words, one head's K
        # tile of each block of vLLM's CPU layout, are read through their row stride.
        from kvcanary.canary.kernels.fused_rows import FusedRowLaunches

        sfm = conn.worker.managers[0].single_forward_managers[0]
        assert isinstance(sfm._fused, FusedRowLaunches)
        H.flip_k_byte(conn, 0, block, 7, element=-1)  # K's last element (not V)
        steps, rows = _steps_to_detection(llm, conn, before)
        _record("KV byte flipped in a live block", steps, rows, {"TAIL_K_FULL"},
                "verify_real_kv_hash", {block * H.BLOCK_SIZE + 7}, caplog.text)  # fmt: skip


def _finished_blocks(llm: Any, rid: str, prompt: list[int]) -> list[int]:
    """Run ``prompt`` to completion; its group-0 block ids (now free, prefix-cached)."""
    H.add_request(llm, rid, prompt, 2)
    H.step(llm)
    ids = list(H.scheduler(llm).kv_cache_manager.get_block_ids(H.internal_id(llm, rid))[0])
    H.run_until_done(llm)
    pool = H.block_pool(llm)
    for b in ids[: len(prompt) // H.BLOCK_SIZE]:
        assert pool.blocks[b].ref_cnt == 0 and pool.blocks[b].block_hash is not None
    return ids


def test_kv_byte_flipped_in_cached_free_block(checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    with H.vllm_engine(checkpoints["llama"], canary=CANARY) as llm:
        p = _prompt(4, 100)
        ids = _finished_blocks(llm, "p", p)
        conn = H.connector(llm)
        before = len(conn.worker.violations)
        H.flip_k_byte(conn, 0, ids[1], 5)  # no request holds it: only the prefix cache
        H.add_request(llm, "p2", p[:96] + _prompt(5, 20), 4)  # hits the 3 cached blocks
        steps, rows = _steps_to_detection(llm, conn, before)
        _record("KV byte flipped in a prefix-cached free block", steps, rows, {"TAIL_K_FULL"},
                "verify_real_kv_hash", {ids[1] * H.BLOCK_SIZE + 5}, caplog.text)  # fmt: skip


def test_phantom_prefix_hit(checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    with H.vllm_engine(checkpoints["llama"], canary=CANARY) as llm:
        p, q = _prompt(6, 100), _prompt(7, 100)
        p_ids, q_ids = _finished_blocks(llm, "p", p), _finished_blocks(llm, "q", q)
        pool = H.block_pool(llm)
        cache = pool.cached_block_hash_to_block._cache
        (key,) = [k for k, v in cache.items() if getattr(v, "block_id", None) == p_ids[1]]
        cache[key] = pool.blocks[q_ids[1]]  # p's second block now "is" q's (stale map entry)
        tally = H.tally_scheduler(llm)
        conn = H.connector(llm)
        before = len(conn.worker.violations)
        H.add_request(llm, "p2", p[:96] + _prompt(8, 20), 4)
        steps, rows = _steps_to_detection(llm, conn, before)
        assert tally.hit_tokens and tally.hit_tokens[0] == 96
        bs = H.BLOCK_SIZE
        _record("phantom prefix hit (hash map -> reused block)", steps, rows, {"HEAD_K_FULL"},
                "verify_token", set(range(q_ids[1] * bs, (q_ids[1] + 1) * bs)), caplog.text)  # fmt: skip


# --------------------------------------------------------------------------- sliding window


def _reuse_window_block(llm: Any) -> tuple[Any, int, int]:
    """Decode ``a`` into its window, free a block its window still covers (the injected
    bug: window eviction frees it early) and add ``b``, whose prefill this very step is
    handed the block. (connector, violations before, victim block id)."""
    _decoding(llm, {"a": _prompt(9, 60)}, 60, 12)  # a decodes at ~71: window 64..71
    sched = H.scheduler(llm)
    a = H.internal_id(llm, "a")
    conn = H.connector(llm)
    g = next(s.index for s in conn.specs if s.sliding_window is not None)
    manager = sched.kv_cache_manager.coordinator.single_type_managers[g]
    k = sched.requests[a].num_computed_tokens
    idx = (k - 1) // H.BLOCK_SIZE  # holds position k - 1: inside a's window
    blocks = manager.req_to_blocks[a]
    victim = blocks[idx]
    pool = H.block_pool(llm)
    before = len(conn.worker.violations)
    pool.free_blocks([victim])
    blocks[idx] = pool.null_block
    H.add_request(llm, "b", _prompt(10, 40), 4)  # the next allocation reuses it
    return conn, before, victim.block_id


def test_sliding_window_block_reused_inside_window(checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    with H.vllm_engine(checkpoints["gemma3"], canary=CANARY) as llm:
        conn, before, victim = _reuse_window_block(llm)
        steps, rows = _steps_to_detection(llm, conn, before)
        bs = H.BLOCK_SIZE
        _record("sliding-window block reused while in a window", steps, rows,
                {"HEAD_K_SWA", "TAIL_K_SWA"}, "verify_real_kv_hash",
                set(range(victim * bs, (victim + 1) * bs)), caplog.text)  # fmt: skip


def test_sliding_window_block_reused_in_one_forward_without_fingerprints(
        checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """The same fault with ``real_data none``: b's store overwrites the block a reads in the
    same forward; HEAD writes b's records before it verifies a's reads (the alias check),
    so a's read of the reused block fails its position check in that step."""
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    with H.vllm_engine(checkpoints["gemma3"], canary={**CANARY, "real_data": "none"}) as llm:
        conn, before, victim = _reuse_window_block(llm)
        steps, rows = _steps_to_detection(llm, conn, before)
        bs = H.BLOCK_SIZE
        _record("sliding-window block reused in one forward (real_data none)", steps, rows,
                {"HEAD_K_SWA"}, "verify_position", set(range(victim * bs, (victim + 1) * bs)),
                caplog.text)  # fmt: skip


@pytest.mark.parametrize("real_data", ["none", "all"])
def test_hybrid_one_call_heads_leave_the_state_of_the_full_path(
        checkpoints: dict[str, Path], real_data: str) -> None:  # fmt: skip
    """gemma3 (four KV cache groups, three sliding): the worker's per-group compiled HEAD
    (``VllmCanaryWorker._fast_heads``) against the full path, on the same steps with a
    sliding-window block reused while in a window: the same violations in the same order,
    the same stats and records (every group's HEAD and TAIL K); it ran on most steps."""
    import torch

    runs = []
    for fast in (True, False):
        with H.vllm_engine(checkpoints["gemma3"], canary={**CANARY, "real_data": real_data}) as llm:
            conn = H.connector(llm)
            conn.worker._fast_ok = fast
            _reuse_window_block(llm)
            for _ in range(4):
                H.step(llm)
            w = conn.worker
            w.flush()
            records = {bs: (r.k_head.clone(), r.k_tail.clone()) for bs, r in w.records.items()}
            runs.append(([str(v) for v in w.violations], w.stats(), records, w.num_fast_steps))
    (va, sa, ra, na), (vb, sb, rb, nb) = runs
    assert na >= 10 and nb == 0, (na, nb)
    assert va and va == vb
    assert sa == sb
    assert ra.keys() == rb.keys()
    for bs in ra:
        assert torch.equal(ra[bs][0], rb[bs][0]) and torch.equal(ra[bs][1], rb[bs][1]), bs


def test_fault_table() -> None:
    """Print the campaign's table (the closing note's)."""
    if len(RESULTS) < 6:
        pytest.fail(f"fault tests did not all run: {sorted(RESULTS)}")
    print("\n| fault | steps to detection | tags | reasons | first row | explain |")
    print("|---|---|---|---|---|---|")
    for name, r in RESULTS.items():
        print(f"| {name} | {r['steps']} | {', '.join(r['tags'])} | {', '.join(r['reasons'])} "
              f"| {r['first']} | {', '.join(r['explain'])} |")  # fmt: skip
