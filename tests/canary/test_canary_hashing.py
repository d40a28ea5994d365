"""Hash primitives: the reference test vectors and scalar == torch == numba, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canary.wire.constants import CANARY_CHAIN_ANCHOR
from kvcanary.canary.wire.hashing import (
    ANCHOR_HASH,
    ANCHOR_HASH_I64,
    MASK64,
    chain_hash,
    chain_hash_nb,
    chain_hash_t,
    combine_real_kv_folds,
    fold_real_kv_bytes,
    fold_real_kv_nb,
    fold_real_kv_words_t,
    mix3,
    splitmix64,
    splitmix64_nb,
    splitmix64_t,
    to_i64,
    to_u64,
)

U64 = st.integers(0, MASK64)
I64 = st.integers(-(2**63), 2**63 - 1)

# reference/kv_canary_core.md §2.2
VECTOR_CHAIN = [0xDE7FAE23A9A1B716, 0x89CD2ABFBEBC0649, 0x5782FFC5B5D6409B, 0xF53E51CD772BB95C]


def test_anchor_vector() -> None:
    assert splitmix64(CANARY_CHAIN_ANCHOR) == ANCHOR_HASH == 0xDE7FAE23A9A1B716
    assert ANCHOR_HASH_I64 == -2414019407054260458
    assert splitmix64(0) == 0 and mix3(0, 0, 0) == 0


def test_chain_vector_all_flavours() -> None:
    tokens, positions = [11, 22, 33], [0, 1, 2]
    h = ANCHOR_HASH
    chain = [h]
    for tok, pos in zip(tokens, positions, strict=True):
        h = chain_hash(h, tok, pos)
        chain.append(h)
    assert chain == VECTOR_CHAIN

    prev = torch.tensor([to_i64(x) for x in VECTOR_CHAIN[:3]])
    got_t = chain_hash_t(prev, torch.tensor(tokens), torch.tensor(positions))
    assert [to_u64(x) for x in got_t.tolist()] == VECTOR_CHAIN[1:]

    got_nb = [
        int(chain_hash_nb(np.int64(to_i64(p)), np.int64(t), np.int64(q)))
        for p, t, q in zip(VECTOR_CHAIN[:3], tokens, positions, strict=True)
    ]
    assert got_nb == VECTOR_CHAIN[1:]


def test_real_kv_vector_all_flavours() -> None:
    data = bytes(range(16))
    assert fold_real_kv_bytes(data) == 0x447F1B95028CE131
    assert combine_real_kv_folds([fold_real_kv_bytes(data)]) == 0xD6D75024DFD6C30C
    words = torch.tensor(list(data), dtype=torch.uint8)[None].view(torch.int64)
    assert to_u64(fold_real_kv_words_t(words).item()) == 0x447F1B95028CE131
    words_nb = np.arange(32, dtype=np.uint8).reshape(2, 16).view(np.int64)
    assert int(fold_real_kv_nb(words_nb, 0, 0, 2)) == 0x447F1B95028CE131
    assert combine_real_kv_folds([]) == 0


def test_fold_rejects_partial_words() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        fold_real_kv_bytes(b"\x00" * 12)


@given(st.lists(U64, min_size=1, max_size=32))
@settings(max_examples=60, deadline=None)
def test_splitmix64_flavours_agree(xs: list[int]) -> None:
    want = [splitmix64(x) for x in xs]
    got_t = splitmix64_t(torch.tensor([to_i64(x) for x in xs]))
    assert [to_u64(v) for v in got_t.tolist()] == want
    assert [int(splitmix64_nb(np.uint64(x))) for x in xs] == want


@given(st.lists(st.tuples(I64, I64, I64), min_size=1, max_size=32))
@settings(max_examples=60, deadline=None)
def test_chain_hash_flavours_agree(triples: list[tuple[int, int, int]]) -> None:
    want = [chain_hash(a, b, c) for a, b, c in triples]
    cols = [torch.tensor(list(col)) for col in zip(*triples, strict=True)]
    assert [to_u64(v) for v in chain_hash_t(*cols).tolist()] == want
    got_nb = [int(chain_hash_nb(np.int64(a), np.int64(b), np.int64(c))) for a, b, c in triples]
    assert got_nb == want


@given(st.binary(min_size=16, max_size=96).filter(lambda b: len(b) % 16 == 0))
@settings(max_examples=40, deadline=None)
def test_fold_flavours_agree(data: bytes) -> None:
    want = fold_real_kv_bytes(data)
    words = torch.tensor(list(data), dtype=torch.uint8)[None].view(torch.int64)
    assert to_u64(fold_real_kv_words_t(words).item()) == want
    # numba reads words at a row/column offset of a wider buffer
    src = np.zeros((3, len(data) + 16), dtype=np.uint8)
    src[1, 8 : 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    assert int(fold_real_kv_nb(src.view(np.int64), 1, 1, len(data) // 8)) == want


def test_signed_roundtrip_and_logical_shift() -> None:
    assert to_i64(MASK64) == -1 and to_u64(-1) == MASK64
    assert to_i64(1 << 63) == -(2**63)
    # sign bit set: torch must not sign-extend the right shifts
    x = 0xFFFF_0000_FFFF_0000
    assert to_u64(splitmix64_t(torch.tensor([to_i64(x)])).item()) == splitmix64(x)


@pytest.mark.parametrize(("page_size", "token_bytes", "read_bytes"), [
    (1, 512, 16), (16, 128, 16), (1, 128, 112),  # gathered per pass
    (1, 128, 128), (4, 256, 256), (1, 512, 512), (2, 2048, 1024),  # 32 slots a pass
    (1, 4096, 4096), (1, 8192, 8192), (8, 1040, 1040),  # 16 slots a pass
])  # fmt: skip
def test_real_kv_fingerprints_numba_equal_torch(page_size: int, token_bytes: int, read_bytes: int) -> None:
    """Field 3 from the numba kernels == the torch flavour, for windows the fold reads across
    all slots per pass (under 128 bytes) and ones it folds 8 slots a vector, their lines
    transposed in registers, 4 or 2 vectors side by side (up to 1 KiB or beyond; 1040 bytes:
    two words past the last whole line), with two sources (the second a partial window),
    slot counts that leave partial groups (3, 63, 65, 700), slots in any order and negative
    slots (0)."""
    from kvcanary.canary.wire.real_kv import (
        RealKvSource,
        numba_source_args,
        real_kv_hashes_nb,
        real_kv_hashes_t,
    )

    gen = torch.Generator().manual_seed(token_bytes + read_bytes + page_size)
    rows = 1024 // page_size
    buf = torch.randint(0, 256, (rows, page_size * token_bytes + 16), generator=gen, dtype=torch.uint8)
    sources = [RealKvSource(buf, page_size, token_bytes, read_bytes),
               RealKvSource(buf, page_size, token_bytes, 16)]  # fmt: skip
    for n in (0, 3, 63, 64, 65, 700):
        slots = torch.randint(-1, rows * page_size, (n,), generator=gen)
        want = torch.where(slots >= 0, real_kv_hashes_t(sources, slots.clamp(min=0)), 0)
        got = torch.from_numpy(real_kv_hashes_nb(slots.numpy(), *numba_source_args(sources)))
        assert torch.equal(got, want), n
