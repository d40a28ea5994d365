"""ReqToTokenPool: row 0 is padding, alloc/free/exhaustion, writes, integrity."""

from __future__ import annotations

import pytest
import torch

from kvcanary.memory.errors import DoubleFreeError, IntegrityError, PoolExhaustedError
from kvcanary.memory.req_to_token import REQ_POOL_IDX_PADDING, ReqToTokenPool


def test_layout() -> None:
    pool = ReqToTokenPool(3, 16)
    assert pool.req_to_token.shape == (4, 16) and pool.req_to_token.dtype == torch.int32
    assert pool.available_size() == 3 and REQ_POOL_IDX_PADDING == 0


def test_alloc_and_free() -> None:
    pool = ReqToTokenPool(4, 8)
    assert pool.alloc(2) == [1, 2]
    assert pool.alloc() == [3]
    pool.free(2)
    assert pool.alloc(2) == [4, 2]
    assert pool.available_size() == 0 and pool.check_integrity()


def test_row0_never_handed_out() -> None:
    pool = ReqToTokenPool(5, 4)
    rows = pool.alloc(5)
    assert 0 not in rows and sorted(rows) == [1, 2, 3, 4, 5]
    for r in rows:
        pool.free(r)
    assert 0 not in pool.alloc(5)


def test_exhaustion_message_and_nothing_taken() -> None:
    pool = ReqToTokenPool(3, 4)
    pool.alloc(2)
    with pytest.raises(
        PoolExhaustedError, match=r"asked for 2 rows, 1 of 3 free.*max_running_requests"
    ):
        pool.alloc(2)
    assert pool.available_size() == 1 and pool.alloc(1) == [3]


@pytest.mark.parametrize(
    ("row", "error"), [(0, ValueError), (4, ValueError), (-1, ValueError), (2, DoubleFreeError)]
)
def test_bad_frees(row: int, error: type[Exception]) -> None:
    pool = ReqToTokenPool(3, 4)
    pool.alloc(1)  # row 1 live, rows 2 and 3 free
    with pytest.raises(error):
        pool.free(row)
    assert pool.available_size() == 2 and pool.check_integrity()


def test_double_free_after_alloc() -> None:
    pool = ReqToTokenPool(2, 4)
    (row,) = pool.alloc(1)
    pool.free(row)
    with pytest.raises(DoubleFreeError, match=f"row {row} freed twice"):
        pool.free(row)


def test_write() -> None:
    pool = ReqToTokenPool(2, 8)
    (row,) = pool.alloc(1)
    pool.write(row, 0, torch.tensor([4, 5, 6], dtype=torch.int64))
    pool.write(row, 3, torch.tensor([9]))
    assert pool.req_to_token[row, :4].tolist() == [4, 5, 6, 9]
    assert not bool(pool.req_to_token[0].any())  # padding row untouched
    with pytest.raises(ValueError, match="max_context_len=8"):
        pool.write(row, 6, torch.tensor([1, 2, 3]))


def test_clear() -> None:
    pool = ReqToTokenPool(3, 4)
    pool.alloc(3)
    pool.clear()
    assert pool.available_size() == 3 and pool.alloc(3) == [1, 2, 3]


@pytest.mark.parametrize(("size", "max_len"), [(0, 4), (2, 0)])
def test_bad_construction(size: int, max_len: int) -> None:
    with pytest.raises(ValueError):
        ReqToTokenPool(size, max_len)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: p._free_rows.append(p._free_rows[0]), "duplicate"),
        (lambda p: p._free_rows.append(0), "padding row 0"),
        (lambda p: p._free_rows.pop(), "disagree"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message: str) -> None:  # type: ignore[no-untyped-def]
    pool = ReqToTokenPool(4, 4)
    pool.alloc(1)
    assert pool.check_integrity()
    corrupt(pool)
    with pytest.raises(IntegrityError, match=message):
        pool.check_integrity()


def test_append_tokens_on_the_host_equals_the_torch_path() -> None:
    """The host pool writes the token mirror through numpy views; the same appends through
    torch's indexing (the views dropped) leave the same mirror."""
    pools = [ReqToTokenPool(4, 16), ReqToTokenPool(4, 16)]
    assert pools[0]._host is not None
    pools[1]._host = None  # the torch path
    for p in pools:
        p.set_tokens(2, [5, 6, 7])
        p.set_tokens(3, [9])
        p.append_tokens([2, 3], [3, 1], [70, 80])
        p.append_tokens([3], [2], [81])
    assert torch.equal(pools[0].token_ids, pools[1].token_ids)
    assert torch.equal(pools[0].token_lens, pools[1].token_lens)
    assert pools[0].token_ids[2, :4].tolist() == [5, 6, 7, 70]
    assert pools[0].token_ids[3, :3].tolist() == [9, 80, 81] and pools[0].token_lens[3] == 3


def test_host_table_is_the_slot_table_itself_on_the_host_only() -> None:
    """``host_table``: a numpy view of ``req_to_token`` on the host (writes either way are
    seen by both); None on "cpu:0", the stand-in device that keeps the torch paths."""
    pool = ReqToTokenPool(2, 8)
    assert pool.host_table is not None
    pool.req_to_token[1, 3] = 42
    pool.host_table[2, 5] = 7
    assert pool.host_table[1, 3] == 42 and int(pool.req_to_token[2, 5]) == 7
    assert ReqToTokenPool(2, 8, device="cpu:0").host_table is None


def test_append_no_tokens_is_a_no_op_on_both_paths() -> None:
    """An empty append (no request sampled) leaves both mirrors as they were."""
    pools = [ReqToTokenPool(2, 8), ReqToTokenPool(2, 8)]
    pools[1]._host = None
    for p in pools:
        p.set_tokens(1, [3, 4])
        p.append_tokens([], [], [])
        assert p.token_ids[1, :2].tolist() == [3, 4] and int(p.token_lens[1]) == 2
