"""Strided real-KV sources (vLLM's CPU K layout): a slot's fingerprint is the fold of its
gathered elements laid out contiguously, on every backend; flipping a byte a slot reads
changes that slot's fingerprint only; bad shapes are refused with one-line errors."""

from __future__ import annotations

import pytest
import torch
from canary_testlib import IMPLS, written_fingerprints
from reference_kernels import real_kv_hash

from kvcanary.canary.kernels.store_check import StoreWatch
from kvcanary.canary.wire.real_kv import (
    RealKvSource,
    numba_source_args,
    real_kv_hashes_nb,
    real_kv_hashes_t,
)

NUM_BLOCKS, HEADS = 6, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "int8": torch.int8, "fp64": torch.float64}  # fmt: skip


def _cpu_kv(dtype: torch.dtype, block_size: int, head_size: int, seed: int) -> torch.Tensor:
    """Random bytes in vLLM's CPU layout ``[blocks, heads, block_size, 2 * head_size]``."""
    gen = torch.Generator().manual_seed(seed)
    es = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (NUM_BLOCKS, HEADS * block_size * 2 * head_size * es),
                        dtype=torch.uint8, generator=gen)  # fmt: skip
    return raw.view(dtype).view(NUM_BLOCKS, HEADS, block_size, 2 * head_size)


