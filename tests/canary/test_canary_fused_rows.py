"""Fused row launches (:mod:`kvcanary.canary.kernels.fused_rows`): HEAD and TAIL of a CPU forward as
one compiled call each must leave exactly the per-launch path's state: the same ring rows in
the same order, the same records, the same run counters, for faults written straight into
the real engine's state (a KV byte, a req->token entry, an SWA mapping, a lost store)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from canary_testlib import force_split
from engine_utils import make_prompts, start_decoding, tiny_engine

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.kernels import fused_rows


@pytest.fixture(autouse=True)
def quiet_canary_log():
    log = logging.getLogger("kvcanary.canary")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def _run(fused: bool, model: str, canary: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
         split: bool = False) -> dict[str, Any]:  # fmt: skip
    """A decoding batch corrupted between forwards (and one store lost inside a forward);
    everything the canary leaves behind (``split``: verifies on two threads)."""
    with monkeypatch.context() as m:
        if split:
            force_split(m)
        if not fused:
            m.setattr(fused_rows.FusedRowLaunches, "build", staticmethod(lambda *a, **k: None))
        by_arrays = []  # fused HEADs that passed the batch's arrays one by one
        head_nb = fused_rows._head_nb
        m.setattr(fused_rows, "_head_nb", lambda *a: by_arrays.append(1) or head_nb(*a))
        engine = tiny_engine(model=model, swa_full_tokens_ratio=0.5, chunked_prefill_size=24,
                             canary=CanaryConfig(mode="log", swa_divergence_interval=7,
                                                 **canary))  # fmt: skip
        prompts = make_prompts(5, 20, 40, seed=3)
        start_decoding(engine, prompts, max_new_tokens=30)
        runner = engine.runner
        pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
        running = engine.running_requests()
        sub = getattr(pool, "full_kv_pool", pool)
        if not sub.k_buffer:  # every layer sliding: the SWA sub-pool holds the KV
            sub = pool.swa_kv_pool
        for step in range(20):
            undo = None
            if step == 2:  # a byte of request 0's newest committed token, in the first K layer
                slot = int(r2t[running[0].req_pool_idx, running[0].kv_len - 2])
                if sub is not getattr(pool, "full_kv_pool", pool):
                    slot = int(pool.full_to_swa_index_mapping[slot])
                sub.k_buffer[0].view(torch.uint8).view(sub.k_buffer[0].shape[0], -1)[slot, 0] ^= 0xFF
            if step == 5:  # this forward's stores into layer 0 are undone: lost stores
                buf = sub.k_buffer[0]
                old = buf.clone()
                layer = 0 if sub is pool else next(
                    i for i in range(runner.model.config.num_hidden_layers) if pool._sub(i) == (sub, 0))

                def lose(*_: Any, buf: torch.Tensor = buf, old: torch.Tensor = old) -> None:
                    buf.copy_(old)

                undo = runner.model.layers[layer].self_attn.register_forward_hook(lose).remove
            if step == 8:  # request 1's position 3 -> request 2's slot of position 4
                r2t[running[1].req_pool_idx, 3] = r2t[running[2].req_pool_idx, 4]
            if step == 11 and hasattr(pool, "full_to_swa_index_mapping"):  # an in-window hole
                row = running[3].req_pool_idx
                pool.full_to_swa_index_mapping[int(r2t[row, running[3].kv_len - 2])] = 0
            engine.step()
            if undo is not None:
                undo()
        engine.canary.flush()
        sfm = engine.canary.single_forward_managers[0]
        assert isinstance(sfm._fused, fused_rows.FusedRowLaunches) == fused  # the path ran
        # Every forward reaches fused HEAD / TAIL as a batch block (the token table in it
        # when tokens are verified); the graph runner's decode batches as one made once,
        # unless tokens are verified (the table's lengths change every step).
        assert by_arrays == []
        block = sfm._host_cache is not None and sfm._host_cache[2] is not None
        assert not fused or block == (not canary.get("verify_tokens", False))
        rt = engine.canary.runtime
        return {
            "rows": engine.canary.violations, "overflow_steps": rt.num_verify_overflow_steps,
            "ring": rt.ring.rows.clone(), "index": int(rt.ring.write_index),
            "records": [b.clone() for g in engine.canary.groups for b in g.buffers()],
            "totals": rt.verify_totals.totals.tolist(),  # the SWA divergence reporter's
            "counters": [c.clone() for c in (rt.verify_counters.kernel_runs,
                                             rt.verify_counters.slots_processed,
                                             rt.write_counters.kernel_runs,
                                             rt.write_counters.slots_processed)],
        }  # fmt: skip


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha", "builtin:tiny-swa-all"])
@pytest.mark.parametrize("canary", [
    dict(real_data="partial", verify_tokens=True),
    dict(real_data="partial"),  # decode through the batch block
    dict(real_data="all", v_half=True, verify_capacity=150),  # some verifies overflow
], ids=["partial-tokens", "partial", "all-v-half-overflow"])  # fmt: skip
def test_fused_launches_leave_exactly_the_per_launch_state(
    model: str, canary: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _run(False, model, canary, monkeypatch)
    for split in (False, True):  # fused, then fused with its verifies split among threads
        _check_same(_run(True, model, canary, monkeypatch, split), want, model, canary)


def _check_same(got: dict[str, Any], want: dict[str, Any], model: str,
                canary: dict[str, Any]) -> None:  # fmt: skip
    reasons = {reason for r in want["rows"] for reason in r.fail_reasons}
    assert "write_kv_store" in reasons  # the faults were seen
    if "verify_capacity" in canary:  # verifies skipped (too many entries), writes checked
        assert want["overflow_steps"] > 0
    else:
        assert "verify_real_kv_hash" in reasons
        if model != "builtin:tiny-mha":
            assert "verify_not_resident" in reasons
    assert got["overflow_steps"] == want["overflow_steps"]
    assert got["totals"] == want["totals"] and sum(want["totals"]) > 0
    assert got["rows"] == want["rows"] and got["index"] == want["index"]
    assert torch.equal(got["ring"], want["ring"])
    assert all(torch.equal(a, b) for a, b in zip(got["records"], want["records"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got["counters"], want["counters"], strict=True))


def test_plan_errors_leave_no_trace_and_name_the_problem() -> None:
    """A plan that fails in HEAD's first phase raises the row planner's error before any
    launch touched the ring or the counters."""
    engine = tiny_engine(model="builtin:tiny-swa", canary=CanaryConfig(mode="log"))
    start_decoding(engine, make_prompts(2, 10, 20, seed=1))
    rt = engine.canary.runtime
    before = (int(rt.ring.write_index), rt.verify_counters.kernel_runs.clone())
    r2t = engine.runner.req_to_token_pool.req_to_token
    row = engine.running_requests()[0].req_pool_idx
    r2t[row, 0] = r2t.numel() * 1000  # a slot far outside the SWA mapping
    with pytest.raises(IndexError, match="slot out of range of the LUT"):
        engine.step()
    assert int(rt.ring.write_index) == before[0]
    assert torch.equal(rt.verify_counters.kernel_runs, before[1])


def test_entry_point_runs_the_compiled_function_without_the_dispatcher() -> None:
    """What fused HEAD / TAIL and the store check call instead of the dispatcher: the same
    compiled function (here the ring writer), typed once; a wrapper that is not a numba
    dispatcher (a profiler's) is called as it is."""
    import numpy as np

    from kvcanary.canary.kernels.numba_kernels import _record, entry_point

    ring, index = np.zeros((2, 8), dtype=np.int64), np.zeros(1, dtype=np.int64)
    args = (ring, index, 11, 12, 13, 14, 15, 16, 17, 18)
    run = entry_point(_record, *args)
    assert run is not _record and not hasattr(run, "compile")
    run(*args)
    run(*args)
    run(*args)  # a full ring counts the row it drops
    assert index[0] == 3 and ring.tolist() == [[11, 12, 13, 14, 15, 16, 17, 18]] * 2

    def wrapper(*a: Any) -> None:
        return None

    assert entry_point(wrapper, 1, 2) is wrapper


def test_batch_block_describes_int64_contiguous_batches_only() -> None:
    """The batch block (made per prefill forward by one compiled call) holds each array's
    address and length; an array it cannot describe (another dtype, strided) gives None
    and the forward passes its arrays one by one."""
    import numpy as np

    from kvcanary.canary.plan.rows import HostInputs

    r2t = np.zeros((4, 8), dtype=np.int32)
    arrays = [np.arange(k, k + 3, dtype=np.int64) for k in range(6)]

    def host(arrs: list[Any]) -> HostInputs:
        return HostInputs(r2t, *arrs, None, None, None, None)

    block = fused_rows.FusedRowLaunches.batch_block(host(arrays))
    assert block is not None
    # Block order: rows, prefix, extend, out_cache_loc, input_ids, positions (HostInputs
    # holds out_cache_loc last), then the token table (here placeholders, flag 0).
    order = [arrays[i] for i in (0, 1, 2, 5, 3, 4)]
    words = [w for a in order for w in (a.ctypes.data, 3)]
    empty, empty_lens = fused_rows._EMPTY_TABLE, fused_rows._EMPTY_LENS
    assert block.tolist() == words + [empty.ctypes.data, 1, 1, empty_lens.ctypes.data, 1, 0]
    table, lens = np.zeros((4, 8), dtype=np.int64), np.arange(3, dtype=np.int64)
    with_table = HostInputs(r2t, *arrays, table, lens, None, None)
    block = fused_rows.FusedRowLaunches.batch_block(with_table)
    assert block is not None
    assert block.tolist() == words + [table.ctypes.data, 4, 8, lens.ctypes.data, 3, 1]
    wide = np.zeros(6, dtype=np.int64)
    for bad in (arrays[0].astype(np.int32), wide[::2]):
        assert fused_rows.FusedRowLaunches.batch_block(host([bad, *arrays[1:]])) is None
    for bad_table, bad_lens in ((table.astype(np.int32), lens), (table[:, ::2], lens),
                                (table, lens.astype(np.int32))):  # fmt: skip
        bad_host = HostInputs(r2t, *arrays, bad_table, bad_lens, None, None)
        assert fused_rows.FusedRowLaunches.batch_block(bad_host) is None
    assert fused_rows.FusedRowLaunches.batch_block(
        HostInputs(r2t, *arrays, None, None, arrays[0], arrays[1])) is None  # input assertion


def test_block_reads_real_kv_words_that_are_column_ranges_of_wider_rows() -> None:
    """A real-KV source whose words are a column range of a wider tensor's rows (vLLM's CPU
    layout: one head's V rows of each block, between the other heads' and the K rows) goes
    into the block as (address, rows, row stride): read back in a compiled call, its
    fingerprints are the ones the per-launch kernels compute from the strided array (and
    not those of the rows packed side by side, which ignoring the stride would read).
    Words that are not int64 rows with contiguous words are refused by name."""
    import numba
    import numpy as np

    from kvcanary.canary.wire.real_kv import NUM_META_COLUMNS, real_kv_hashes_nb

    @numba.njit
    def hashes_through_block(blk, slots, meta):  # type: ignore[no-untyped-def]
        w = fused_rows._a2(blk, 0)
        return real_kv_hashes_nb(slots, w, w, w, w, meta, 1)

    rng = np.random.default_rng(0)
    wide = rng.integers(-(2**62), 2**62, size=(7, 40), dtype=np.int64)
    words = wide[:, 8:24]  # 7 blocks of 2 slots x 8 words, 40 words apart
    assert not words.flags.c_contiguous
    meta = np.zeros((4, NUM_META_COLUMNS), dtype=np.int64)
    meta[0] = (2, 64, 6, 8, 8)  # page size, bytes per token, words read, contiguous
    slots = np.array([0, 1, 5, 13, 6, 12], dtype=np.int64)
    blk = np.array(fused_rows._describe_rows(words), dtype=np.int64)
    assert blk.tolist() == [words.ctypes.data, 7, 40]
    want = real_kv_hashes_nb(slots, words, words, words, words, meta, 1)
    got = hashes_through_block(blk, slots, meta)
    assert np.array_equal(got, want)
    packed = np.ascontiguousarray(words)
    assert fused_rows._describe_rows(packed)[1:] == (7, 16)
    assert not np.array_equal(hashes_through_block(
        np.array((words.ctypes.data, 7, 16), dtype=np.int64), slots, meta), want)  # fmt: skip
    for bad in (wide[:, ::2], wide.astype(np.int32), wide[:, 8]):
        with pytest.raises(ValueError, match="real-KV words are not int64 rows"):
            fused_rows._describe_rows(bad)
