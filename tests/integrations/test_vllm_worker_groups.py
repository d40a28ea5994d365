"""The vLLM connector's worker on a hybrid model's steps (several KV cache groups: full and
sliding-window layers) without vLLM: the one-call HEAD and TAIL of a CPU step with several
groups (:func:`kvcanary.integrations.vllm.steps.head_groups_nb`, ``tail_groups_nb``) leave
exactly the state the worker's full path leaves, faults included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvcanary.integrations.vllm.meta import GroupSpec
from kvcanary.integrations.vllm.options import parse_options
from kvcanary.integrations.vllm.warmup import _Synthetic
from kvcanary.integrations.vllm.worker import VllmCanaryWorker

BS, BLOCKS, HEADS, DIM, WINDOW = 4, 96, 2, 8, 6
# Group g's block b is block b + g * SPREAD of the shared pool (vLLM's groups share one
# block pool: no two groups hold the same block). Group 0, the full one, is the key group:
# its blocks are the synthetic scheduler's own, whose first slots the step metadata names.
SPREAD = 32
SPECS = [GroupSpec(0, ("full0",), BS, HEADS, DIM, None),
         GroupSpec(1, ("swa0",), BS, HEADS, DIM, WINDOW),
         GroupSpec(2, ("swa1",), BS, HEADS, DIM, WINDOW)]  # fmt: skip


class Hybrid:
    """A worker over three groups (one full, two sliding) and the steps vLLM's scheduler
    would hand it, each group's blocks its own."""

    def __init__(self, fast: bool, real_data: str):
        gen = torch.Generator().manual_seed(5)
        layers = {name: torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=gen)
                  for s in SPECS for name in s.layer_names}  # fmt: skip
        config = parse_options({"mode": "log", "real_data": real_data}).canary
        self.worker = VllmCanaryWorker(config, SPECS, layers)
        self.worker._fast_ok = fast
        self.fake = _Synthetic(self.worker.specs, self.worker.device)

    def step(self, work: dict[str, int], finished: tuple[str, ...] = (),
             pending: tuple[str, ...] = (), fault: tuple[int, int, int, int] | None = None,
             ) -> None:  # fmt: skip
        """One step; ``fault``: (group, batch row, block index, block of the pool) repointed
        in that group's block table (the forward reads another block than the one it
        holds)."""
        meta, mds, _ = self.fake.step(work, finished=finished, pending=pending)
        for g, md in enumerate(mds):
            md.block_table = torch.where(md.block_table != 0, md.block_table + g * SPREAD, 0)
            md.slot_mapping = md.slot_mapping + g * SPREAD * BS
        if fault is not None:
            g, r, i, b = fault
            mds[g].block_table[r, i] = b
        self.worker.on_meta(meta)
        self.worker.before_forward(mds)
        self.worker.after_forward()

    def block(self, g: int, rid: str, i: int) -> int:
        """Group ``g``'s block ``i`` of request ``rid``, as a block of the pool."""
        return self.fake.blocks[rid][i] + g * SPREAD


def _scenario(fast: bool, real_data: str) -> Hybrid:
    h = Hybrid(fast, real_data)
    h.fake.add("a", [1 + i % 13 for i in range(11)])
    h.fake.add("b", [40 + i for i in range(9)])
    h.step({"a": 11, "b": 9})
    for order in (("b", "a"), ("a", "b"), ("b", "a")):  # decode, batch order changing
        h.step(dict.fromkeys(order, 1))
    h.fake.add("c", [7] * 10)
    h.step({"c": 10, "a": 1, "b": 1})
    for _ in range(BS + 1):  # across a block boundary
        h.step({"a": 1, "c": 1, "b": 1})
    # A sliding group reads a block inside its window that holds another request's KV.
    k = h.fake.computed["a"]
    h.step({"b": 1, "a": 1}, fault=(1, 1, (k - 2) // BS, h.block(1, "c", 1)))
    # The full group reads the block another group writes in the same step: only a verify
    # after every group's writes sees that write (the groups share one record buffer).
    k = h.fake.computed["b"]
    h.step({"a": 1, "b": 1}, fault=(0, 0, 0, h.block(2, "b", k // BS)))
    h.worker.tables.tokens[h.worker._rows["b"], 3] += 7  # a token id changed in the store
    h.step({"a": 1, "b": 1, "c": 1})
    for _ in range(2):  # async scheduling: tokens planned unknown, known a step later
        h.step({"a": 1, "b": 1}, pending=("a", "b"))
    h.fake.add("d", [9] * 7)
    h.step({"d": 7, "b": 1}, finished=("a",))  # a's row reused
    for _ in range(3):
        h.step({"d": 1, "b": 1, "c": 1})
    h.worker.flush()
    return h


@pytest.mark.parametrize("real_data", ["none", "partial"])
def test_hybrid_one_call_hooks_leave_the_state_of_the_full_path(real_data: str) -> None:
    """Three groups, faults in one sliding group's block table and in the token store:
    the one-call HEAD / TAIL and the full path leave the same records (HEAD and TAIL),
    every group's req->token rows, the same ring rows in the same order, the same counters;
    the one-call HEAD ran on most steps, and the faults were reported."""
    fast, full = _scenario(True, real_data), _scenario(False, real_data)
    a, b = fast.worker, full.worker
    assert a.num_fast_steps >= 14 and b.num_fast_steps == 0
    for buf in ("k_head", "k_tail"):
        assert torch.equal(getattr(a.records[BS], buf), getattr(b.records[BS], buf)), buf
    for g in range(len(SPECS)):
        assert np.array_equal(a.tables.r2t_host[g], b.tables.r2t_host[g]), g
    assert a.stats() == b.stats()
    va, vb = [str(v) for v in a.violations], [str(v) for v in b.violations]
    assert va and va == vb
    reasons: set[Any] = {f for v in a.violations for f in v.fail_reasons}
    assert "verify_token" in reasons and reasons - {"verify_token", "verify_chain_hash"}
