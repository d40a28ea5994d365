"""kvcanary's canary on SGLang's real pools (``kvcanary.integrations.sglang``).

SGLang 0.5.23's ``MHATokenToKVPool`` (page 1 and 4), ``SWAKVPool`` with its
``SWATokenToKVPoolAllocator`` (page 1 and 4) or ``PureSWATokenToKVPoolAllocator`` (every
layer slides), and ``DeepSeekV4TokenToKVPool`` with every sub-pool (SWA latent, C4, C4
indexer, C128), driven by SGLang's own allocators, ``ReqToTokenPool``, ``ForwardBatch`` and
pool store methods (:mod:`sglang_pool_harness`):

* a clean multi-step run (prefill, chunked prefill, decode, a finished request whose slots
  are reused, SWA window eviction) reports nothing, and every group verified and wrote;
* per sub-pool, corrupting its live KV bytes, one of its records, or the slot table that
  leads to it (req->token entry, full->SWA mapping entry) is reported under that sub-pool's
  tag with the expected fail reason; a misdirected ``set_kv_buffer`` store is reported as
  ``write_kv_store``;
* the records our canary writes on SGLang's MHA / SWA pools are byte-identical to those
  SGLang's own canary (``attach_canary_buffers`` + its ``CanaryManager`` runner, driven on
  this CPU) writes for the same steps.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_pool_harness import (
    DSV4_RATIOS,
    DSV4Serving,
    MHAServing,
    Req,
    Serving,
    SGLangOwnCanary,
    SWAServing,
    layer,
)

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.wire.constants import PoolKind

CONFIG = CanaryConfig(mode="log", real_data="all", v_half=True)


def _group(s: Serving, kind: PoolKind) -> Any:
    assert s.canary is not None
    return next(g for g in s.canary.groups if g.kind == kind)


def _rows(s: Serving) -> list[Any]:
    assert s.canary is not None
    s.canary.flush()
    return s.canary.violations


def _assert_reported(s: Serving, tag: str, reason: str, position: int) -> None:
    """A row with ``tag`` and ``reason`` whose *stored* position is ``position`` (a row
    reports what the record holds: the corrupted position, or the remapped slot's)."""
    rows = _rows(s)
    hits = [r for r in rows if r.launch_tag == tag and reason in r.fail_reasons
            and r.position == position]  # fmt: skip
    assert hits, f"no {tag} {reason} row at position {position}; got {rows}"


# ---------------------------------------------------------------------- clean runs

CLEAN = {
    "mha-page1": lambda: MHAServing.make(page_size=1, config=CONFIG),
    "mha-page4": lambda: MHAServing.make(page_size=4, config=CONFIG),
    "swa-page1": lambda: SWAServing.make(page_size=1, config=CONFIG),
    "swa-page4": lambda: SWAServing.make(page_size=4, config=CONFIG),
    "swa-all-sliding": lambda: SWAServing.make(page_size=1, pure=True, config=CONFIG),
}


@pytest.mark.parametrize("name", list(CLEAN))
def test_clean_run_mha_swa(name: str) -> None:
    s = CLEAN[name]()
    s.run_session()
    assert s.canary is not None
    assert _rows(s) == []
    stats = s.canary.stats()
    kinds = ["FULL"] + (["SWA"] if name.startswith("swa") else [])
    for kind in kinds:
        for tag in (f"HEAD_K_{kind}", f"TAIL_K_{kind}", f"HEAD_V_{kind}", f"TAIL_V_{kind}"):
            assert stats["verify_entries_by_tag"][tag] > 0, tag
            assert stats["write_entries_by_tag"][tag] > 0, tag
    checker = s.canary.runtime.store_checker
    assert checker is not None and checker.watches
    assert all(w.armed for w in checker.watches)  # SGLang's set_kv_buffer was watched
    if name == "swa-page4":  # the window's tail was evicted through SGLang's allocator
        assert int((s.pool.full_to_swa_index_mapping[:-1] == 0).sum()) > 0


DSV4_KINDS = ["SWA", "C4", "INDEXER", "C128", "C4_STATE", "INDEXER_STATE", "C128_STATE"]


def test_clean_run_dsv4_every_sub_pool() -> None:
    s = DSV4Serving.make(config=CONFIG)
    assert s.canary is not None
    assert [g.kind.name for g in s.canary.groups] == DSV4_KINDS
    assert all(g.real_kv_sources_k for g in s.canary.groups)
    s.run_session(lengths=(300, 520, 140), chunk=260, decode_steps=5)
    assert _rows(s) == []
    stats = s.canary.stats()
    for kind in DSV4_KINDS:
        for tag in (f"HEAD_K_{kind}", f"TAIL_K_{kind}"):
            assert stats["verify_entries_by_tag"][tag] > 0, tag
            assert stats["write_entries_by_tag"][tag] > 0, tag


def test_records_ride_in_sglang_buf_infos() -> None:
    s = MHAServing.make(page_size=4, config=CONFIG)
    ptrs, lens, items = s.pool.get_contiguous_buf_infos()
    g = _group(s, PoolKind.FULL)
    layers = s.pool.layer_num
    assert len(ptrs) == 2 * layers + 4
    assert ptrs[0] == g.k_head.data_ptr() and ptrs[layers + 1] == g.k_tail.data_ptr()
    assert ptrs[layers + 2] == g.v_head.data_ptr() and ptrs[-1] == g.v_tail.data_ptr()
    assert items[0] == 32 * 4
    d = DSV4Serving.make(config=CONFIG)
    state = d.pool.get_state_buf_infos()[0]
    contiguous = d.pool.get_contiguous_buf_infos()[0]
    swa = _group(d, PoolKind.SWA)
    assert state[0] == swa.k_head.data_ptr() and state[len(d.pool.swa_kv_pool.kv_buffer) + 1] \
        == swa.k_tail.data_ptr()  # fmt: skip
    assert contiguous[0] == _group(d, PoolKind.C4).k_head.data_ptr()
    # the rings: C4 and indexer in the state buf-infos (one ring per item), C128 in the
    # request-state buf-infos, each wrapped by its group's records
    state_ptrs, _, state_items = d.pool.get_state_buf_infos()
    at = len(d.pool.swa_kv_pool.kv_buffer) + 2
    c4 = _group(d, PoolKind.C4_STATE)
    c4_rings = [p for p in d.pool.compress_state_pools if p is not None and p.ratio == 4]
    assert state_ptrs[at] == c4.k_head.data_ptr() and state_items[at] == 32 * 8
    assert state_ptrs[at + 1] == c4_rings[0].kv_score_buffer.kv_score.data_ptr()
    assert state_ptrs[at + 1 + len(c4_rings)] == c4.k_tail.data_ptr()
    assert state_ptrs[-1] == _group(d, PoolKind.INDEXER_STATE).k_tail.data_ptr()
    req_ptrs, _, req_items = d.pool.get_request_state_buf_infos()
    c128 = _group(d, PoolKind.C128_STATE)
    assert (req_ptrs[0], req_ptrs[-1], req_items[0]) == (
        c128.k_head.data_ptr(), c128.k_tail.data_ptr(), 32 * 128)  # fmt: skip


# ---------------------------------------------------------------------- corruptions


def _mha_setup(page_size: int = 1) -> tuple[Serving, list[Req]]:
    s = MHAServing.make(page_size=page_size, config=CONFIG)
    a, b = s.new_request(16), s.new_request(16)
    s.forward([(a, 10), (b, 8)])
    s.forward([(a, 1), (b, 1)])
    return s, [a, b]


def _swa_setup(page_size: int = 1) -> tuple[Serving, list[Req]]:
    s = SWAServing.make(page_size=page_size, config=CONFIG, window=4)
    a, b = s.new_request(16), s.new_request(16)
    s.forward([(a, 10), (b, 8)])
    s.forward([(a, 1), (b, 1)])
    return s, [a, b]


def _step(s: Serving, reqs: list[Req]) -> None:
    s.forward([(r, 1) for r in reqs])


def _flip(t: torch.Tensor) -> None:
    t.view(torch.uint8).view(-1)[:1] ^= 0x5A


def _record(g: Any, slot: int) -> torch.Tensor:
    return g.k_head[slot].view(torch.int64)  # (token, position, prev hash, real-KV hash)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("pool", ["mha", "swa"])
def test_full_group_detects_each_corruption(pool: str, page_size: int) -> None:
    """The FULL group (MHA pool, or SWAKVPool.full_kv_pool): a K and a V byte, a record, a
    req->token entry."""
    for what in ("k_bytes", "v_bytes", "record", "req_to_token"):
        s, (a, b) = (_mha_setup if pool == "mha" else _swa_setup)(page_size)
        sub = s.pool if pool == "mha" else s.pool.full_kv_pool
        p = 1  # outside the SWA window: only the FULL group reads it
        slot = a.slots[p]
        tag, reason, stored = "TAIL_K_FULL", "verify_real_kv_hash", p
        if what == "k_bytes":
            _flip(sub.k_buffer[0][slot])
        elif what == "v_bytes":
            _flip(sub.v_buffer[0][slot])
            tag = "TAIL_V_FULL"
        elif what == "record":
            _record(_group(s, PoolKind.FULL), slot)[1] += 1000
            tag, reason, stored = "HEAD_K_FULL", "verify_position", p + 1000
        else:
            s.r2t.req_to_token[a.row, p] = b.slots[5]  # b's position 5 sits there
            tag, reason, stored = "HEAD_K_FULL", "verify_position", 5
        _step(s, [a, b])
        _assert_reported(s, tag, reason, stored)


@pytest.mark.parametrize("page_size", [1, 4])
def test_swa_group_detects_each_corruption(page_size: int) -> None:
    """The SWA group (SWAKVPool.swa_kv_pool): K and V bytes, a record, a mapping entry."""
    for what in ("k_bytes", "v_bytes", "record", "mapping"):
        s, (a, b) = _swa_setup(page_size)
        mapping = s.pool.full_to_swa_index_mapping
        p = a.kv_len - 2  # inside the window of the next forward
        swa_slot = int(mapping[a.slots[p]])
        tag, reason, stored = "TAIL_K_SWA", "verify_real_kv_hash", p
        if what == "k_bytes":
            _flip(s.pool.swa_kv_pool.k_buffer[0][swa_slot])
        elif what == "v_bytes":
            _flip(s.pool.swa_kv_pool.v_buffer[0][swa_slot])
            tag = "TAIL_V_SWA"
        elif what == "record":
            _record(_group(s, PoolKind.SWA), swa_slot)[1] += 1000
            tag, reason, stored = "HEAD_K_SWA", "verify_position", p + 1000
        else:
            mapping[a.slots[p]] = mapping[b.slots[b.kv_len - 1]]  # b's newest SWA slot
            tag, reason, stored = "HEAD_K_SWA", "verify_position", b.kv_len - 1
        _step(s, [a, b])
        _assert_reported(s, tag, reason, stored)
        if what == "mapping":  # the full history is intact
            assert not [r for r in _rows(s) if r.launch_tag.endswith("_FULL")]


def test_all_sliding_swa_pool_detects_corruption() -> None:
    """``PureSWATokenToKVPoolAllocator`` (every layer slides): the layerless full sub-pool
    keeps a records-only FULL group (the whole history's chain), the SWA group the bytes."""
    for what in ("req_to_token", "k_bytes"):
        s = SWAServing.make(page_size=1, pure=True, config=CONFIG, window=4)
        a, b = s.new_request(16), s.new_request(16)
        s.forward([(a, 10), (b, 8)])
        s.forward([(a, 1), (b, 1)])
        assert not s.pool.full_kv_pool.k_buffer
        if what == "req_to_token":
            s.r2t.req_to_token[a.row, 1] = b.slots[5]
            tag, reason, stored = "HEAD_K_FULL", "verify_position", 5
        else:
            p = a.kv_len - 2
            _flip(s.pool.swa_kv_pool.k_buffer[0][int(s.pool.full_to_swa_index_mapping[a.slots[p]])])
            tag, reason, stored = "TAIL_K_SWA", "verify_real_kv_hash", p
        _step(s, [a, b])
        _assert_reported(s, tag, reason, stored)


def _dsv4_setup() -> tuple[DSV4Serving, list[Req]]:
    s = DSV4Serving.make(config=CONFIG)
    a, b = s.new_request(270), s.new_request(30)
    s.forward([(a, 264), (b, 20)])
    s.forward([(a, 1), (b, 1)])
    return s, [a, b]


def _dsv4_row_bytes(sub: Any, buffers: list[torch.Tensor], row: int, bytes_per_token: int,
                    ) -> torch.Tensor:  # fmt: skip
    page, off = divmod(row, sub.page_size)
    return buffers[0][page, off * bytes_per_token : (off + 1) * bytes_per_token]


# sub-pool -> (group kind, ratio, live rows of layer 0, bytes per token, last position of the
# block whose row is corrupted, the position its req->token entry is remapped to)
DSV4_SUB_POOLS: dict[str, tuple[PoolKind, int, Callable[[Any], tuple[Any, list[torch.Tensor]]],
                                int, int, int]] = {  # fmt: skip
    "swa_kv_pool": (PoolKind.SWA, 1, lambda p: (p.swa_kv_pool, p.swa_kv_pool.kv_buffer), 576,
                    -1, -1),
    "c4_kv_pool": (PoolKind.C4, 4, lambda p: (p.kv_pools[4], p.kv_pools[4].kv_buffer), 576,
                   7, 11),
    "c4_indexer_kv_pool": (PoolKind.INDEXER, 4, lambda p: (
        p.index_pools[4], p.index_pools[4].index_k_with_scale_buffer), 128, 7, 11),
    "c128_kv_pool": (PoolKind.C128, 128, lambda p: (p.kv_pools[128], p.kv_pools[128].kv_buffer),
                     576, 127, 255),
}  # fmt: skip


@pytest.mark.parametrize("sub_pool", list(DSV4_SUB_POOLS))
def test_dsv4_sub_pool_detects_each_corruption(sub_pool: str) -> None:
    """Each DeepSeek-V4 sub-pool: a byte of its live rows, a record, and the slot table that
    leads to it (SWA: the full->SWA mapping; compressed: the req->token entry of a block's
    last position, whose full slot // ratio is the block's row)."""
    kind, ratio, live, nbytes, last, other = DSV4_SUB_POOLS[sub_pool]
    for what in ("kv_bytes", "record", "slot_table"):
        s, (a, b) = _dsv4_setup()
        mapping = s.pool.full_to_swa_index_mapping
        sub, buffers = live(s.pool)
        if kind == PoolKind.SWA:
            position = a.kv_len - 2
            row = int(mapping[a.slots[position]])
        else:
            position = last // ratio  # the block index
            row = a.slots[last] // ratio
        tag, reason, stored = f"TAIL_K_{kind.name}", "verify_real_kv_hash", position
        if what == "kv_bytes":
            _flip(_dsv4_row_bytes(sub, buffers, row, nbytes))
        elif what == "record":
            _record(_group(s, kind), row)[1] += 1000
            tag, reason, stored = f"HEAD_K_{kind.name}", "verify_position", position + 1000
        elif kind == PoolKind.SWA:
            mapping[a.slots[position]] = mapping[b.slots[b.kv_len - 1]]
            tag, reason, stored = "HEAD_K_SWA", "verify_position", b.kv_len - 1
        else:  # the block's row is now the one of the block holding position `other`
            s.r2t.req_to_token[a.row, last] = a.slots[other]
            tag, reason, stored = f"HEAD_K_{kind.name}", "verify_position", other // ratio
        _step(s, [a, b])
        _assert_reported(s, tag, reason, stored)
        others = {r.launch_tag for r in _rows(s)} - {
            f"{st}_K_{kind.name}" for st in ("HEAD", "TAIL")
        }
        if what != "slot_table":  # a row's bytes / record belong to one sub-pool only
            assert not others, others


def _ring_of(s: DSV4Serving, kind: PoolKind) -> Any:
    layer = DSV4_RATIOS.index(128 if kind == PoolKind.C128_STATE else 4)
    if kind == PoolKind.INDEXER_STATE:
        return s.pool.get_indexer_compress_states(layer)
    return s.pool.get_attention_compress_states(layer)


def _ring_row(s: DSV4Serving, state: Any, req: Req, position: int) -> int:
    if state.request_scoped:
        loc = state.translate_from_req_position_to_state_loc(torch.tensor([req.row]),
                                                             torch.tensor([position]))  # fmt: skip
    else:
        swa = s.pool.full_to_swa_index_mapping[torch.tensor([req.slots[position]])]
        loc = state.translate_from_swa_loc_to_state_loc(swa)
    return int(loc[0])


@pytest.mark.parametrize("kind", [PoolKind.C4_STATE, PoolKind.INDEXER_STATE, PoolKind.C128_STATE])
def test_dsv4_compress_state_ring_detects_each_corruption(kind: PoolKind) -> None:
    """Each compress-state ring of SGLang's pool (rows located with SGLang's own
    translate functions): a byte of a live-tail row (the ring's first layer, the
    fingerprinted one), a row's record, the state of one token stored into another token's
    row, and (SWA-page rings) the full->SWA mapping that locates the ring."""
    cases = ["kv_bytes", "record", "misdirected_store"]
    if kind != PoolKind.C128_STATE:
        cases.append("slot_table")
    for what in cases:
        s, (a, b) = _dsv4_setup()  # a: 265 tokens; C4 tail 260..264, C128 tail 256..264
        state = _ring_of(s, kind)
        position = a.kv_len - 3  # 262: live in every ring, and stays live one more step
        row = _ring_row(s, state, a, position)
        rows = state.kv_score_buffer.kv_score
        tag, reason, stored = f"TAIL_K_{kind.name}", "verify_real_kv_hash", position
        if what == "kv_bytes":
            _flip(rows[row])
        elif what == "record":
            _record(_group(s, kind), row)[1] += 1000
            tag, reason, stored = f"HEAD_K_{kind.name}", "verify_position", position + 1000
        elif what == "misdirected_store":  # 263's state also landed in 262's row
            rows[row] = rows[_ring_row(s, state, a, position + 1)]
        else:  # 262's SWA slot now maps to b's last position: the ring follows the mapping
            mapping = s.pool.full_to_swa_index_mapping
            mapping[a.slots[position]] = mapping[b.slots[b.kv_len - 1]]
            tag, reason, stored = f"HEAD_K_{kind.name}", "verify_position", b.kv_len - 1
        _step(s, [a, b])
        _assert_reported(s, tag, reason, stored)
        if what in ("kv_bytes", "record", "misdirected_store"):  # this ring's rows only
            assert {r.launch_tag for r in _rows(s)} <= {f"HEAD_K_{kind.name}",
                                                      f"TAIL_K_{kind.name}"}  # fmt: skip


def test_dsv4_dead_ring_rows_are_not_verified() -> None:
    """A row outside every live tail (position 100 of a 265-token request: its C4 and
    C128 windows compressed long ago) may hold anything: no false positive."""
    s, (a, b) = _dsv4_setup()
    for kind in (PoolKind.C4_STATE, PoolKind.INDEXER_STATE, PoolKind.C128_STATE):
        state = _ring_of(s, kind)
        _flip(state.kv_score_buffer.kv_score[_ring_row(s, state, a, 100)])
    _step(s, [a, b])
    assert _rows(s) == []


@pytest.mark.parametrize("pool", ["mha", "swa"])
def test_misdirected_store_is_write_kv_store(pool: str) -> None:
    """SGLang's set_kv_buffer storing one layer's K/V to swapped slots: the pool holds
    self-consistent bytes at each slot, but not the token's own."""
    s, (a, b) = (_mha_setup if pool == "mha" else _swa_setup)(1)
    plain = s.store

    def swapped(fb: Any) -> None:
        plain(fb)
        loc = fb.out_cache_loc.flip(0)  # token i's K/V to token n-1-i's slot
        n = int(loc.shape[0])
        if pool == "mha":
            s.pool.set_kv_buffer(layer(0), loc, s.kv(n, 2, 8), s.kv(n, 2, 8))
        else:
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            swa_loc = s.pool.translate_loc_from_full_to_swa(loc)
            s.pool.set_kv_buffer(layer(0), KVWriteLoc(loc, swa_loc=swa_loc, physical=True),
                                 s.kv(n, 2, 8), s.kv(n, 2, 8))  # fmt: skip

    s.store = swapped  # type: ignore[method-assign]
    _step(s, [a, b])
    kind = "FULL" if pool == "mha" else "SWA"  # global layer 0 slides in the SWA pool
    _assert_reported(s, f"TAIL_K_{kind}", "write_kv_store", a.kv_len - 1)


def test_abort_mode_hands_the_implicated_slots_to_the_host() -> None:
    """Abort mode on SGLang's SWA pool: the violation's full and SWA slots reach the host's
    abort handler at ``end_step()``; serving goes on."""
    config = CanaryConfig(mode="abort", real_data="partial")
    s = SWAServing.make(page_size=1, config=config, window=4)
    assert s.canary is not None
    calls: list[tuple[list[int], list[int]]] = []
    s.canary.set_abort_handler(lambda full, swa, rows: calls.append((full.tolist(), swa.tolist())) or [7])
    a, b = s.new_request(16), s.new_request(16)
    s.forward([(a, 10), (b, 8)])
    assert s.canary.end_step() == [] and calls == []
    p = a.kv_len - 2
    swa_slot = int(s.pool.full_to_swa_index_mapping[a.slots[p]])
    _flip(s.pool.swa_kv_pool.k_buffer[0][swa_slot])
    _step(s, [a, b])
    assert s.canary.end_step() == [7]
    assert calls and swa_slot in calls[0][1]
    _step(s, [a, b])  # serving goes on


# ---------------------------------------------------------------------- refusals


def test_unsupported_version_pool_and_state_are_refused() -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from kvcanary.integrations.sglang import check_sglang_version, install_on_sglang

    with pytest.raises(RuntimeError, match=r"supports sglang 0\.5\.23 .*found sglang 0\.6\.0"):
        check_sglang_version("0.6.0")

    class MyPool(MHATokenToKVPool):
        pass

    pool = MyPool(size=16, page_size=1, dtype=torch.float16, head_num=2, head_dim=8,
                  layer_num=1, device="cpu", enable_memory_saver=False)  # fmt: skip
    s = MHAServing.make(page_size=1, config=CONFIG, install=False)
    with pytest.raises(NotImplementedError, match="MyPool is not supported; supported: sglang"):
        install_on_sglang(pool, s.r2t, CONFIG)
    swa = SWAKVPool(size=16, size_swa=8, page_size=1, dtype=torch.float16, head_num=2,
                    head_dim=8, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                    device="cpu", enable_memory_saver=False)  # fmt: skip
    with pytest.raises(ValueError, match="mapping is not registered yet"):
        install_on_sglang(swa, s.r2t, CONFIG, sliding_window=4)
    # a pool SGLang's own canary already patched
    own = MHAServing.make(page_size=1, config=CONFIG, install=False)
    SGLangOwnCanary(own.pool, own.r2t, own.allocator, real_data="none", window=None)
    with pytest.raises(RuntimeError, match="already wrapped by SGLang's own KV canary"):
        install_on_sglang(own.pool, own.r2t, CONFIG)


def test_batch_view_by_forward_mode() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from kvcanary.integrations.sglang import prefix_and_extend_lens

    t = torch.tensor
    base = dict(req_pool_indices=t([1, 2]), positions=t([7, 3]), seq_lens=t([8, 4]),
                extend_prefix_lens=t([5, 0]), extend_seq_lens=t([3, 4]),
                spec_info=SimpleNamespace(draft_token_num=3))  # fmt: skip
    expect = {
        ForwardMode.DECODE: ([7, 3], [1, 1]),
        ForwardMode.EXTEND: ([5, 0], [3, 4]),
        ForwardMode.MIXED: ([5, 0], [3, 4]),
        ForwardMode.TARGET_VERIFY: ([8, 4], [3, 3]),
        ForwardMode.DRAFT_EXTEND_V2: ([5, 0], [3, 4]),
    }
    for mode, (prefix, extend) in expect.items():
        got = prefix_and_extend_lens(SimpleNamespace(forward_mode=mode, **base))
        assert [g.tolist() for g in got] == [prefix, extend], mode
    idle = SimpleNamespace(forward_mode=ForwardMode.IDLE, req_pool_indices=t([], dtype=torch.int64),
                           positions=t([], dtype=torch.int64))  # fmt: skip
    assert [g.tolist() for g in prefix_and_extend_lens(idle)] == [[], []]
    with pytest.raises(NotImplementedError, match="forward mode .* not supported; supported"):
        prefix_and_extend_lens(SimpleNamespace(forward_mode=ForwardMode.PREBUILT, **base))


# ---------------------------------------------------------------------- against SGLang's own


XREF = [
    (kind, page, real, v_half)
    for kind in ("mha", "swa") for page in (1, 4)
    for real in ("none", "partial", "all") for v_half in (False, True)
]  # fmt: skip


@pytest.mark.parametrize(("kind", "page_size", "real_data", "v_half"), XREF)
def test_records_match_sglang_own_canary(kind: str, page_size: int, real_data: str, v_half: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The same steps (same slots, same KV bytes) under our canary on one SGLang pool and
    SGLang's own canary (its attacher + runner) on an identical one: every record buffer
    byte-identical after every forward, and neither reports anything."""
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_MHA_V", "1" if v_half else "0")
    make = MHAServing.make if kind == "mha" else SWAServing.make
    config = CanaryConfig(mode="log", real_data=real_data, v_half=v_half)
    ours = make(page_size=page_size, config=config, seed=7)
    theirs = make(page_size=page_size, config=config, seed=7, install=False)
    own = SGLangOwnCanary(theirs.pool, theirs.r2t, theirs.allocator, real_data=real_data,
                          window=theirs.window)  # fmt: skip
    theirs.canary = own  # type: ignore[assignment]
    assert ours.canary is not None
    halves = ("k_head", "k_tail", "v_head", "v_tail")
    compared = 0

    def same_records() -> None:
        nonlocal compared
        for g_ours, g_theirs in zip(ours.canary.groups, own.groups, strict=True):  # type: ignore[union-attr]
            assert g_ours.kind.value == g_theirs.kind.value
            for half in halves:
                a, b = getattr(g_ours, half), getattr(g_theirs, half)
                assert torch.equal(a, b), (g_ours.kind.name, half)
                compared += int(a.any(1).sum())

    # lock-step: one forward on each, then compare
    plain_forward_ours, plain_forward_theirs = ours.forward, theirs.forward

    def both(work_ours: Any, work_theirs: Any) -> None:
        plain_forward_ours(work_ours)
        plain_forward_theirs(work_theirs)
        same_records()

    a = [ours.new_request(30), ours.new_request(30)]
    b = [theirs.new_request(30), theirs.new_request(30)]
    both([(a[0], 9), (a[1], 5)], [(b[0], 9), (b[1], 5)])
    both([(a[1], 4)], [(b[1], 4)])
    for _ in range(4):
        both([(r, 1) for r in a], [(r, 1) for r in b])
    ours.finish(a[0])
    theirs.finish(b[0])
    a.append(ours.new_request(30))
    b.append(theirs.new_request(30))
    both([(a[2], 6), (a[1], 1)], [(b[2], 6), (b[1], 1)])
    both([(a[2], 1), (a[1], 1)], [(b[2], 1), (b[1], 1)])
    assert compared > 0
    assert _rows(ours) == []
    assert own.violation_count() == 0


def test_dsv4_swa_records_match_sglang_own_canary() -> None:
    """DeepSeek-V4: SGLang's own canary covers the SWA sub-pool only (K, no real-KV); on the
    same steps its SWA records equal our SWA group's, byte for byte, after every forward."""
    config = CanaryConfig(mode="log", real_data="none")
    ours = DSV4Serving.make(config=config, seed=5)
    theirs = DSV4Serving.make(config=config, seed=5, install=False)
    own = SGLangOwnCanary(theirs.pool, theirs.r2t, theirs.allocator, real_data="none",
                          window=theirs.window)  # fmt: skip
    theirs.canary = own  # type: ignore[assignment]
    assert [g.kind.name for g in own.groups] == ["SWA"]  # SGLang's DSV4 gap
    a, b = [ours.new_request(300), ours.new_request(40)], [theirs.new_request(300),
                                                          theirs.new_request(40)]  # fmt: skip
    steps = [[(0, 260), (1, 30)], [(0, 5), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    for step in steps:
        ours.forward([(a[i], n) for i, n in step])
        theirs.forward([(b[i], n) for i, n in step])
        mine, sglang = _group(ours, PoolKind.SWA), own.groups[0]
        rows = sglang.k_head.shape[0]
        assert torch.equal(mine.k_head[:rows], sglang.k_head)
        assert torch.equal(mine.k_tail[:rows], sglang.k_tail)
        assert int(mine.k_head.any(1).sum()) > 0
    assert _rows(ours) == [] and own.violation_count() == 0


def test_dsv4_last_swa_page_sglang_records_too_short() -> None:
    """Known SGLang 0.5.23 issue, found here: ``attach_dsv4`` sizes the SWA records by
    ``swa_kv_pool.size`` (1536 rows), but SGLang's paged SWA allocator hands out slots up to
    ``size + page_size - 1`` (page 0 is the reserved one), so a forward writing the last SWA
    page indexes past SGLang's records (its torch reference raises; a CUDA kernel would
    write out of bounds). Our SWA group has a row per slot of every page and stays clean."""
    config = CanaryConfig(mode="log", real_data="all")
    ours = DSV4Serving.make(config=config, seed=5)
    theirs = DSV4Serving.make(config=config, seed=5, install=False)
    own = SGLangOwnCanary(theirs.pool, theirs.r2t, theirs.allocator, real_data="none",
                          window=theirs.window)  # fmt: skip
    theirs.canary = own  # type: ignore[assignment]
    for s in (ours, theirs):
        s.evict = lambda work: None  # type: ignore[method-assign]  # keep every SWA page busy
    x, y = ours.new_request(1010), ours.new_request(310)
    ours.forward([(x, 1000)])
    ours.forward([(y, 300)])
    ours.forward([(x, 1), (y, 1)])
    mapping = ours.pool.full_to_swa_index_mapping
    assert max(int(mapping[s]) for s in y.slots) >= ours.pool.swa_kv_pool.size  # last page
    assert _rows(ours) == []
    x2, y2 = theirs.new_request(1010), theirs.new_request(310)
    theirs.forward([(x2, 1000)])
    with pytest.raises(IndexError, match="out of bounds for dimension 0 with size 1536"):
        theirs.forward([(y2, 300)])
