"""The vLLM connector's worker side (:mod:`kvcanary.integrations.vllm.worker`) without vLLM:
each live request keeps one row of the canary's tables (token ids stored once, as the
scheduler sends them), batch rows are matched to requests by the slot of their first new
token whatever their order in the batch, a finished request's row is reused emptied, and a
batch row that matches no request gets a row of its own for the step. The metadata is what
vLLM's CPU attention hands the connector (query_start_loc, seq_lens, block_table,
slot_mapping); a corrupted block table entry is reported."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvcanary.canary.kernels import fused_rows
from kvcanary.integrations.vllm import meta as meta_module
from kvcanary.integrations.vllm.meta import GroupSpec, StepMeta
from kvcanary.integrations.vllm.options import parse_options
from kvcanary.integrations.vllm.steps import group_rows_nb
from kvcanary.integrations.vllm.worker import VllmCanaryWorker

BS, BLOCKS, HEADS, DIM = 4, 64, 1, 8


class FakeVllm:
    """Requests' block lists and token ids, as vLLM's scheduler keeps them; each step's
    attention metadata for a batch order (``step``), and the meta the scheduler side sends."""

    def __init__(self) -> None:
        spec = GroupSpec(0, ("layer0",), BS, HEADS, DIM, None)
        kv = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)  # vLLM's CPU layout
        self.worker = VllmCanaryWorker(parse_options({"mode": "log"}).canary, [spec], {"layer0": kv})
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        self.next_block = 1  # block 0: vLLM's null block

    def add(self, rid: str, prompt: list[int]) -> None:
        self.tokens[rid], self.computed[rid], self.sent[rid], self.blocks[rid] = list(prompt), 0, 0, []

    def step(self, order: list[str], finished: tuple[str, ...] = (),
             block_table_fault: tuple[int, int, int] | None = None,
             loaded: dict[str, int] | None = None, pending: tuple[str, ...] = (),
             input_ids: list[int] | None = None, final: bool = True) -> None:  # fmt: skip
        """One step of the requests ``order`` (batch rows in that order): each runs its
        unsent tokens (a prompt, or the token sampled last step); ``loaded[rid]``: the
        first tokens of a new request another connector loaded (cleared, then sealed);
        ``pending``: requests whose newest token is sent as not known yet (-1, as vLLM's
        async scheduling plans a decode step), and sent known in their next step;
        ``input_ids``: the ids the forward takes (the worker's ``forward_input_ids``),
        the requests' own tokens when not given; ``final``: a finished request's tokens
        still sent as not known go with its finish (as the connector sends them)."""
        meta, qsl, seq, slots = StepMeta(finished=list(finished)), [0], [], []
        for rid in finished if final else ():
            if self.sent.get(rid, 0) < self.computed.get(rid, 0):
                meta.final(rid, self.sent[rid], self.tokens[rid][self.sent[rid] : self.computed[rid]])
        for rid, n in (loaded or {}).items():
            self.computed[rid] = n
            while len(self.blocks[rid]) * BS < n:
                self.blocks[rid].append(self.next_block)
                self.next_block += 1
            held = [self.blocks[rid][p // BS] * BS + p % BS for p in range(n)]
            meta.seal(rid, 0, n, [held])
            meta.invalid_slots = [list(held)]
        for rid in order:
            k, toks = self.computed[rid], self.tokens[rid]
            new = len(toks) - k
            while len(self.blocks[rid]) * BS < len(toks):
                self.blocks[rid].append(self.next_block)
                self.next_block += 1
            first = self.blocks[rid][k // BS] * BS + k % BS
            send = toks[self.sent[rid] :]
            if rid in pending:
                send = send[:-1] + [-1]
            meta.add(rid, k, new, self.sent[rid], send, first)
            self.sent[rid] = len(toks) - (rid in pending)
            qsl.append(qsl[-1] + new)
            seq.append(len(toks))
            slots += [self.blocks[rid][p // BS] * BS + p % BS for p in range(k, len(toks))]
        width = max(len(self.blocks[r]) for r in order)
        table = torch.zeros(len(order), width, dtype=torch.int32)
        for r, rid in enumerate(order):
            table[r, : len(self.blocks[rid])] = torch.tensor(self.blocks[rid], dtype=torch.int32)
        if block_table_fault is not None:  # (batch row, block index, new block id)
            r, i, b = block_table_fault
            table[r, i] = b
        md = SimpleNamespace(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(seq, dtype=torch.int32), block_table=table,
                             slot_mapping=torch.tensor(slots, dtype=torch.int64))  # fmt: skip
        forward = [t for rid in order for t in self.tokens[rid][self.computed[rid] :]]
        if self.worker.forward_input_ids is not None:
            ids = self.worker.forward_input_ids
            ids[: len(forward)] = torch.tensor(input_ids or forward, dtype=ids.dtype)
        self.worker.on_meta(meta)
        self.worker.before_forward([md])
        self.worker.after_forward()
        for rid in order:  # every row sampled one token
            self.computed[rid] = len(self.tokens[rid])
            self.tokens[rid].append(1000 + len(self.tokens[rid]))

    def violations(self) -> list[Any]:
        self.worker.flush()
        return self.worker.violations


def test_rows_follow_requests_across_batch_orders_and_finished_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    v = FakeVllm()
    v.add("a", list(range(10, 19)))
    v.add("b", list(range(50, 56)))
    v.step(["a", "b"])  # prefill
    for order in (["b", "a"], ["a", "b"], ["b", "a"]):  # decode, batch order changing
        v.step(order)
    w = v.worker
    rows = dict(w._rows)
    assert sorted(rows.values()) == [1, 2]
    assert w.tables.tokens[rows["a"], :12].tolist() == [*range(10, 19), 1009, 1010, 1011]
    assert int(w.tables.lens[rows["a"]]) == 12
    stats = w.stats()
    assert stats["violations"] == 0 and stats["verify_entries"] > 0
    # "a" finishes; "c" takes its row, emptied: none of a's token ids is taken for c's.
    v.add("c", list(range(70, 75)))
    v.step(["b", "c"], finished=("a",))
    v.step(["c", "b"])
    assert w._rows == {"b": rows["b"], "c": rows["a"]}
    assert w.tables.tokens[rows["a"], :7].tolist() == [70, 71, 72, 73, 74, 1005, -1]
    assert v.violations() == [] and "matches no scheduled request" not in caplog.text


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("packed", [True, False])
def test_the_token_ids_of_a_step_whose_head_never_ran_are_stored(
    fast: bool, packed: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A step's token ids go into the store in HEAD (the one-call HEAD's compiled call, or
    the full path's first): a step whose forward never reached HEAD (it raised before)
    still has them stored, when the next step's metadata arrives; the scheduler does not
    send them again. ``packed``: every step's ids travel packed (``StepMeta.pack``, as the
    scheduler side sends a prefill's many ids)."""
    v = FakeVllm()
    w = v.worker
    if packed:
        monkeypatch.setattr(meta_module, "PACK_MIN", 0)
        on_meta = w.on_meta

        def packed_on_meta(meta: StepMeta) -> None:
            meta.pack()
            assert meta.packed is not None and meta.tokens == []
            on_meta(meta)

        w.on_meta = packed_on_meta  # type: ignore[method-assign]
    w._fast_ok = fast
    v.add("a", list(range(10, 19)))
    v.add("b", list(range(50, 56)))
    v.step(["a", "b"])  # prefill
    w.before_forward = lambda metadata: None  # type: ignore[method-assign]
    w.after_forward = lambda: None  # type: ignore[method-assign]
    v.step(["a", "b"])  # sends 1009 for a, 1006 for b; no HEAD, no TAIL
    del w.before_forward, w.after_forward
    v.step(["b", "a"])
    v.step(["a", "b"])
    rows = w._rows
    assert w.tables.tokens[rows["a"], :12].tolist() == [*range(10, 19), 1009, 1010, 1011]
    assert w.tables.tokens[rows["b"], :9].tolist() == [*range(50, 56), 1006, 1007, 1008]
    assert (w.num_fast_steps > 0) == fast


def test_a_row_no_request_matches_gets_a_row_of_its_own_for_the_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A batch row whose first slot is no scheduled request's and whose counts match several
    (two prompts of one length): a row of its own, lent for the step, token ids unknown
    (-1), the other rows checked as usual; the lent row is free again after the step."""
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    v = FakeVllm()
    v.add("a", list(range(10, 15)))
    v.add("b", list(range(20, 25)))
    v.step(["a", "b"])
    w = v.worker
    before = w._num_rows
    # The next step's meta as the scheduler side sends it, but without b's first slot; the
    # step then runs on it (the fake's own meta is dropped).
    on_meta, w.on_meta = w.on_meta, (lambda meta: None)
    meta = StepMeta()
    meta.add("a", 5, 1, 5, [1005], v.blocks["a"][1] * BS + 1)
    meta.add("b", 5, 1, 5, [1005], -1)
    on_meta(meta)
    v.step(["a", "b"])
    assert "batch row 1 matches no scheduled request" in caplog.text
    assert w._num_rows == before + 1 and w._free_rows == [before] and w._lent == []
    assert v.violations() == []  # b's slots still verified (its records hold its tokens)


def test_a_block_table_entry_pointing_elsewhere_is_reported() -> None:
    """The rows come from the block table attention reads: a decode step whose block table
    sends request a's second block to b's is caught by HEAD (chain hash)."""
    v = FakeVllm()
    v.add("a", list(range(10, 19)))
    v.add("b", list(range(50, 59)))
    v.step(["a", "b"])
    v.step(["b", "a"])
    assert v.violations() == []
    v.step(["b", "a"], block_table_fault=(1, 1, v.blocks["b"][1]))
    rows = v.violations()
    assert rows and {r.launch_tag for r in rows} >= {"HEAD_K_FULL"}
    assert "verify_chain_hash" in {reason for r in rows for reason in r.fail_reasons}


@pytest.mark.parametrize("fast", [True, False])
def test_records_carry_the_forward_ids_but_where_the_scheduler_sends_0(fast: bool) -> None:
    """With the model runner's input-id buffer (``forward_input_ids``) the records carry the
    ids the forward took, and the next read checks them against the scheduler's: a decode
    input other than the sampled token is verify_token at its slot. Where the scheduler's
    id is 0 (vLLM's prompt-embedding positions, whose buffer entries are a sentinel or a
    stale id, not a token's) the records keep the scheduler's 0: no violation there."""
    v = FakeVllm()
    w = v.worker
    w._fast_ok = fast
    w.forward_input_ids = torch.zeros(256, dtype=torch.int32)
    v.add("a", [0, 0, 0, 0, 0, 31, 32])  # five embedding positions, then two token ids
    v.add("b", list(range(50, 57)))
    stale = [91, 92, 93, 94, 95, 31, 32, *range(50, 57)]  # a's embedding rows: stale ids
    v.step(["a", "b"], input_ids=stale)
    for order in (["b", "a"], ["a", "b"]):
        v.step(order)
    assert v.violations() == []
    b_pos = len(v.tokens["b"]) - 1  # b's next input: its last sampled token
    wrong = [v.tokens["a"][-1], 4242]
    v.step(["a", "b"], input_ids=wrong)
    v.step(["a", "b"])
    rows = [r for r in v.violations() if "verify_token" in r.fail_reasons]
    slot = v.blocks["b"][b_pos // BS] * BS + b_pos % BS
    assert {(r.slot_idx, r.position, r.stored_token, r.expected_token) for r in rows} == {
        (slot, b_pos, 4242, v.tokens["b"][b_pos])}  # fmt: skip
    assert {r.launch_tag for r in rows} == {"HEAD_K_FULL", "TAIL_K_FULL"}  # the next step's


@pytest.mark.parametrize("fast", [True, False])
def test_a_token_id_the_scheduler_sent_differently_is_reported_through_the_batch_block(
    fast: bool,
) -> None:
    """verify_tokens (the default): the token ids the scheduler sent are the expectation the
    records are checked against. One of them changed in the worker's token store after it
    was written (as a scheduler bug resending another id would) is reported by the next
    HEAD as verify_token at that token's slot. The step's batch reached HEAD as a batch
    block carrying the token table: made by the worker's one-call HEAD
    (:func:`.steps.head_step_nb`, ``fast``), or on the full path as host arrays (no
    tensors made) through the manager."""
    v = FakeVllm()
    v.add("a", list(range(10, 19)))
    v.add("b", list(range(50, 56)))
    v.step(["a", "b"])
    v.step(["b", "a"])
    w = v.worker
    w._fast_ok = fast
    seen = []
    before_forward = w.managers[0].before_forward

    def spy(batch: Any, *args: Any, **kwargs: Any) -> None:
        seen.append((batch.host_arrays is not None, batch._tensors is None))
        before_forward(batch, *args, **kwargs)

    w.managers[0].before_forward = spy  # type: ignore[method-assign]
    blocks = []
    batch_block = fused_rows.FusedRowLaunches.batch_block

    def spy_block(host: Any) -> Any:
        blocks.append(batch_block(host))
        return blocks[-1]

    fused_rows.FusedRowLaunches.batch_block = staticmethod(spy_block)  # type: ignore[method-assign]
    fast_steps = w.num_fast_steps
    try:
        w.tables.tokens[w._rows["a"], 4] += 1
        v.step(["a", "b"])
    finally:
        fused_rows.FusedRowLaunches.batch_block = staticmethod(batch_block)  # type: ignore[method-assign]
    if fast:
        assert seen == [] and blocks == [] and w.num_fast_steps == fast_steps + 1
        assert w._batch_block[17] == 1  # a token table
    else:
        assert seen == [(True, True)] and w.num_fast_steps == fast_steps
        assert len(blocks) == 1 and blocks[0] is not None and blocks[0][17] == 1
    rows = v.violations()
    token_rows = [r for r in rows if r.fail_reasons == ("verify_token",)]
    assert {(r.slot_idx, r.position) for r in token_rows} == {(v.blocks["a"][1] * BS, 4)}
    # The slots after it: KV made after another token than the reader's (the reader chain).
    after = {r.position for r in rows if r not in token_rows}
    assert after and after == set(range(5, max(after) + 1))
    assert {r.fail_reasons for r in rows if r not in token_rows} == {("verify_chain_hash",)}


def _three_requests(v: FakeVllm) -> None:
    """Three requests joining over two steps, then decoding across a block boundary."""
    for i in range(3):
        v.add(f"r{i}", list(range(1 + i, 12 + 5 * i)))
    v.step(["r0", "r1"])
    v.step(["r1", "r0", "r2"])
    for _ in range(BS + 1):
        v.step(["r2", "r0", "r1"])


def _scenario(fast: bool, real_data: str, forward_ids: bool) -> FakeVllm:
    """Requests joining, decoding, reordered, finishing and reusing rows, async-scheduled
    tokens (``forward_ids``: recorded with the id the forward used, one of them wrong), and
    faults: a block-table entry repointed, a token id changed in the store."""
    v = FakeVllm()
    kv = torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=torch.Generator().manual_seed(3))
    v.worker = VllmCanaryWorker(parse_options({"mode": "log", "real_data": real_data}).canary,
                                list(v.worker.specs), {"layer0": kv})  # fmt: skip
    v.worker._fast_ok = fast
    if forward_ids:
        v.worker.forward_input_ids = torch.zeros(64, dtype=torch.int32)  # vLLM's: int32
    _three_requests(v)
    v.step(["r1", "r2"], pending=("r1", "r2"))
    v.step(["r2", "r1"], pending=("r2",), input_ids=[5, 1000 + len(v.tokens["r1"]) - 1]
           if forward_ids else None)  # fmt: skip
    v.step(["r0", "r2", "r1"], block_table_fault=(1, 0, 40))
    v.worker.tables.tokens[v.worker._rows["r1"], 3] += 7
    v.step(["r1", "r0", "r2"], finished=())
    v.step(["r2", "r1"], finished=("r0",))
    v.add("r3", list(range(1, 12)))  # r0's prompt: its slots are reused
    v.step(["r3", "r1"])
    for _ in range(3):
        v.step(["r3", "r1", "r2"])
    return v


@pytest.mark.parametrize(("real_data", "forward_ids"),
                         [("none", False), ("partial", False), ("partial", True)])
def test_one_call_head_leaves_the_state_of_the_full_path(real_data: str, forward_ids: bool) -> None:
    """The worker's one-call HEAD of a single-group CPU step (:func:`.steps.head_step_nb`)
    against the full path (the batch, the rows, the manager's fused HEAD), on the same
    steps with faults: the same records (HEAD and TAIL, K), ring rows in the same order,
    counters and req->token tables; it ran on most steps."""
    fast, full = _scenario(True, real_data, forward_ids), _scenario(False, real_data, forward_ids)
    assert fast.worker.num_fast_steps >= 10 and full.worker.num_fast_steps == 0
    a, b = fast.worker, full.worker
    for buf in ("k_head", "k_tail"):
        assert torch.equal(getattr(a.records[BS], buf), getattr(b.records[BS], buf)), buf
    assert np.array_equal(a.tables.r2t_host[0], b.tables.r2t_host[0])
    assert a.stats() == b.stats()
    va, vb = fast.violations(), full.violations()
    assert va and [str(x) for x in va] == [str(x) for x in vb]
    assert {"verify_token", "verify_chain_hash"} <= {f for x in va for f in x.fail_reasons}
    assert a.num_settled == b.num_settled and a.num_arrived == b.num_arrived > 0


def warm_worker_scenario(extra: dict[str, Any]) -> None:
    from kvcanary.engine.warmup import loaded_kernels
    from kvcanary.integrations.vllm.warmup import warm_worker

    spec = GroupSpec(0, ("layer0",), BS, HEADS, DIM, None)
    kv = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)
    extra = dict(extra)
    forward_ids = extra.pop("forward_ids", False)  # the model runner's int32 input-id buffer
    fwd = torch.zeros(4096, dtype=torch.int32) if forward_ids else None
    config = parse_options(extra).canary
    report = warm_worker(config, [spec], {"layer0": kv}, fwd)
    assert report.skipped is None
    warm = loaded_kernels()
    assert any(".fused_rows." in name for name, _ in warm)
    assert any("vllm.steps.batch_nb" in name for name, _ in warm)
    fake = FakeVllm()
    fake.worker = VllmCanaryWorker(config, [spec], {"layer0": kv})
    fake.worker.forward_input_ids = None if fwd is None else torch.zeros_like(fwd)
    _three_requests(fake)
    for _ in range(2):  # async scheduling: tokens planned unknown, known a step later
        fake.step(["r1", "r2"], pending=("r1", "r2"))
    fake.step(["r2", "r1"], finished=("r0",))
    fake.add("r3", list(range(70, 70 + BS + 3)))  # its first BS + 1 tokens loaded elsewhere
    fake.step(["r3"], loaded={"r3": BS + 1})
    assert fake.violations() == [] and fake.worker.stats()["sealed"] == BS + 1
    assert sorted(map(str, loaded_kernels() - warm)) == []
    assert not torch.any(kv)  # the warm-up wrote nothing into the cache


@pytest.mark.parametrize("extra", [{"mode": "log"}, {"mode": "raise", "real_data": "partial", "v_half": True},
                                   {"mode": "log", "forward_ids": True}])
def test_warm_worker_compiles_every_kernel_the_worker_calls(extra: dict[str, Any]) -> None:
    """After the connector's start-up warm-up (synthetic steps on a throwaway worker over
    the same layer tensors), a worker's real steps, in a fresh process, need no kernel the
    warm-up did not compile or load: nothing compiles in a forward."""
    here = str(Path(__file__).parent)
    code = (f"import sys; sys.path[:0] = [{here!r}]; import test_vllm_worker_rows as t; "
            f"t.warm_worker_scenario({extra!r})")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("window", [0, 5])
def test_group_rows_kept_across_steps_equal_a_rebuild(window: int) -> None:
    """``group_rows_nb`` keeps a group's rows across steps: a full group's (``window`` 0)
    rewriting only the blocks whose block-table entry changed, a sliding group's from its
    window's start on, zero below. Over random steps (sequences growing, jumping by a chunk
    and restarting, old entries repointed, null blocks, rows changing hands between
    requests) every row equals one rebuilt from that step's block table below ``seq``,
    at every position the planner or the dependency check reads."""
    rng = np.random.default_rng(7)
    bs, num_rows, width = 4, 6, 64
    table = np.zeros((num_rows, width), dtype=np.int64)
    seen = np.full((num_rows, width // bs + 1), -1, dtype=np.int64)
    seqs = rng.integers(1, 30, size=num_rows)
    blocks = rng.integers(0, 50, size=(num_rows, width // bs))
    rewritten = 0
    for _ in range(300):
        grow = np.where(rng.random(num_rows) < 0.2, rng.integers(2, 12, size=num_rows), 1)
        seqs = np.where(rng.random(num_rows) < 0.1, rng.integers(1, 30, size=num_rows),
                        np.minimum(seqs + grow, width))  # fmt: skip
        changed = rng.random(blocks.shape) < 0.03
        blocks = np.where(changed, rng.integers(0, 50, size=blocks.shape), blocks)
        batch = rng.permutation(num_rows)[: rng.integers(1, num_rows + 1)]  # rows, any order
        bt = blocks[batch].astype(np.int32)
        seq = seqs[batch].astype(np.int64)
        prefix = np.maximum(seq - rng.integers(1, 4, size=seq.shape[0]), 0)
        before = table.copy()
        group_rows_nb(bt, np.zeros(0, dtype=np.int64), seq, prefix, bs, window, table,
                      batch.astype(np.int64), 0, seen)  # fmt: skip
        rewritten += int((table != before).sum())
        for r, row in enumerate(batch):
            p = np.arange(seq[r])
            b = bt[r, p // bs].astype(np.int64)
            keep = (b != 0) & (p >= prefix[r] - window + 1 if window else True)
            assert (table[row, : seq[r]] == np.where(keep, b * bs + p % bs, 0)).all()
    assert rewritten > 0  # (the steps changed rows: the comparison saw rewrites)