def _k_source(kv: torch.Tensor, read_bytes: int) -> RealKvSource:
    """Head 0's K (stored ``[head_size, block_size]``) as a strided source."""
    nb, _, bs, two_hs = kv.shape
    es = kv.element_size()
    rows = kv.view(nb, -1).view(torch.uint8)[:, : two_hs // 2 * bs * es]
    return RealKvSource(rows, bs, es, read_bytes, element_size=es, element_stride=bs * es)


def _k_copy(kv: torch.Tensor, read_bytes: int) -> RealKvSource:
    """The same K, copied token-major (``[block_size, head_size]`` a block) as a
    contiguous source: what the strided source must fingerprint alike."""
    nb, _, bs, two_hs = kv.shape
    k_t = kv[:, 0].reshape(nb, -1)[:, : two_hs // 2 * bs].reshape(nb, two_hs // 2, bs)
    tokens = k_t.transpose(1, 2).contiguous().view(nb, -1).view(torch.uint8)
    return RealKvSource(tokens, bs, two_hs // 2 * kv.element_size(), read_bytes)


def _element_size(dtype: str) -> int:
    return torch.empty(0, dtype=DTYPES[dtype]).element_size()


CASES = [  # (dtype, block size, head size, read_bytes: partial 16 or all)
    (dtype, bs, hs, read)
    for dtype in DTYPES
    for bs, hs in ((4, 16), (16, 32), (3, 16))
    for read in sorted({16, hs * _element_size(dtype)})
]


@pytest.mark.parametrize(("dtype", "block_size", "head_size", "read_bytes"), CASES)
def test_strided_fingerprint_is_fold_of_gathered_bytes(dtype: str, block_size: int,
                                                       head_size: int, read_bytes: int) -> None:  # fmt: skip
    kv = _cpu_kv(DTYPES[dtype], block_size, head_size, seed=block_size * head_size + read_bytes)
    strided, copy = _k_source(kv, read_bytes), _k_copy(kv, read_bytes)
    assert strided.strided and not copy.strided
    slots = torch.arange(NUM_BLOCKS * block_size)
    want = real_kv_hashes_t([copy], slots)
    assert torch.equal(real_kv_hashes_t([strided], slots), want)
    assert torch.equal(torch.from_numpy(real_kv_hashes_nb(slots.numpy(), *numba_source_args([strided]))), want)
    # a negative slot folds nothing; two sources, the strided one in any position
    shuffled = slots[torch.randperm(slots.shape[0], generator=torch.Generator().manual_seed(0))]
    with_neg = torch.cat([shuffled, torch.tensor([-1])])
    got = real_kv_hashes_nb(with_neg.numpy(), *numba_source_args([copy, strided]))
    assert got[-1] == 0
    assert torch.equal(torch.from_numpy(got[:-1]), real_kv_hashes_t([copy, copy], shuffled))
    for slot in (0, block_size - 1, block_size + 1, slots.shape[0] - 1):
        assert real_kv_hash([strided], slot) == int(want[slot])
    # the kernels' stored field 3 (numba, torch, reference write kernels)
    picked = [1, block_size, 2 * block_size + 1, slots.shape[0] - 1]
    for name, impl in IMPLS.items():
        assert written_fingerprints(impl, [strided], picked) == want[picked].tolist(), name


def test_strided_fingerprint_does_not_depend_on_the_hash_of_the_copy() -> None:
    """The copy comparison above could pass with both sides wrong in the same way: a
    token's fingerprint differs from the fold of its first ``read_bytes`` contiguous bytes
    (what a contiguous read of the transposed tile would fingerprint)."""
    kv = _cpu_kv(torch.float32, 4, 8, seed=3)
    strided = _k_source(kv, 32)
    naive = RealKvSource(strided.tensor, 1, 128, 32)  # row-major bytes of the block
    assert real_kv_hash([strided], 0) != real_kv_hash([naive], 0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("read", ["partial", "all"])
def test_flipping_one_k_byte_changes_that_slot_only(dtype: str, read: str) -> None:
    bs, hs = 16, 32
    kv = _cpu_kv(DTYPES[dtype], bs, hs, seed=7)
    es = kv.element_size()
    read_bytes = 16 if read == "partial" else hs * es
    source = _k_source(kv, read_bytes)
    slots = torch.arange(NUM_BLOCKS * bs)
    before = real_kv_hashes_t([source], slots)
    raw = kv.view(NUM_BLOCKS, -1).view(torch.uint8)
    block, token = 3, 5
    last = read_bytes // es - 1  # the last element the window reads, its last byte
    for element, byte in ((0, 0), (last, es - 1)):
        raw[block, (element * bs + token) * es + byte] ^= 0x10
        for name, after in (
            ("torch", real_kv_hashes_t([source], slots)),
            ("numba", torch.from_numpy(real_kv_hashes_nb(slots.numpy(), *numba_source_args([source])))),
        ):  # fmt: skip
            changed = (after != before).nonzero().flatten().tolist()
            assert changed == [block * bs + token], (name, element)
        raw[block, (element * bs + token) * es + byte] ^= 0x10
    # past the window (partial): K elements the window does not read
    if read == "partial":
        raw[block, ((last + 1) * bs + token) * es] ^= 0x10
        assert torch.equal(real_kv_hashes_t([source], slots), before)


def _raw(width: int = 128, rows: int = 4) -> torch.Tensor:
    return torch.zeros(rows, width, dtype=torch.uint8)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"element_size": 3, "element_stride": 12}, r"element_size=3; allowed: 1, 2, 4, 8$"),
    ({"element_size": 4, "element_stride": 6},
     r"element_stride=6; allowed: positive multiples of element_size=4$"),
    ({"element_size": 4, "element_stride": 16, "num_bytes_per_token": 6},
     r"num_bytes_per_token=6; allowed: positive multiples of element_size=4$"),
    ({"element_size": 4, "element_stride": 16, "read_bytes": 8},
     r"read_bytes=8; allowed: positive multiples of 16$"),
    ({"element_size": 4, "element_stride": 16, "read_bytes": 80},
     r"reads up to byte 320 of a row .*; allowed: at most the row width 128$"),
    ({"element_size": 2, "element_stride": 8, "page_size": 4, "num_bytes_per_token": 2,
      "read_bytes": 64}, r"reads up to byte 256 of a row .*; allowed: at most the row width 128$"),
])  # fmt: skip
def test_bad_strided_sources_raise_one_line_errors(kwargs: dict[str, int], message: str) -> None:
    args = {"page_size": 4, "num_bytes_per_token": 4, "read_bytes": 16} | kwargs
    with pytest.raises(ValueError, match=message) as e:
        RealKvSource(_raw(), args.pop("page_size"), args.pop("num_bytes_per_token"),
                     args.pop("read_bytes"), **args)  # fmt: skip
    assert "\n" not in str(e.value)


def test_strided_source_reaching_the_row_end_is_accepted() -> None:
    # 4 tokens of 8 fp32 elements, 16 bytes apart: the last slot's last byte is byte 127
    source = RealKvSource(_raw(), 4, 4, 32, element_size=4, element_stride=16)
    assert source.strided and source.slot_end_bytes == 128


def test_store_check_refuses_strided_sources() -> None:
    source = RealKvSource(_raw(), 4, 4, 16, element_size=4, element_stride=16)
    with pytest.raises(ValueError, match=r"store check of a strided real-KV source .*; allowed: "
                       r"contiguous sources only$"):  # fmt: skip
        StoreWatch(0, torch.zeros(16, 4, dtype=torch.int64), (source,))
