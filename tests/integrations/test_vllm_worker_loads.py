"""KV another connector loaded, on the vLLM connector's worker side (without vLLM): the
scheduler side names the loaded positions and their slots (``StepMeta.seal``) and the slots
to clear (``StepMeta.invalid_slots``); the worker writes the loaded slots' records as a
forward computing those tokens would (HEAD and TAIL, K and V, fingerprints of the loaded
bytes), from the first slot a group holds (a sliding group holds none below its window),
and clears records so that any later read of them is reported."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from kvcanary.integrations.vllm.meta import GroupSpec, StepMeta
from kvcanary.integrations.vllm.options import parse_options
from kvcanary.integrations.vllm.worker import VllmCanaryWorker

BS, BLOCKS, HEADS, DIM = 4, 32, 2, 8
OPTIONS = {"mode": "log", "real_data": "all", "v_half": True}


def _worker(window: int | None = None) -> tuple[VllmCanaryWorker, torch.Tensor]:
    spec = GroupSpec(0, ("layer0",), BS, HEADS, DIM, window)
    kv = torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=torch.Generator().manual_seed(1))
    return VllmCanaryWorker(parse_options(OPTIONS).canary, [spec], {"layer0": kv}), kv


def _metadata(blocks: list[int], k: int, n: int) -> SimpleNamespace:
    """One request's attention metadata: positions [k, k + n) computed, block table
    ``blocks`` (0: the null block)."""
    return SimpleNamespace(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([k + n], dtype=torch.int32),
        block_table=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=torch.tensor([blocks[p // BS] * BS + p % BS for p in range(k, k + n)],
                                  dtype=torch.int64))  # fmt: skip


def _slot(blocks: list[int], p: int) -> int:
    return blocks[p // BS] * BS + p % BS if blocks[p // BS] else -1


def _step(w: VllmCanaryWorker, blocks: list[int], tokens: list[int], k: int, n: int,
          sent: int, seal: tuple[int, int] | None = None,
          clear: list[int] | None = None) -> list[Any]:  # fmt: skip
    """One step of request "a" (positions [k, k + n), token ids sent from ``sent``), its
    positions ``seal`` loaded (sealed) and the slots ``clear`` cleared; the rows reported."""
    meta = StepMeta()
    meta.add("a", k, n, sent, tokens[sent : k + n], _slot(blocks, k))
    if seal is not None:
        meta.seal("a", *seal, [[_slot(blocks, p) for p in range(*seal)]])
    if clear is not None:
        meta.invalid_slots = [clear]
    before = len(w.violations)
    w.on_meta(meta)
    w.before_forward([_metadata(blocks, k, n)])
    w.after_forward()
    w.flush()
    return w.violations[before:]


def _records(w: VllmCanaryWorker, slots: list[int]) -> list[list[int]]:
    r = w.records[BS]
    idx = torch.tensor(slots)
    return [buf.view(torch.int64)[idx].tolist() for buf in (r.k_head, r.k_tail, r.v_head, r.v_tail)]


TOKENS = [11 + 3 * i for i in range(14)]


def test_a_sealed_load_has_the_records_a_forward_computing_it_writes() -> None:
    """Positions [0, 10) loaded, [10, 12) computed, against one forward computing all 12:
    every slot's HEAD / TAIL, K / V records are the same (the fingerprints too: the loaded
    bytes are the ones the cache holds), nothing is reported, and the next decode step
    verifies the loaded slots."""
    blocks = [3, 7, 9, 12]
    ref, _ = _worker()
    assert _step(ref, blocks, TOKENS, 0, 12, 0) == []
    w, _ = _worker()
    assert _step(w, blocks, TOKENS, 10, 2, 0, seal=(0, 10)) == []
    slots = [_slot(blocks, p) for p in range(12)]
    assert _records(w, slots) == _records(ref, slots)
    assert _records(w, [0]) == _records(ref, [0])  # the seed's scratch slot left clean
    assert w.stats()["sealed"] == 10
    verified = w.stats()["verify_entries"]
    assert _step(w, blocks, TOKENS, 12, 1, 12) == []
    assert w.stats()["verify_entries"] - verified >= 2 * 12  # HEAD and TAIL read them all


def test_a_sliding_group_seals_from_its_first_block_chained_from_the_token_ids() -> None:
    """A sliding group (window 4) holds no block for positions [0, 4) of a load of [0, 10)
    (vLLM allocates the window only): the seal starts at position 4, its chain hash made from
    the token ids (no predecessor record to trust), and equals a full forward's records."""
    full_blocks, window_blocks = [3, 7, 9, 12], [0, 7, 9, 12]
    ref, _ = _worker(window=4)
    assert _step(ref, full_blocks, TOKENS, 0, 12, 0) == []
    w, _ = _worker(window=4)
    assert _step(w, window_blocks, TOKENS, 10, 2, 0, seal=(0, 10)) == []
    slots = [_slot(window_blocks, p) for p in range(4, 12)]
    assert _records(w, slots) == _records(ref, slots)
    assert w.stats()["sealed"] == 6


def test_loaded_bytes_changed_after_the_seal_are_reported_by_their_fingerprint() -> None:
    blocks = [3, 7, 9, 12]
    w, kv = _worker()
    assert _step(w, blocks, TOKENS, 10, 2, 0, seal=(0, 10)) == []
    kv.view(BLOCKS, HEADS, 2, BS * DIM)[7, 0, 0] += 1.0  # K of block 7 (positions 4..7), KV head 0
    rows = _step(w, blocks, TOKENS, 12, 1, 12)
    assert rows and {r.fail_reasons for r in rows} == {("verify_real_kv_hash",)}
    assert {r.slot_idx for r in rows} == {7 * BS + o for o in range(BS)}
    assert {r.launch_tag for r in rows} == {"TAIL_K_FULL"}


def test_cleared_slots_are_reported_on_their_next_read() -> None:
    """A load whose block 7 failed: its slots' records cleared before the next step (all
    zero: no verify accepts them); the next read of them is reported, nothing else."""
    blocks = [3, 7, 9, 12]
    w, _ = _worker()
    assert _step(w, blocks, TOKENS, 10, 2, 0, seal=(0, 10)) == []
    failed = [7 * BS + o for o in range(BS)]
    rows = _step(w, blocks, TOKENS, 12, 1, 12, clear=failed)
    assert w.stats()["cleared"] == BS
    bad = {r.slot_idx for r in rows if "verify_position" in r.fail_reasons}
    assert bad == set(failed)
    # the successor of the cleared run: only its chain hash (its predecessor reads as zero)
    assert {r.slot_idx for r in rows} - bad == {9 * BS}
    assert all(buf == [[0, 0, 0, 0]] * BS for buf in _records(w, failed))  # reads write nothing


def test_a_seal_of_a_request_not_in_the_step_writes_nothing() -> None:
    blocks = [3, 7, 9, 12]
    w, _ = _worker()
    meta = StepMeta()
    meta.seal("gone", 0, 8, [[_slot(blocks, p) for p in range(8)]])
    meta.add("a", 0, 3, 0, TOKENS[:3], _slot([5], 0))
    w.on_meta(meta)
    w.before_forward([_metadata([5], 0, 3)])
    w.after_forward()
    w.flush()
    assert w.violations == [] and w.stats()["sealed"] == 0
    assert _records(w, [_slot(blocks, p) for p in range(8)])[0] == [[0, 0, 0, 0]] * 8
