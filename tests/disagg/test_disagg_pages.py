"""Which pages a transfer covers, and moving pages through buf-infos (spliced extra
buffers included)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.canary.attach.splice import Segment, patch_buf_infos
from kvcanary.disagg.pages import PageIO, PageLayoutError, TransferPages, request_pages
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool

P, W = 4, 8


def _swa(full_tokens: int = 256, swa_tokens: int = 64) -> tuple[SWAKVPool, SWAAllocator]:
    pool = SWAKVPool(full_tokens, swa_tokens, P, torch.float32, 1, 4, [0], [1])
    return pool, SWAAllocator(full_tokens, swa_tokens, P, kvcache=pool)


@pytest.mark.parametrize(
    ("seq_len", "prefix_len", "num_kv", "num_state"),
    [(30, 0, 8, 3), (30, 8, 6, 3), (30, 24, 2, 2), (5, 0, 2, 2)],
)  # window start floor4(30 - 8) = 20: state covers [max(20, prefix), 30)
def test_request_pages_follow_the_window(seq_len, prefix_len, num_kv, num_state) -> None:
    _, alloc = _swa()
    tail = seq_len - max(0, (seq_len - W) // P * P)
    out = alloc.alloc_extend_swa_tail(0, seq_len, -1, tail)
    row = torch.zeros(64, dtype=torch.int32)
    row[:seq_len] = out.to(torch.int32)
    pages = request_pages(row, alloc.full_to_swa_index_mapping, prefix_len, seq_len, W, P)
    assert len(pages.kv_page_ids) == num_kv and len(pages.state_page_ids) == num_state
    assert pages.kv_page_ids == (out[prefix_len::P] // P).tolist()
    start = max((seq_len - W) // P * P, prefix_len) if seq_len > W else prefix_len
    swa = alloc.full_to_swa_index_mapping[out[start:]]
    assert pages.state_page_ids == (swa[::P] // P).tolist()


def test_request_pages_refuse_what_cannot_be_shipped() -> None:
    _, alloc = _swa()
    out = alloc.alloc_extend_swa_tail(0, 30, -1, 6)  # tail too short: [20, 24) unmapped
    row = out.to(torch.int32)
    with pytest.raises(PageLayoutError, match="not resident"):
        request_pages(row, alloc.full_to_swa_index_mapping, 0, 30, W, P)
    with pytest.raises(ValueError, match="page aligned"):
        request_pages(row, alloc.full_to_swa_index_mapping, 2, 30, W, P)
    shifted = row.clone()
    shifted[5] += 1  # a page-table bug: position 5 no longer at offset 1 of its page
    with pytest.raises(PageLayoutError, match="not page aligned"):
        request_pages(shifted, None, 0, 30, None, P)


def _mha_with_records() -> tuple[MHAKVPool, torch.Tensor]:
    """An MHA pool whose buf-infos carry an extra per-slot record buffer (as the canary's)."""
    pool = MHAKVPool(64, P, torch.float32, 2, 4, 2)
    for buf in pool.all_buffers():
        buf.copy_(torch.randn_like(buf))
    records = torch.randint(0, 255, (pool.num_slots, 32), dtype=torch.uint8)
    patch_buf_infos(pool, "get_contiguous_buf_infos",
                    [Segment(2, records, records.clone(), P), Segment(2, None, None, P)])  # fmt: skip
    return pool, records


def test_pages_move_through_buf_infos_with_spliced_buffers() -> None:
    src, src_records = _mha_with_records()
    dst, dst_records = _mha_with_records()
    src_io, dst_io = PageIO(src), PageIO(dst)
    assert src_io.layout() == dst_io.layout() and len(src_io.kv_views) == 6
    sent, landed = TransferPages([3, 5], []), TransferPages([7, 2], [])
    payload = src_io.gather(sent)
    assert payload.numel() == src_io.nbytes(sent)
    dst_io.scatter(payload, landed)
    for s_buf, d_buf in zip(src.all_buffers(), dst.all_buffers(), strict=True):
        for s_page, d_page in ((3, 7), (5, 2)):
            assert torch.equal(s_buf[s_page * P : (s_page + 1) * P], d_buf[d_page * P : (d_page + 1) * P])
    assert torch.equal(src_records[12:16], dst_records[28:32])  # the records travelled too
    # The fault hook lands every page one page further.
    dst_io.scatter(payload, landed, page_offset=1)
    assert torch.equal(src_records[12:16], dst_records[32:36])
    with pytest.raises(ValueError, match="payload"):
        dst_io.scatter(payload[:-1], landed)
