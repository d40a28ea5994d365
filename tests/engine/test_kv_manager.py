"""KVManager: each verb of the request KV lifecycle on real pools (no model), and the typed
errors the engine raises for what a caller must react to."""

from __future__ import annotations

import pytest
import torch

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.engine.errors import ContextLengthError, KVPoolTooSmallError, RequestTooLargeError
from kvcanary.engine.kv_manager import KVManager, KVSpec
from kvcanary.engine.request import Req
from kvcanary.engine.stats import KVStats
from kvcanary.memory.allocator import make_allocator
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.req_to_token import ReqToTokenPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool

_rids = iter(range(1, 1 << 30))


def _mha(tokens: int = 64, page: int = 4, cache: bool = False, offload: bool = False) -> KVManager:
    pool = MHAKVPool(tokens, page, torch.float32, 1, 4, 1)
    return KVManager(make_allocator(tokens, page), ReqToTokenPool(8, 256), pool, KVSpec(page, None),
                     enable_prefix_cache=cache, enable_host_offload=offload, stats=KVStats())  # fmt: skip


def _swa(window: int = 8, page: int = 2, full: int = 128, swa: int = 64) -> KVManager:
    pool = SWAKVPool(full, swa, page, torch.float32, 1, 4, [0], [1])
    alloc = SWAAllocator(full, swa, page, kvcache=pool)
    return KVManager(alloc, ReqToTokenPool(8, 256), pool, KVSpec(page, window),
                     enable_prefix_cache=False, enable_host_offload=False, stats=KVStats())  # fmt: skip


def _req(n: int, token: int = 1) -> Req:
    return Req(rid=next(_rids), prompt_ids=[token] * n, params=SamplingParams(max_new_tokens=4))


def _prefill(kv: KVManager, n: int, token: int = 1) -> Req:
    req = _req(n, token)
    assert kv.admit(req) and kv.extend(req, n - 1)
    req.kv_len = n - 1
    return req


def test_the_window_policy_must_match_the_allocator() -> None:
    pool = MHAKVPool(64, 4, torch.float32, 1, 4, 1)
    with pytest.raises(ValueError, match="window=32"):
        KVManager(make_allocator(64, 4), ReqToTokenPool(2, 64), pool, KVSpec(4, 32),
                  enable_prefix_cache=False, enable_host_offload=False, stats=KVStats())  # fmt: skip


def test_extend_that_does_not_fit_holds_nothing() -> None:
    kv = _mha(tokens=64)
    req = _prefill(kv, 41)
    free, row = kv.available(), kv.req_to_token[req.req_pool_idx].clone()
    assert not kv.extend(req, 80)  # 40 more tokens; 20 free
    assert kv.available() == free and torch.equal(kv.req_to_token[req.req_pool_idx], row)
    assert kv.extend(req, 56) and kv.available() == free - 16
    kv.check_integrity()


def test_extend_decode_maps_one_slot_per_request() -> None:
    kv = _mha(tokens=64)
    a, b = _prefill(kv, 9), _prefill(kv, 5)
    out = kv.extend_decode([a, b])
    assert out is not None and out.numel() == 2
    assert int(kv.req_to_token[a.req_pool_idx, a.kv_len]) == int(out[0])
    assert int(kv.req_to_token[b.req_pool_idx, b.kv_len]) == int(out[1])


@pytest.mark.parametrize("make", [_mha, _swa])
def test_decode_steps_through_the_host_table_equal_the_torch_path(make) -> None:  # type: ignore[no-untyped-def]
    """A host table is read and written through its numpy view; the same requests decoded
    through torch's indexing (the view dropped) give the same slots, tables and pools."""
    managers = [make(), make()]
    managers[1]._table_np = None  # the torch path
    reqs: list[list[Req]] = [[], []]
    for kv, rs in zip(managers, reqs, strict=True):
        rs.extend([_prefill(kv, 9), _prefill(kv, 1), _prefill(kv, 4)])  # kv_len 8, 0, 3
        rs[1].kv_len = 0  # nothing cached yet: last slot -1
    assert managers[0].last_locs(reqs[0]).tolist() == managers[1].last_locs(reqs[1]).tolist()
    for _ in range(6):  # page starts and continuations
        outs = [kv.extend_decode(rs) for kv, rs in zip(managers, reqs, strict=True)]
        assert outs[0] is not None and outs[1] is not None
        assert outs[0].tolist() == outs[1].tolist()
        for rs in reqs:
            for r in rs:
                r.kv_len += 1
        assert torch.equal(managers[0].req_to_token, managers[1].req_to_token)
        assert managers[0].last_locs(reqs[0]).tolist() == managers[1].last_locs(reqs[1]).tolist()
    assert managers[0].available() == managers[1].available()


def test_release_into_the_cache_keeps_whole_pages_and_frees_the_partial_page() -> None:
    kv = _mha(tokens=64, cache=True)
    req = _prefill(kv, 11)  # kv_len 10: pages [0, 8) whole, [8, 10) partial
    kv.release(req, insert=True)
    assert kv.prefix_cache is not None and kv.prefix_cache.total_size() == 8
    assert kv.available() == 64 - 8 and req.req_pool_idx == 0
    again = _req(11)
    assert kv.admit(again) and again.kv_len == 8 and again.prefix is not None
    assert kv.prefix_cache.protected_size() == 8  # locked while the request runs
    kv.unlock_prefix(again)
    assert kv.prefix_cache.protected_size() == 0 and again.prefix is None


