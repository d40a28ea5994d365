"""Async scheduling on the vLLM connector's worker side, without vLLM: a decode step's
token is sent as not known (-1) when the step is planned and arrives in a later step's
metadata. The worker settles the records of such positions (:func:`.steps.settle_nb` on
the CPU, :func:`.steps.settle_t` in torch ops elsewhere) or, with the forward's input ids
(``forward_input_ids``), has them carry the id the forward used; either way reads from the
arrival on check the token, and a forward that took another id than the scheduler's is
reported as verify_token."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_vllm_worker_rows import BS, FakeVllm

from kvcanary.canary.wire.hashing import ANCHOR_HASH_I64, chain_hash
from kvcanary.canary.wire.hashing import to_i64 as i64
from kvcanary.integrations.vllm.steps import meta_nb, settle_nb, settle_t


def _records(v: FakeVllm, rid: str, positions: range, buf: str = "k_head") -> list[list[int]]:
    view = getattr(v.worker.records[BS], buf).view(torch.int64)
    return [view[v.blocks[rid][p // BS] * BS + p % BS, :3].tolist() for p in positions]


def _chained(tokens: list[int]) -> list[list[int]]:
    """The (token, position, prev_hash) records of a request with these token ids."""
    out, prev = [], ANCHOR_HASH_I64
    for p, t in enumerate(tokens):
        out.append([t, p, prev])
        prev = i64(chain_hash(prev, t, p))
    return out


def _async_run(v: FakeVllm, steps: int, **kwargs: object) -> None:
    v.add("a", list(range(10, 19)))
    v.add("b", list(range(50, 56)))
    v.step(["a", "b"])
    for i in range(steps):  # decode, each token planned before it is known
        v.step(["a", "b"] if i % 2 else ["b", "a"], pending=("a", "b"), **kwargs)


def test_async_planned_records_are_settled_and_then_checked() -> None:
    v = FakeVllm()
    _async_run(v, 6)
    w = v.worker
    stats = w.stats()
    # 6 pending decode tokens per request; the first 5 arrived (the last is still pending).
    assert stats["async_arrived"] == 2 * 5 and stats["async_settled"] == 2 * 5
    assert v.violations() == [] and stats["verify_entries"] > 0
    a = v.tokens["a"]
    # Records of a's positions, HEAD and TAIL: the real tokens and the chain made from
    # them up to the last written position (14: its token not known yet, -1).
    for buf in ("k_head", "k_tail"):
        recs = _records(v, "a", range(15), buf)
        want = _chained(a[:14] + [-1])
        assert recs == want, buf
    # A token the scheduler now sends differently for a settled position is reported.
    w.tables.tokens[w._rows["a"], 12] += 1
    v.step(["a", "b"])
    rows = v.violations()
    slot = v.blocks["a"][12 // BS] * BS + 12 % BS
    assert {(r.slot_idx, r.position) for r in rows if "verify_token" in r.fail_reasons} == {
        (slot, 12)
    }


def test_forward_input_ids_are_recorded_and_a_wrong_one_is_reported_on_arrival() -> None:
    v = FakeVllm()
    v.worker.forward_input_ids = torch.zeros(64, dtype=torch.int32)  # vLLM's: int32
    _async_run(v, 3)
    assert v.worker.stats()["async_settled"] == 0  # the records had the forward's ids
    assert v.violations() == []
    # The next decode's forward takes another id for a's token than the one sampled.
    a_pos = len(v.tokens["a"]) - 1
    true_a = v.tokens["a"][a_pos]
    v.step(["a", "b"], pending=("a", "b"), input_ids=[true_a + 7, v.tokens["b"][-1]])
    slot = v.blocks["a"][a_pos // BS] * BS + a_pos % BS
    assert _records(v, "a", range(a_pos, a_pos + 1))[0][0] == true_a + 7
    assert v.violations() == []  # not known to the scheduler yet: nothing to compare
    v.step(["b", "a"], pending=("a", "b"))  # its metadata brings the sampled token
    rows = v.violations()
    token_rows = {(r.slot_idx, r.position, r.stored_token, r.expected_token)
                  for r in rows if "verify_token" in r.fail_reasons}  # fmt: skip
    assert token_rows == {(slot, a_pos, true_a + 7, true_a)}
    assert v.worker.stats()["async_settled"] == 0


def test_a_pending_slot_another_write_took_is_not_settled() -> None:
    """A pending record overwritten (here: by a write with a known token, at the same
    position) is not the request's any more: settling leaves it, the next read reports it."""
    v = FakeVllm()
    _async_run(v, 2)
    a_pos = len(v.tokens["a"]) - 2  # planned in the last step, pending
    slot = v.blocks["a"][a_pos // BS] * BS + a_pos % BS
    view = v.worker.records[BS].k_head.view(torch.int64)
    assert view[slot, 0] == -1 and view[slot, 1] == a_pos
    view[slot, 0] = 999  # another request's KV, its token known
    v.step(["a", "b"], pending=("a", "b"))
    rows = v.violations()
    assert {(r.slot_idx, r.position, r.stored_token) for r in rows
            if "verify_token" in r.fail_reasons} == {(slot, a_pos, 999)}  # fmt: skip


def _scenario(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Records of a few requests' chains ending in pending (-1) positions, some of them
    overwritten or broken, and arrivals (several per row, in position order)."""
    rng = random.Random(seed)
    rows, width, num_slots = 4, 24, 200
    rec = np.zeros((num_slots, 4), dtype=np.int64)
    table = np.zeros((rows, width), dtype=np.int64)
    lens = np.zeros(rows, dtype=np.int64)
    free = list(range(1, num_slots))
    rng.shuffle(free)
    arrivals = []
    for row in range(1, rows):
        n = rng.randrange(6, width)
        pending = rng.randrange(1, 4)
        toks = [rng.randrange(1, 500) for _ in range(n)]
        chain = _chained(toks[: n - pending] + [-1] * pending)
        for p in range(n):
            s = free.pop()
            table[row, p] = s
            rec[s, :3] = chain[p]
            rec[s, 3] = rng.randrange(1 << 40)
        lens[row] = n
        arrive = rng.randrange(1, pending + 1)
        for p in range(n - pending, n - pending + arrive):
            arrivals.append((row, p, toks[p]))
        if rng.random() < 0.5:  # a successor's chain broken (not re-chained past it)
            q = rng.randrange(n - pending, n)
            rec[table[row, q], 2] ^= 1
        if rng.random() < 0.3:  # an arriving position's record not the request's
            rec[table[row, n - pending], 1] += 100
    return rec, table, np.array(arrivals, dtype=np.int64).T.copy(), lens


def _settle_reference(rec: np.ndarray, table: np.ndarray, arrivals: np.ndarray,
                      lens: np.ndarray) -> int:  # fmt: skip
    """settle_nb's rule in plain Python ints."""
    num = 0
    for row, p, t in arrivals.T.tolist():
        s = int(table[row, p])
        if s <= 0 or rec[s, 1] != p or rec[s, 0] != -1:
            continue
        old, new = i64(chain_hash(int(rec[s, 2]), -1, p)), i64(chain_hash(int(rec[s, 2]), t, p))
        rec[s, 0], num = t, num + 1
        for q in range(p + 1, min(int(lens[row]), table.shape[1])):
            s2 = int(table[row, q])
            if s2 <= 0 or rec[s2, 1] != q or rec[s2, 2] != old:
                break
            token = int(rec[s2, 0])
            rec[s2, 2] = new
            old, new = i64(chain_hash(old, token, q)), i64(chain_hash(new, token, q))
    return num


@pytest.mark.parametrize("seed", range(12))
def test_settle_numba_and_torch_match_the_rule(seed: int) -> None:
    rec, table, arrivals, lens = _scenario(seed)
    want = rec.copy()
    num = _settle_reference(want, table, arrivals, lens)
    got_nb = rec.copy()
    assert settle_nb(got_nb, table, arrivals, lens) == num
    got_t = torch.from_numpy(rec.copy())
    num_t = settle_t(got_t, torch.from_numpy(table), torch.from_numpy(arrivals),
                     torch.from_numpy(lens))  # fmt: skip
    assert num_t == num
    assert np.array_equal(got_nb, want) and np.array_equal(got_t.numpy(), want)
    assert num == 0 or not np.array_equal(want, rec)  # something was settled


def test_settle_scenarios_cover_settles_breaks_and_skips() -> None:
    """The random scenarios above settle records, stop re-chaining at a broken successor,
    and skip records that are not the request's."""
    settled = skipped = 0
    for seed in range(12):
        rec, table, arrivals, lens = _scenario(seed)
        num = _settle_reference(rec.copy(), table, arrivals, lens)
        settled += num
        skipped += arrivals.shape[1] - num
    assert settled > 10 and skipped > 0


@pytest.mark.parametrize("final", [True, False])
def test_a_finished_requests_last_planned_token_is_settled_with_its_finish(final: bool) -> None:
    """A request that finishes while its last computed position's token was sent as not
    known: its finish carries that token, the record is settled, and a later request that
    hits its blocks reads it clean. Without it (``final`` False, what the connector sent
    before) the record keeps token -1 and the prefix hit is reported: a false report."""
    v = FakeVllm()
    _async_run(v, 3)  # a computed 12 positions (3 full blocks), the last one planned as -1
    assert v.computed["a"] == 12 and v.sent["a"] == 11
    v.step(["b"], finished=("a",), final=final)
    v.add("c", v.tokens["a"][:12] + [777])  # a prefix hit on a's three blocks
    v.blocks["c"], v.computed["c"] = list(v.blocks["a"][:3]), 12
    v.step(["c"])
    slot = v.blocks["a"][11 // BS] * BS + 11 % BS
    rows = v.violations()
    if final:
        assert rows == []
        assert _records(v, "a", range(12)) == _chained(v.tokens["a"][:12])
        assert v.worker.stats()["async_settled"] > 2 * 2  # the running steps' and a's last
    else:
        assert {(r.slot_idx, r.position) for r in rows if "verify_token" in r.fail_reasons} == {
            (slot, 11)
        }


@pytest.mark.parametrize("num_requests", [5, 200])  # in-place sort / argsort
def test_meta_stores_tokens_sorts_first_slots_and_lists_arrivals(num_requests: int) -> None:
    """:func:`.steps.meta_nb`: each request's token ids land in its row of the store (its
    length grows), the allocated first slots come out sorted with their rows (equal slots
    in request order), and a position stored as not known (-1) whose token arrives below
    the request's computed count is an arrival; a store too narrow is left untouched."""
    rng = np.random.default_rng(num_requests)
    n = num_requests
    rows = np.arange(1, n + 1, dtype=np.int64)
    first = rng.integers(-1, n // 2 + 2, n) * BS  # unallocated (< 0) and shared slots
    first[first < 0] = -1
    starts = rng.integers(0, 4, n)
    counts = rng.integers(1, 4, n)
    computed = starts + counts - rng.integers(0, 2, n)
    cols = np.stack([computed, counts, starts, counts, first], axis=1).astype(np.int64).reshape(-1)
    tokens = rng.integers(0, 100, int(counts.sum())).astype(np.int64)
    store = np.full((n + 1, 8), -1, dtype=np.int64)
    lens = np.zeros(n + 1, dtype=np.int64)
    pending = rng.random(n) < 0.5  # rows whose known prefix covers their new positions
    lens[rows[pending]] = 8
    before = store.copy()
    out = np.zeros((5, max(n, tokens.shape[0])), dtype=np.int64)
    narrow = np.full((n + 1, 2), -1, dtype=np.int64)
    assert meta_nb(rows, cols, tokens, narrow, lens.copy(), out) == (0, 0, int((starts + counts).max()))
    assert (narrow == -1).all()

    num_keys, num_arrived, _ = meta_nb(rows, cols, tokens, store, lens, out)

    keep = first >= 0
    order = np.argsort(first[keep], kind="mergesort")
    assert num_keys == int(keep.sum())
    assert out[0, :num_keys].tolist() == first[keep][order].tolist()
    assert out[1, :num_keys].tolist() == rows[keep][order].tolist()
    want_arrivals, at = [], 0
    for i in range(n):
        for j in range(counts[i]):
            p, t = starts[i] + j, tokens[at + j]
            assert store[rows[i], p] == t
            if pending[i] and p < computed[i] and before[rows[i], p] == -1:
                want_arrivals.append([rows[i], p, t])
        at += counts[i]
        assert lens[rows[i]] == (8 if pending[i] else starts[i] + counts[i])
    assert out[2:, :num_arrived].T.tolist() == want_arrivals
    assert num_arrived > 0
