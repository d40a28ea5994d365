"""Lost and misdirected KV stores (item 3 of the detection-gap campaign): TAIL used to
fingerprint the pool after the forward, so a store that never happened left stale bytes it
then blessed. Faults are written into the real engine (a forward hook on an attention
module, the attention backend's store call), not through perturb."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_utils import make_prompts, start_decoding, tiny_engine

from kvcanary import Engine, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.forward import SingleForwardManager

PROMPTS = make_prompts(3, 44, 60, seed=5)
MODELS = ["builtin:tiny-mha", "builtin:tiny-swa"]


CASES = [("builtin:tiny-mha", "FULL"), ("builtin:tiny-swa", "FULL"), ("builtin:tiny-swa", "SWA")]


def _first_layer(engine: Engine, group: str) -> tuple[int, torch.Tensor]:
    """(global layer id, K buffer) of the group's first layer: the fingerprinted one."""
    pool = engine.runner.token_to_kv_pool
    if not engine.runner.is_swa:
        return 0, pool.k_buffer[0]
    sub = pool.full_kv_pool if group == "FULL" else pool.swa_kv_pool
    layer = next(i for i in range(engine.runner.model.config.num_hidden_layers)
                 if pool._sub(i) == (sub, 0))  # fmt: skip
    return layer, sub.k_buffer[0]


def _group_slot(engine: Engine, group: str, full_slot: int) -> int:
    if group == "FULL":
        return full_slot
    return int(engine.runner.token_to_kv_pool.full_to_swa_index_mapping[full_slot])


def _lose_the_store_of(engine: Engine, group: str, slot: int) -> Callable[[], None]:
    """A forward hook on the group's first attention layer that puts back the slot's old
    bytes right after attention stored them: the store of that token never happened."""
    layer, buf = _first_layer(engine, group)
    old = buf[slot].clone()

    def hook(*_: Any) -> None:
        buf[slot] = old

    handle = engine.runner.model.layers[layer].self_attn.register_forward_hook(hook)
    return handle.remove