def test_can_admit_evicts_only_unlocked_cache_entries() -> None:
    kv = _mha(tokens=64, cache=True)
    kv.release(_prefill(kv, 33, token=1), insert=True)  # 32 cached tokens
    held = _prefill(kv, 17, token=2)
    kv.release(held, insert=True)
    held = _req(17, token=2)
    assert kv.admit(held) and held.kv_len == 16  # locks 16 cached tokens
    assert kv.available() == 16
    assert kv.can_admit(need=40, headroom=0)  # evicts the 32 unlocked tokens
    assert kv.available() == 48 and kv.prefix_cache is not None
    assert kv.prefix_cache.protected_size() == 16
    assert not kv.can_admit(need=49, headroom=0)  # the locked 16 never go
    kv.check_integrity()


def test_evict_window_frees_the_slots_left_of_the_window() -> None:
    kv = _swa(window=8, page=2)
    req = _prefill(kv, 31)  # kv_len 30
    kv.evict_window([req])
    frontier = 30 - 8 - 2  # floor_page(kv_len - W - P) = 20
    assert req.swa_evicted_seqlen == frontier
    mapping = kv.swa().full_to_swa_index_mapping[kv.slots(req)]
    assert bool((mapping[:frontier] == 0).all()) and bool((mapping[frontier:] > 0).all())
    assert kv.stats.num_swa_slots_evicted == frontier
    kv.evict_window([req])  # nothing new left the window
    assert kv.stats.num_swa_slots_evicted == frontier
    kv.check_integrity()


def test_retract_then_restore_brings_back_the_same_kv() -> None:
    kv = _mha(tokens=64, offload=True)
    req = _prefill(kv, 13)
    pool = kv.kv_pool
    assert isinstance(pool, MHAKVPool)
    slots = kv.slots(req)
    saved = torch.randn(slots.numel(), 1, 4)
    pool.k_buffer[0][slots] = saved
    kv.retract(req)
    assert req.req_pool_idx == 0 and kv.available() == 64 and req.host_copy is not None
    pool.k_buffer[0].zero_()
    assert kv.admit(req) and req.kv_len == 12 and req.host_copy is None
    assert torch.equal(pool.k_buffer[0][kv.slots(req)], saved)
    assert kv.stats.num_retractions == 1 and req.num_retractions == 1


def test_quarantine_drops_only_the_requests_that_reference_the_slots() -> None:
    kv = _mha(tokens=64)
    a, b = _prefill(kv, 9), _prefill(kv, 9)
    bad = kv.slots(a)[3:4]
    free = kv.available()
    assert kv.quarantine(bad, None, [a, b]) == [a]
    assert a.req_pool_idx == 0 and b.req_pool_idx != 0 and b.kv_len == 8
    # a's pages are free again except the quarantined one (page size 4: one page)
    assert kv.available() == free + 8 - 4
    kv.check_integrity()


def test_quarantine_drops_the_request_holding_a_named_row_and_quarantines_nothing() -> None:
    """A request-addressed compress-state ring names the req->token row of its request:
    that request alone is dropped, its pages freed, none quarantined (row 0: padding)."""
    kv = _mha(tokens=64)
    a, b, c = _prefill(kv, 9), _prefill(kv, 9), _prefill(kv, 9)
    b.rid = a.req_pool_idx  # a request id equal to another's row must not confuse the two
    rows = torch.tensor([0, b.req_pool_idx])
    free = kv.available()
    assert kv.quarantine(torch.zeros(0, dtype=torch.int64), None, [a, b, c], rows) == [b]
    assert b.req_pool_idx == 0 and a.kv_len == c.kv_len == 8
    assert kv.available() == free + 8  # b's two pages
    kv.check_integrity()


def test_context_length_and_pool_size_errors_are_typed() -> None:
    engine = Engine(EngineConfig(model="builtin:tiny-mha", page_size=4, max_total_tokens=64,
                                 max_context_len=128, graph_batch_sizes=()))  # fmt: skip
    with pytest.raises(ContextLengthError) as e:
        engine.add_request([1] * 100, SamplingParams(max_new_tokens=29))
    assert (e.value.prompt_len, e.value.max_new_tokens, e.value.limit) == (100, 29, 128)
    # Fits the context, not the pool even alone: refused at admission, nothing queued.
    with pytest.raises(RequestTooLargeError, match="needs 80 full / 0 SWA KV tokens"):
        engine.add_request([1] * 60, SamplingParams(max_new_tokens=21))
    assert not engine.has_unfinished()
    assert engine.generate([[1] * 8], SamplingParams(max_new_tokens=4))[0].output_ids
    # The scheduler's own last line of defence, for a request queued past admission.
    req = Req(rid=999, prompt_ids=[1] * 60, params=SamplingParams(max_new_tokens=21))
    engine.scheduler.waiting.append(req)
    with pytest.raises(KVPoolTooSmallError, match="max_total_tokens=64"):
        while engine.has_unfinished():
            engine.step()
