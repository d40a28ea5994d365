"""Host (CPU) copies: exact round trips, SWA rows only where mapped, extra slot buffers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcanary.memory import host_pool
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool

P = 4


def fill_random(buffers: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in buffers:
        if b.dtype == torch.uint8:
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
        else:
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))


def rows(buffers: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [b[slots].clone() for b in buffers]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # compare bytes, so -0.0 / NaN patterns count too
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def all_bufs(pool: MHAKVPool) -> list[torch.Tensor]:
    return pool.all_buffers() + pool.extra_slot_buffers


def make_swa(dtype: torch.dtype = torch.bfloat16) -> tuple[SWAKVPool, SWAAllocator]:
    pool = SWAKVPool(
        64, 32, P, dtype, 2, 4, swa_attention_layer_ids=[1, 2], full_attention_layer_ids=[0]
    )
    return pool, SWAAllocator(64, 32, P, kvcache=pool)


# ---------------------------------------------------------------- MHA
@pytest.mark.parametrize("chunk_size", [1, 3, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mha_round_trip(chunk_size: int, dtype: torch.dtype) -> None:
    pool = MHAKVPool(32, 1, dtype, 2, 4, 3)
    fill_random(pool.all_buffers(), 0)
    idx = torch.tensor([5, 9, 3, 17, 30, 1, 2])
    saved = rows(pool.all_buffers(), idx)
    copy = host_pool.get_cpu_copy(pool, idx, chunk_size=chunk_size)
    assert set(copy) == {"full"} and len(copy["full"]) == 6 and copy["full"][0].device.type == "cpu"
    fill_random(pool.all_buffers(), 1)  # the slots are reused meanwhile
    new_idx = torch.tensor([20, 21, 22, 23, 24, 25, 26])
    host_pool.load_cpu_copy(pool, copy, new_idx, chunk_size=chunk_size)
    assert same(rows(pool.all_buffers(), new_idx), saved)


# ---------------------------------------------------------------- SWA
def test_swa_copy_skips_unmapped_rows() -> None:
    pool, alloc = make_swa()
    full = alloc.alloc_extend_swa_tail(0, 10, -1, 6)  # positions 4..9 have SWA slots
    fill_random(all_bufs(pool.full_kv_pool) + all_bufs(pool.swa_kv_pool), 0)
    copy = host_pool.get_cpu_copy(pool, full, chunk_size=4)
    mask = copy["swa_mask"]
    assert mask.dtype == torch.bool and mask.device.type == "cpu"
    assert mask.tolist() == [False] * 4 + [True] * 6
    swa = alloc.full_to_swa_index_mapping[full][mask]
    assert all(c.shape[0] == 6 for c in copy["swa"])
    assert same(copy["swa"], rows(pool.swa_kv_pool.all_buffers(), swa))
    assert same(copy["full"], rows(pool.full_kv_pool.all_buffers(), full))


def test_swa_round_trip_same_indices_restores_exactly_and_leaves_sink() -> None:
    pool, alloc = make_swa()
    full = alloc.alloc_extend_swa_tail(0, 10, -1, 6)
    swa = alloc.full_to_swa_index_mapping[full]
    fill_random(pool.full_kv_pool.all_buffers() + pool.swa_kv_pool.all_buffers(), 0)
    want_full = rows(pool.full_kv_pool.all_buffers(), full)
    want_swa = rows(pool.swa_kv_pool.all_buffers(), swa[4:])
    copy = host_pool.get_cpu_copy(pool, full, chunk_size=3)
    fill_random(pool.full_kv_pool.all_buffers() + pool.swa_kv_pool.all_buffers(), 1)
    sink = rows(pool.swa_kv_pool.all_buffers(), torch.tensor([0]))
    host_pool.load_cpu_copy(pool, copy, full, chunk_size=3)
    assert same(rows(pool.full_kv_pool.all_buffers(), full), want_full)
    assert same(rows(pool.swa_kv_pool.all_buffers(), swa[4:]), want_swa)
    assert same(rows(pool.swa_kv_pool.all_buffers(), torch.tensor([0])), sink)  # never written


def test_swa_load_into_indices_with_a_different_mapping() -> None:
    """Saved with SWA for positions 4..11; reloaded where only 8..11 have SWA slots (and
    the new request's mapping differs): 4..7 saved rows are dropped, 8..11 land at the new
    SWA slots, nothing else in the SWA pool changes."""
    pool, alloc = make_swa()
    old = alloc.alloc_extend_swa_tail(0, 12, -1, 8)
    fill_random(pool.full_kv_pool.all_buffers() + pool.swa_kv_pool.all_buffers(), 0)
    want_full = rows(pool.full_kv_pool.all_buffers(), old)
    want_tail = rows(pool.swa_kv_pool.all_buffers(), alloc.full_to_swa_index_mapping[old[8:]])
    copy = host_pool.get_cpu_copy(pool, old)
    alloc.free(old)  # retracted
    alloc.alloc_extend([0], [8], torch.tensor([-1]))  # someone else takes the first pages
    new = alloc.alloc_extend_swa_tail(0, 12, -1, 4)
    new_swa = alloc.full_to_swa_index_mapping[new]
    assert not torch.equal(new, old) and new_swa[:8].tolist() == [0] * 8
    fill_random(pool.swa_kv_pool.all_buffers(), 1)
    swa_before = [b.clone() for b in pool.swa_kv_pool.all_buffers()]
    host_pool.load_cpu_copy(pool, copy, new)
    assert same(rows(pool.full_kv_pool.all_buffers(), new), want_full)
    assert same(rows(pool.swa_kv_pool.all_buffers(), new_swa[8:]), want_tail)
    untouched = torch.ones(pool.swa_kv_pool.num_slots, dtype=torch.bool)
    untouched[new_swa[8:]] = False
    assert same(
        [b[untouched] for b in pool.swa_kv_pool.all_buffers()], [b[untouched] for b in swa_before]
    )


def test_swa_load_new_slots_without_saved_rows_are_left_alone() -> None:
    pool, alloc = make_swa()
    old = alloc.alloc_extend_swa_tail(0, 8, -1, 4)  # saved SWA rows for positions 4..7 only
    fill_random(pool.swa_kv_pool.all_buffers(), 0)
    want_tail = rows(pool.swa_kv_pool.all_buffers(), alloc.full_to_swa_index_mapping[old[4:]])
    copy = host_pool.get_cpu_copy(pool, old)
    alloc.free(old)
    new = alloc.alloc_extend([0], [8], torch.tensor([-1]))  # every position mapped now
    new_swa = alloc.full_to_swa_index_mapping[new]
    fill_random(pool.swa_kv_pool.all_buffers(), 1)
    head_before = rows(pool.swa_kv_pool.all_buffers(), new_swa[:4])
    host_pool.load_cpu_copy(pool, copy, new)
    assert same(rows(pool.swa_kv_pool.all_buffers(), new_swa[4:]), want_tail)
    assert same(rows(pool.swa_kv_pool.all_buffers(), new_swa[:4]), head_before)


def test_nothing_mapped_on_either_side() -> None:
    pool, alloc = make_swa()
    full = alloc.alloc_extend_swa_tail(0, 8, -1, 0)
    copy = host_pool.get_cpu_copy(pool, full)
    assert not bool(copy["swa_mask"].any()) and all(c.shape[0] == 0 for c in copy["swa"])
    host_pool.load_cpu_copy(pool, copy, full)


# ---------------------------------------------------------------- extra slot buffers
def test_canary_records_ride_along() -> None:
    pool, alloc = make_swa()
    full_rec = torch.zeros(pool.full_kv_pool.num_slots, 32, dtype=torch.uint8)
    swa_rec = torch.zeros(pool.swa_kv_pool.num_slots, 32, dtype=torch.uint8)
    pool.full_kv_pool.register_slot_buffer(full_rec)
    pool.swa_kv_pool.register_slot_buffer(swa_rec)
    full = alloc.alloc_extend_swa_tail(0, 10, -1, 6)
    swa = alloc.full_to_swa_index_mapping[full][4:]
    fill_random([full_rec, swa_rec], 0)
    want = full_rec[full].clone(), swa_rec[swa].clone()
    copy = host_pool.get_cpu_copy(pool, full)
    assert len(copy["full"]) == 2 + 1 and len(copy["swa"]) == 4 + 1  # K, V layers + records
    fill_random([full_rec, swa_rec], 1)
    host_pool.load_cpu_copy(pool, copy, full)
    assert torch.equal(full_rec[full], want[0]) and torch.equal(swa_rec[swa], want[1])


def test_mha_extra_slot_buffer_round_trip() -> None:
    pool = MHAKVPool(16, 4, torch.float16, 1, 2, 2)
    rec = torch.zeros(pool.num_slots, 32, dtype=torch.uint8)
    pool.register_slot_buffer(rec)
    fill_random(all_bufs(pool), 0)
    idx = torch.arange(4, 12)
    want = rows(all_bufs(pool), idx)
    copy = host_pool.get_cpu_copy(pool, idx)
    fill_random(all_bufs(pool), 1)
    host_pool.load_cpu_copy(pool, copy, idx)
    assert same(rows(all_bufs(pool), idx), want)


# ---------------------------------------------------------------- failures
def test_copy_from_before_a_registration_is_rejected_without_writes() -> None:
    pool = MHAKVPool(16, 1, torch.float32, 1, 2, 1)
    copy = host_pool.get_cpu_copy(pool, torch.tensor([1, 2]))
    pool.register_slot_buffer(torch.zeros(pool.num_slots, 32, dtype=torch.uint8))
    before = [b.clone() for b in all_bufs(pool)]
    with pytest.raises(ValueError, match="registered between save and load"):
        host_pool.load_cpu_copy(pool, copy, torch.tensor([1, 2]))
    assert same(all_bufs(pool), before)


@pytest.mark.parametrize("new_len", [2, 4])
def test_wrong_number_of_indices_is_rejected_without_writes(new_len: int) -> None:
    pool, alloc = make_swa()
    full = alloc.alloc_extend([0], [3], torch.tensor([-1]))
    copy = host_pool.get_cpu_copy(pool, full)
    fill_random(pool.full_kv_pool.all_buffers(), 1)
    before = [b.clone() for b in pool.full_kv_pool.all_buffers()]
    with pytest.raises(ValueError):
        host_pool.load_cpu_copy(pool, copy, torch.arange(4, 4 + new_len))
    assert same(pool.full_kv_pool.all_buffers(), before)


def test_bad_chunk_size_and_unsupported_pool() -> None:
    pool = MHAKVPool(16, 1, torch.float32, 1, 2, 1)
    with pytest.raises(ValueError, match="chunk_size"):
        host_pool.get_cpu_copy(pool, torch.tensor([1]), chunk_size=0)
    other = SimpleNamespace(device=torch.device("cpu"))  # DSV4KVPool is supported since issue 13
    with pytest.raises(NotImplementedError, match="MHAKVPool, SWAKVPool, DSV4KVPool"):
        host_pool.get_cpu_copy(other, torch.tensor([1]))  # type: ignore[arg-type]