@pytest.mark.parametrize(("model", "group"), CASES)
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_a_lost_store_is_a_tail_kv_store_violation(
    model: str, group: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCANARY_KV_CANARY_KERNEL_BACKEND", backend)
    engine = tiny_engine(model=model, canary=CanaryConfig(mode="log", real_data="partial"),
                         graph_batch_sizes=())  # fmt: skip
    start_decoding(engine, PROMPTS)
    a = engine.running_requests()[1]
    if a.kv_len % 4 == 0:  # the next token must continue a's current page (page size 4)
        engine.step()
        a = engine.running_requests()[1]
    row = engine.runner.req_to_token_pool.req_to_token[a.req_pool_idx]
    full_slot = int(row[a.kv_len - 1]) + 1  # where the next decode writes position kv_len
    slot = _group_slot(engine, group, int(row[a.kv_len - 1])) + 1
    undo = _lose_the_store_of(engine, group, slot)
    engine.step()
    undo()
    assert int(row[a.kv_len]) == full_slot
    rows = engine.canary.violations
    assert [(r.launch_tag, r.fail_reasons, r.slot_idx, r.position) for r in rows] == [
        (f"TAIL_K_{group}", ("write_kv_store",), slot, a.kv_len)
    ]
    assert rows[0].stored_chain_hash != rows[0].expected_aux  # pool fingerprint vs stored one
    # The record now holds what should be there: every later step reports the stale slot.
    engine.step()
    later = [r for r in engine.canary.violations[1:] if r.slot_idx == slot]
    assert later and all(r.fail_reasons == ("verify_real_kv_hash",) for r in later)


@pytest.mark.parametrize("after", ["after_forward", "tail+end_forward"])
def test_graph_runner_decode_takes_the_fast_head_and_still_checks_stores(
    after: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step of the graph runner's persistent batch arrays seen before runs HEAD
    through ``SingleForwardManager.fast_head`` (not the full pre-ops) and TAIL through its
    fused launches, whether the host closes the forward with ``after_forward`` or with
    ``tail`` + ``end_forward``; the store check still runs there (a lost store is
    reported), and a perturber attached mid-run takes the full path again (its pre-forward
    hook runs)."""
    engine = tiny_engine(model="builtin:tiny-swa", graph_batch_sizes=(4,),
                         canary=CanaryConfig(mode="log", real_data="partial"))  # fmt: skip
    canary = engine.canary
    if after != "after_forward":
        monkeypatch.setattr(canary, "after_forward",
                            lambda fb: (canary.tail(fb), canary.end_forward(fb)))  # fmt: skip
    start_decoding(engine, PROMPTS)
    engine.step()  # a decode step of the bucket-4 arrays: the next one can take the fast path
    full: list[Any] = []
    original = SingleForwardManager.pre_ops_maybe_inside_graph
    monkeypatch.setattr(SingleForwardManager, "pre_ops_maybe_inside_graph",
                        lambda self, fb, *a: full.append(fb) or original(self, fb, *a))  # fmt: skip
    a = engine.running_requests()[1]
    while a.kv_len % 4 == 0:  # the next token must continue a's current page (page size 4)
        engine.step()
        a = engine.running_requests()[1]
    row = engine.runner.req_to_token_pool.req_to_token[a.req_pool_idx]
    slot = int(row[a.kv_len - 1]) + 1
    undo = _lose_the_store_of(engine, "FULL", slot)
    engine.step()
    undo()
    assert full == [] and engine.scheduler.graph_runner.num_replays > 0
    assert [(r.launch_tag, r.fail_reasons, r.slot_idx) for r in engine.canary.violations] == [
        ("TAIL_K_FULL", ("write_kv_store",), slot)
    ]

    calls: list[str] = []

    class Recorder:
        def pre_forward(self, batch: Any) -> None:
            calls.append("pre_forward")

        def post_forward(self, batch: Any) -> None:
            calls.append("post_forward")

        def end_step(self) -> None:
            calls.append("end_step")

    canary.perturber = Recorder()
    steps = canary.step
    engine.step()
    assert calls == ["pre_forward", "post_forward", "end_step"] and len(full) == 1
    assert canary.step == steps + 1 and not canary.forward_open


@pytest.mark.parametrize(("model", "group"), CASES)
def test_a_misdirected_store_is_caught_although_records_are_right(
    monkeypatch: pytest.MonkeyPatch, model: str, group: str
) -> None:
    """Two tokens' store targets swapped inside attention (the unfused layer's store):
    each slot holds self-consistent bytes, only not its own token's."""
    monkeypatch.setenv("KVCANARY_CPU_DECODE", "eager")  # (the store through _write, below)
    engine = tiny_engine(model=model, canary=CanaryConfig(mode="log", real_data="partial"),
                         graph_batch_sizes=())  # fmt: skip
    start_decoding(engine, PROMPTS)
    layer_id, _ = _first_layer(engine, group)
    backend = engine.runner.attn_backend
    original = backend._write
    calls = []

    def swapped(layer: Any, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        if layer.layer_id == layer_id and loc.shape[0] >= 2:
            loc = loc.clone()
            loc[[0, 1]] = loc[[1, 0]]
            calls.append(loc.tolist())
        return original(layer, loc, k, v)

    backend._write = swapped
    # The store through _write (the fused CPU decode layer stores in its kernel: a store
    # changed after it is test_fused_decode_layer_beside_the_store_check's).
    backend.rope_forward = lambda *a: None
    engine.step()
    backend._write = original
    del backend.rope_forward
    assert calls
    rows = engine.canary.violations
    assert rows and {r.fail_reasons for r in rows} == {("write_kv_store",)}
    assert {r.launch_tag for r in rows} == {f"TAIL_K_{group}"}
    assert {r.slot_idx for r in rows} == set(calls[0][:2])


@pytest.mark.parametrize("model", MODELS)
def test_clean_runs_with_every_real_data_mode_are_silent(model: str) -> None:
    for real_data, v_half, layers in (("partial", False, "first"), ("all", True, "all")):
        canary = CanaryConfig(mode="raise", real_data=real_data, v_half=v_half,
                              real_data_layers=layers)
        engine = tiny_engine(model=model, canary=canary,
                             chunked_prefill_size=16, graph_batch_sizes=(1, 2, 4))  # fmt: skip
        outs = engine.generate(make_prompts(4, 40, 70, shared=16, seed=1),
                               SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert len(outs) == 4 and engine.canary.stats()["violations"] == 0
        checker = engine.canary.runtime.store_checker
        assert checker is not None and len(checker.watches) == (2 if v_half else 1) * (
            2 if engine.runner.is_swa else 1
        )


def _watch(read_bytes: int, row_bytes: int) -> Any:
    """A CPU store watch with one real-KV source of ``row_bytes`` per token."""
    from kvcanary.canary.kernels.store_check import StoreChecker, StoreWatch
    from kvcanary.canary.wire.real_kv import RealKvSource

    buf = torch.zeros(64, row_bytes, dtype=torch.uint8)
    watch = StoreWatch(7, torch.zeros(64, 4, dtype=torch.int64), (RealKvSource(buf, 1, row_bytes, read_bytes),))
    checker = StoreChecker([watch])
    return checker, watch


@pytest.mark.parametrize("read_bytes", [16, 256, 1040])
@pytest.mark.parametrize("layout", ["qkv-view", "contiguous-3d", "contiguous-2d", "one-row",
                                    "strided-inner", "float64", "int32-slots", "empty"])  # fmt: skip
def test_observe_folds_each_token_rows_as_a_contiguous_copy_would(
    layout: str, read_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode stores arrive as views of the QKV projection and are read in place; every other
    layout takes the copying path. Either way: the fold of each token's first read bytes and
    its slot, and the watch stamped with this forward's epoch. 256 / 1040 bytes: rows folded
    32 / 16 tokens a pass through register transposes (11 tokens: a partial pass; 1040: two
    words past the last whole line)."""
    from kvcanary.canary.wire.hashing import fold_real_kv_words_t

    # 256-byte float32 rows; 1088-byte ones for the 1040-byte window
    heads, dim, n = 2, 32 if read_bytes <= 256 else 136, 11
    gen = torch.Generator().manual_seed(len(layout) + read_bytes)
    dtype = torch.float64 if layout == "float64" else torch.float32
    if layout == "float64":
        dim //= 2
    qkv = torch.randn(n, 3 * heads * dim, generator=gen, dtype=dtype)
    kv = {
        "qkv-view": qkv[:, heads * dim : 2 * heads * dim].view(n, heads, dim),
        "contiguous-3d": qkv[:, : heads * dim].reshape(n, heads, dim).clone(),
        "contiguous-2d": qkv[:, : heads * dim].clone(),
        "one-row": qkv[:1, heads * dim : 2 * heads * dim].view(1, heads, dim),
        "strided-inner": qkv[:, : 2 * heads * dim : 2].view(n, heads, dim),  # every other element
        "float64": qkv[:, heads * dim : 2 * heads * dim].view(n, heads, dim),
        "int32-slots": qkv[:, heads * dim : 2 * heads * dim].view(n, heads, dim),
        "empty": qkv[:0, heads * dim : 2 * heads * dim].view(0, heads, dim),
    }[layout]
    rows = kv.shape[0]
    loc = torch.arange(3, 3 + rows, dtype=torch.int32 if layout == "int32-slots" else torch.int64)
    checker, watch = _watch(read_bytes, heads * dim * kv.element_size())
    if layout not in ("strided-inner", "int32-slots"):  # read in place: no copying path
        from kvcanary.canary.kernels import store_check

        def copying(*_: Any) -> None:
            raise AssertionError(f"{layout}: took the copying path")

        monkeypatch.setattr(store_check, "_observe_rows_nb", copying)
    checker.begin_forward(rows)
    checker.observe(watch, 0, loc, kv, dtype)
    assert watch.armed and watch.stamp[0] == checker.epoch
    if rows:
        words = kv.contiguous().reshape(rows, -1).view(torch.int64)[:, : read_bytes // 8]
        assert torch.equal(watch.intended[0, :rows], fold_real_kv_words_t(words))
        assert torch.equal(watch.target[0, :rows], loc.to(torch.int64))


def test_observe_of_a_store_that_misses_the_forward_tokens_is_unaligned() -> None:
    checker, watch = _watch(16, 256)
    checker.begin_forward(4)
    qkv = torch.randn(3, 192)
    checker.observe(watch, 0, torch.arange(3), qkv[:, 64:128].view(3, 2, 32), torch.float32)
    assert watch.stamp[0] == checker.epoch
    assert (watch.target[0] == -2).all()  # nothing to align with the 4 tokens


@pytest.mark.parametrize("read_bytes", [16, 256])
@pytest.mark.parametrize("case", ["decode", "one-row", "unaligned", "empty", "misaligned", "overlapping",
                                  "short-rows", "more-rows"])  # fmt: skip
def test_observe_rows_is_observe_from_addresses(case: str, read_bytes: int) -> None:
    """A fused decode layer hands its store over as addresses (observe_rows: the k rows the
    kernel wrote, contiguous; the v rows, views of the QKV projection): the same intended
    folds, targets and stamps as observe of the same rows as tensors, for the K and the V
    watch of a layer; a layout it does not read is refused with nothing touched (the caller
    then observes the tensors)."""
    from kvcanary.canary.kernels.store_check import StoreChecker, StoreWatch
    from kvcanary.canary.wire.real_kv import RealKvSource

    heads, dim = 2, 32
    n = {"one-row": 1, "empty": 0}.get(case, 11)
    row_bytes = heads * dim * 4
    gen = torch.Generator().manual_seed(len(case) + read_bytes)
    qkv = torch.randn(n, 4 * heads * dim, generator=gen)
    k = qkv[:, heads * dim : 2 * heads * dim].reshape(n, heads, dim).clone()  # contiguous
    v = qkv[:, 2 * heads * dim : 3 * heads * dim].view(n, heads, dim)  # rows 1 KiB apart
    loc = torch.arange(5, 5 + n, dtype=torch.int64)

    def checker_of() -> tuple[StoreChecker, list[StoreWatch]]:
        buf = torch.zeros(64, row_bytes, dtype=torch.uint8)
        watches = [StoreWatch(tag, torch.zeros(64, 4, dtype=torch.int64),
                              (RealKvSource(buf, 1, row_bytes, read_bytes),)) for tag in (3, 4)]  # fmt: skip
        return StoreChecker(watches), watches

    by_rows, rows_watches = checker_of()
    entry = by_rows._row_entry([(rows_watches[0], 0, True), (rows_watches[1], 0, False)])
    forward_tokens = n + 1 if case == "unaligned" else n
    by_rows.begin_forward(forward_tokens)
    k_addr, k_step, v_addr, v_step = k.data_ptr(), row_bytes, v.data_ptr(), qkv.stride(0) * 4
    rows, size = n, row_bytes
    if case == "misaligned":
        k_addr += 4
    elif case == "overlapping":
        v_step = row_bytes - 8
    elif case == "short-rows":
        size = read_bytes - 8
    elif case == "more-rows":
        rows = n + 1
    taken = by_rows.observe_rows(entry, n, loc.data_ptr(), rows, k_addr, k_step, v_addr, v_step, size)
    if case in ("misaligned", "overlapping", "short-rows", "more-rows"):
        assert not taken
        assert all(not w.armed and (w.stamp == -1).all() for w in rows_watches)
        assert all((w.target == -2).all() and (w.intended == 0).all() for w in rows_watches)
        return
    assert taken
    by_tensors, tensor_watches = checker_of()
    by_tensors.begin_forward(forward_tokens)
    by_tensors.observe(tensor_watches[0], 0, loc, k, torch.float32)
    by_tensors.observe(tensor_watches[1], 0, loc, v, torch.float32)
    for got, want in zip(rows_watches, tensor_watches, strict=True):
        assert got.armed and want.armed and got.stamp[0] == by_rows.epoch == want.stamp[0]
        assert torch.equal(got.intended, want.intended) and torch.equal(got.target, want.target)
    if case == "unaligned":
        assert all((w.target == -2).all() for w in rows_watches)
    elif n:  # the K and V watches folded different rows
        assert not torch.equal(rows_watches[0].intended[0, :n], rows_watches[1].intended[0, :n])
        assert torch.equal(rows_watches[0].target[0, :n], loc)


def test_observe_rows_follows_the_scratch_as_forwards_grow() -> None:
    """A forward with more tokens than the watches' scratch holds reallocates it: the layer's
    row-observe block then points at the new rows (begin_forward rewrites it)."""
    checker, watch = _watch(16, 256)
    entry = checker._row_entry([(watch, 0, True)])
    old = watch.intended
    n = old.shape[1] + 3
    checker.begin_forward(n)
    assert watch.intended is not old and watch.intended.shape[1] >= n
    k = torch.randn(n, 64)
    loc = torch.arange(1, n + 1, dtype=torch.int64)
    assert checker.observe_rows(entry, n, loc.data_ptr(), n, k.data_ptr(), 256, k.data_ptr(), 256, 256)
    assert torch.equal(watch.target[0, :n], loc)
    from kvcanary.canary.wire.hashing import fold_real_kv_words_t

    assert torch.equal(watch.intended[0, :n], fold_real_kv_words_t(k.view(torch.int64)[:, :2]))
