"""Each vLLM step's attention metadata as the canary's forward batches: the req->token
tables all groups share (:class:`StepTables`), their per-group views and hosts, and the
compiled passes that bring them up to date with vLLM's block tables every step.

Sliding groups: vLLM frees the blocks that leave a window without telling the worker (its
block table keeps the stale ids), so rows keep only positions ``>= K - W + 1`` (K: tokens
already computed), exactly the ones the scheduler keeps (``SlidingWindowManager``); a hole
inside that range is ``verify_not_resident``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numba
import numpy as np
import torch

from kvcanary.canary.kernels.fused_rows import (
    _DONE,
    _PLAN_FAILED,
    _a1,
    _batch_block_nb,
    _plan_phase,
    _tail_batch_nb,
    _verify_body,
    _write_phase,
)
from kvcanary.canary.kernels.numba_kernels import i32_ptr, i64_ptr
from kvcanary.canary.wire.hashing import ANCHOR_HASH_I64, chain_hash_nb, chain_hash_t
from kvcanary.integrations.vllm.meta import COL_COMPUTED, COL_COUNT, COL_SLOT, COL_START, NUM_COLS
from kvcanary.integrations.vllm.pool import VllmGroupPool

# meta_nb sorts at most this many first slots in place (more: an argsort)
_SORT_IN_PLACE = 64


class StepTables:
    """The req->token tables (one per group) and the token mirror, all groups sharing rows:
    each live request keeps one row (1 and up; row 0 = padding) from the first step it runs
    until it finishes. Its token ids go into the host store (``tokens`` / ``lens``, numpy)
    as the scheduler sends them (:meth:`.worker.VllmCanaryWorker.on_meta`); its req->token rows are
    brought up to date with the block tables every step it runs (:func:`group_rows_nb`). On the CPU the mirror the canary
    reads (``token_ids`` / ``token_lens``) is the store itself; on another device the rows
    of a step's batch are copied there. Grown on demand (token ids kept)."""

    def __init__(self, num_groups: int, device: torch.device):
        self.device = device
        self.r2t = [torch.zeros(1, 1, dtype=torch.int64, device=device)
                    for _ in range(num_groups)]  # fmt: skip
        self.r2t_host = self._r2t_host()
        self.tokens = np.full((1, 1), -1, dtype=np.int64)
        self.lens = np.zeros(1, dtype=np.int64)
        self.token_ids, self.token_lens = self._mirror()
        # Per group, the block ids each row's req->token row holds (group_rows_nb), made on
        # first use and dropped with the tables they describe.
        self._seen: list[np.ndarray | None] = [None] * num_groups

    def _r2t_host(self) -> list[np.ndarray]:
        """The req->token tables as numpy views (on the CPU; empty elsewhere)."""
        return [t.numpy() for t in self.r2t] if self.device.type == "cpu" else []

    def _mirror(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, lens = torch.from_numpy(self.tokens), torch.from_numpy(self.lens)
        if self.device.type == "cpu":
            return ids, lens
        return torch.full_like(ids, -1, device=self.device), lens.to(self.device)

    def ensure(self, rows: int, cols: int) -> None:
        have_rows, have_cols = self.tokens.shape
        if rows <= have_rows and cols <= have_cols:
            return
        rows = max(rows, 2 * have_rows) if rows > have_rows else have_rows
        cols = max(cols, 2 * have_cols) if cols > have_cols else have_cols
        for g in range(len(self.r2t)):
            self.r2t[g] = torch.zeros(rows, cols, dtype=torch.int64, device=self.device)
        self.r2t_host = self._r2t_host()
        self._seen = [None] * len(self.r2t)
        tokens = np.full((rows, cols), -1, dtype=np.int64)
        tokens[:have_rows, :have_cols] = self.tokens
        lens = np.zeros(rows, dtype=np.int64)
        lens[:have_rows] = self.lens
        self.tokens, self.lens = tokens, lens
        self.token_ids, self.token_lens = self._mirror()

    def seen(self, group: int, block_size: int) -> np.ndarray:
        """Group ``group``'s block ids per row and block index that its host req->token
        row holds (-1: none; :func:`group_rows_nb`)."""
        seen = self._seen[group]
        if seen is None:
            rows, cols = self.r2t_host[group].shape
            seen = self._seen[group] = np.full((rows, cols // block_size + 1), -1,
                                               dtype=np.int64)  # fmt: skip
        return seen

    def publish(self, rows: np.ndarray) -> None:
        """The mirror rows ``rows`` as the store holds them (off the CPU: copied over)."""
        if self.device.type != "cpu":
            idx = torch.from_numpy(rows).to(self.device)
            self.token_ids[idx] = torch.from_numpy(self.tokens[rows]).to(self.device)
            self.token_lens[idx] = torch.from_numpy(self.lens[rows]).to(self.device)


class GroupTableView:
    """The :class:`~kvcanary.canary.host.ReqToTokenTable` (+ TokenMirror) of one group."""

    def __init__(self, tables: StepTables, group: int):
        self._tables, self._group = tables, group

    @property
    def req_to_token(self) -> torch.Tensor:
        return self._tables.r2t[self._group]

    @property
    def token_ids(self) -> torch.Tensor:
        return self._tables.token_ids

    @property
    def token_lens(self) -> torch.Tensor:
        return self._tables.token_lens


@dataclass
class GroupHost:
    """The :class:`~kvcanary.canary.host.CanaryHost` of one group."""

    token_to_kv_pool: VllmGroupPool
    req_to_token_pool: GroupTableView
    device: torch.device
    sliding_window: int | None
    is_draft_worker: bool = False


class StepBatch:
    """A :class:`~kvcanary.canary.host.ForwardBatchView` of one group for one step: six
    tensors, or on the CPU their numpy arrays (``host_arrays``, which the canary reads),
    made into tensors only when something asks for one."""

    __slots__ = ("_tensors", "host_arrays")

    def __init__(self, tensors: tuple[torch.Tensor, ...] | None,
                 host_arrays: tuple[np.ndarray, ...] | None = None) -> None:  # fmt: skip
        self._tensors, self.host_arrays = tensors, host_arrays

    def _field(self, i: int) -> torch.Tensor:
        if self._tensors is None:
            self._tensors = tuple(torch.from_numpy(a) for a in cast(tuple, self.host_arrays))
        return self._tensors[i]

    req_pool_indices = property(lambda self: self._field(0))
    prefix_lens = property(lambda self: self._field(1))
    extend_seq_lens = property(lambda self: self._field(2))
    input_ids = property(lambda self: self._field(3))
    positions = property(lambda self: self._field(4))
    out_cache_loc = property(lambda self: self._field(5))


class BufferStepBatch(StepBatch):
    """The :class:`StepBatch` of a step the worker's one-call HEAD ran
    (:func:`head_step_nb`): its host arrays are the first ``n`` / ``num_tokens`` columns of
    that call's buffers (rows: table row, prefix, new tokens; tokens: input id, position,
    slot), sliced when something asks for them."""

    __slots__ = ("_bufs",)

    def __init__(self, row_buf: np.ndarray, token_buf: np.ndarray, n: int, num_tokens: int):
        self._tensors, self._bufs = None, (row_buf, token_buf, n, num_tokens)

    @property
    def host_arrays(self) -> tuple[np.ndarray, ...]:  # type: ignore[override]
        rb, tb, n, m = self._bufs
        return rb[0, :n], rb[1, :n], rb[2, :n], tb[0, :m], tb[1, :m], tb[2, :m]


@numba.njit(cache=True)
def batch_nb(qsl, seq_lens, key_slots, keys, key_rows, tokens, lens):
    """A step's batch from ``qsl`` (query start locations [n + 1], from 0) and ``seq_lens``
    ([>= n]): per row its new tokens ``ql``, the tokens computed before them ``prefix`` and
    their sum; each token's position; the longest sequence (1 without rows); whether some
    row starts on a prefix with several new tokens (and there are rows to share it); each
    row's table row (``key_rows[i]`` where ``keys[i]``, sorted, is the key group's slot
    ``key_slots`` of its first new token; -1 where none is); the input ids from the token
    store (-1 where not known yet, and for unmatched rows); whether some row is unmatched."""
    n = qsl.shape[0] - 1
    num_tokens = max(qsl[n], 0)
    ql = np.empty(n, dtype=np.int64)
    prefix = np.empty(n, dtype=np.int64)
    rows = np.full(n, -1, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    max_seq = 0 if n else 1
    may_depend = unmatched = False
    at = 0
    for r in range(n):
        e = np.int64(qsl[r + 1] - qsl[r])
        k = np.int64(seq_lens[r]) - e
        ql[r], prefix[r] = e, k
        max_seq = max(max_seq, np.int64(seq_lens[r]))
        may_depend |= e > 1 and k > 0
        for i in range(e):
            positions[at + i] = k + i
        if e > 0 and at < key_slots.shape[0]:
            i = np.searchsorted(keys, np.int64(key_slots[at]))
            if i < keys.shape[0] and keys[i] == key_slots[at]:
                rows[r] = key_rows[i]
        unmatched |= rows[r] < 0
        at += e
    ids = input_ids_nb(tokens, lens, rows, prefix, ql, num_tokens)
    return ql, prefix, prefix + ql, positions, max_seq, may_depend and n > 1, rows, ids, unmatched


@numba.njit(cache=True)
def meta_nb(rows, cols, tokens, store, lens, out):
    """:meth:`.worker.VllmCanaryWorker.on_meta`'s step: each request's token ids into its
    row of the token store (``store``, lengths ``lens``: the known prefix grows); ``rows``:
    each request's row, ``cols``: :class:`.meta.StepMeta`'s ``cols`` (``NUM_COLS`` values a
    request: computed count, scheduled count, token start, token count, first slot; a
    row given as ``-1 - row`` is a request's new row: emptied first, ``rows`` set to it).
    Into ``out`` (int64 [5, >= requests and tokens], which the worker keeps: no array made
    per step): rows 0-1, the first slots that are allocated, sorted, and their requests'
    rows; rows 2-4, the *arrivals*: row, position and token id of each position the store
    held as not known yet (-1, sent so under async scheduling) that is known now and that
    this step reads (below the request's computed count), the positions whose records
    :func:`settle_nb` settles. Returns (the first slots, the arrivals, the columns the
    store needs); when the store is narrower than that, nothing is written (grow it, call
    again)."""
    n = rows.shape[0]
    end = 0
    for i in range(n):
        end = max(end, cols[i * NUM_COLS + COL_START] + cols[i * NUM_COLS + COL_COUNT])
    if end > store.shape[1]:
        return 0, 0, end
    at = m = 0
    for i in range(n):
        c = i * NUM_COLS
        row, k, start, count = rows[i], cols[c + COL_COMPUTED], cols[c + COL_START], cols[c + COL_COUNT]
        if row < 0:  # a new row: no token ids known
            row = rows[i] = -1 - row
            store[row, :] = -1
            lens[row] = 0
        have = lens[row]
        for j in range(count):
            p, t = start + j, tokens[at + j]
            if p < have and p < k and t != -1 and store[row, p] == -1:
                out[2, m], out[3, m], out[4, m] = row, p, t
                m += 1
            store[row, p] = t
        at += count
        if start + count > have:
            lens[row] = start + count
    num_keys = 0
    for i in range(n):
        if cols[i * NUM_COLS + COL_SLOT] >= 0:
            out[0, num_keys], out[1, num_keys] = cols[i * NUM_COLS + COL_SLOT], rows[i]
            num_keys += 1
    if num_keys > _SORT_IN_PLACE:  # (stable: the first of equal slots first)
        order = np.argsort(out[0, :num_keys], kind="mergesort")
        keys, key_rows = out[0, :num_keys][order], out[1, :num_keys][order]
        out[0, :num_keys], out[1, :num_keys] = keys, key_rows
    else:  # a decode step's few: insertion, stable, nothing allocated
        for i in range(1, num_keys):
            key, row = out[0, i], out[1, i]
            j = i
            while j > 0 and out[0, j - 1] > key:
                out[0, j], out[1, j] = out[0, j - 1], out[1, j - 1]
                j -= 1
            out[0, j], out[1, j] = key, row
    return num_keys, m, end


@numba.njit(cache=True)
def settle_nb(rec, table, arrivals, lens):
    """Settle the records ``rec`` (int64 view of a record buffer) of the positions whose
    token ids arrived (``arrivals``, :func:`meta_nb`'s, in position order per row), at
    their slots in ``table`` (a group's req->token table, as the request's last step left
    it). A record is settled only while it is still the one written for that position with
    the token not known: position p and token -1. Its token becomes the arrived one, and
    the chain hashes after it are made again from it, slot by slot, as long as each
    successor is the record chained from it (its position, and its stored chain hash the
    one the record before it made): any other record, and a record written with a token
    (the forward's input id), is left as it is, so a token that differs from the arrived
    one is reported by the next verify of that slot. Returns the records settled."""
    num = 0
    width = table.shape[1]
    for i in range(arrivals.shape[1]):
        row, p, t = arrivals[0, i], arrivals[1, i], arrivals[2, i]
        if p >= width:
            continue
        s = table[row, p]
        if s <= 0 or rec[s, 1] != p or rec[s, 0] != -1:
            continue
        old = np.int64(chain_hash_nb(rec[s, 2], np.int64(-1), p))
        new = np.int64(chain_hash_nb(rec[s, 2], t, p))
        rec[s, 0] = t
        num += 1
        q = p + 1
        while q < min(lens[row], width):
            s2 = table[row, q]
            if s2 <= 0 or rec[s2, 1] != q or rec[s2, 2] != old:
                break
            token = rec[s2, 0]
            rec[s2, 2] = new
            old = np.int64(chain_hash_nb(old, token, q))
            new = np.int64(chain_hash_nb(new, token, q))
            q += 1
    return num


def settle_t(rec: torch.Tensor, table: torch.Tensor, arrivals: torch.Tensor,
             lens: torch.Tensor) -> int:  # fmt: skip
    """:func:`settle_nb` in torch ops (a device's records and table; ``arrivals`` and
    ``lens`` on that device): the arrivals of every row at once, the k-th of each row in
    round k (a row's later arrival chains from its earlier one), each round walking the
    successors of all its arrivals together, one slot a pass."""
    if arrivals.shape[1] == 0:
        return 0
    dev = rec.device
    row, p, t = arrivals[0], arrivals[1], arrivals[2]
    # k-th arrival of its row (arrivals come in row runs, positions ascending)
    idx = torch.arange(row.shape[0], device=dev)
    starts = torch.ones_like(row, dtype=torch.bool)
    starts[1:] = row[1:] != row[:-1]
    run_start = torch.cummax(torch.where(starts, idx, 0), 0).values
    rank = idx - run_start
    width = table.shape[1]
    num = 0
    minus1 = torch.full_like(t, -1)
    for k in range(int(rank.max()) + 1):
        sel = (rank == k) & (p < width)
        r_k, p_k, t_k = row[sel], p[sel], t[sel]
        s = table[r_k, p_k]
        ok = (s > 0) & (rec[s, 1] == p_k) & (rec[s, 0] == -1)
        r_k, p_k, t_k, s = r_k[ok], p_k[ok], t_k[ok], s[ok]
        if s.numel() == 0:
            continue
        prev = rec[s, 2]
        old = chain_hash_t(prev, minus1[: s.numel()], p_k)
        new = chain_hash_t(prev, t_k, p_k)
        rec[s, 0] = t_k
        num += int(s.numel())
        q, end = p_k + 1, torch.clamp(lens[r_k], max=width)
        while True:
            live = q < end
            s2 = table[r_k, torch.clamp(q, max=width - 1)]
            live &= (s2 > 0) & (rec[s2, 1] == q) & (rec[s2, 2] == old)
            if not bool(live.any()):
                break
            r_k, q, end, old, new, s2 = (x[live] for x in (r_k, q, end, old, new, s2))
            token = rec[s2, 0]
            rec[s2, 2] = new
            old, new = chain_hash_t(old, token, q), chain_hash_t(new, token, q)
            q = q + 1
    return num


@numba.njit(cache=True)
def input_ids_nb(tokens, lens, rows, prefix, ql, num_tokens):
    """This step's input ids from the token store (-1 where not known yet, and for rows
    without a table row, -1)."""
    ids = np.full(num_tokens, -1, dtype=np.int64)
    at = 0
    for r in range(rows.shape[0]):
        k, row = prefix[r], rows[r]
        if row >= 0:
            for i in range(max(min(lens[row], k + ql[r]) - k, 0)):
                ids[at + i] = tokens[row, k + i]
        at += ql[r]
    return ids


@numba.njit(cache=True)
def group_rows_nb(bt, slot_mapping, seq, prefix, bs, window, table, rows, num_tokens, seen):
    """:meth:`.worker.VllmCanaryWorker._group_rows` on the CPU (batch row r -> table row
    ``rows[r]``; only positions < seq[r] are read by the planner).

    A full group's row keeps what earlier steps wrote: ``seen[row, i]`` is the block id
    whose slots row ``row`` holds at block index ``i`` (-1: none yet), so each step
    compares every block-table entry the sequence covers with it and rewrites only the
    blocks that changed (a decode step: none, or the one new block). The entries are pure
    functions of (block id, index), so the row equals a full rebuild's, whichever request
    held the row before (nothing else writes a full group's host rows; the tables and
    ``seen`` are replaced together when they grow). A sliding group's row is rewritten from
    ``K - W + 1`` on and kept 0 below it (``seen[row, 0]``: the position from which it may
    not be 0; cleared up to the new start), so a step costs the window and the new tokens,
    not the whole context, and the row below ``seq`` equals a full rebuild's."""
    nb = bt.shape[1]
    width = table.shape[1]
    for r in range(seq.shape[0]):
        row = rows[r]
        if window > 0:
            lo = min(max(0, prefix[r] - window + 1), seq[r])
            for p in range(max(seen[row, 0], 0), lo):
                table[row, p] = 0
            seen[row, 0] = lo
            for p in range(lo, seq[r]):
                bi = p // bs
                b = bt[r, bi] if bi < nb else 0
                table[row, p] = b * bs + p % bs if b != 0 else 0
            continue
        for bi in range((seq[r] + bs - 1) // bs):
            b = np.int64(bt[r, bi]) if bi < nb else 0
            if seen[row, bi] == b:
                continue
            seen[row, bi] = b
            base = b * bs
            for p in range(bi * bs, min((bi + 1) * bs, width)):
                table[row, p] = base + p - bi * bs if b != 0 else 0
    out = np.empty(min(num_tokens, slot_mapping.shape[0]), dtype=np.int64)
    for t in range(out.shape[0]):
        s = slot_mapping[t]
        out[t] = s if s >= bs else -1
    return out


_ANCHOR = np.int64(ANCHOR_HASH_I64)


@numba.njit(cache=True)
def chain_seed_nb(tokens):
    """The chain hash (record field ``prev_hash``) of every position of a request with
    token ids ``tokens`` (position p at index p): the anchor at 0, then
    ``chain_hash(prev[p - 1], tokens[p - 1], p - 1)``, as the write kernel chains them."""
    prev = np.empty(tokens.shape[0], dtype=np.int64)
    running = _ANCHOR
    for p in range(tokens.shape[0]):
        prev[p] = running
        running = np.int64(chain_hash_nb(running, np.int64(tokens[p]), np.int64(p)))
    return prev



# head_step_nb's codes besides the fused HEAD's (0: done, 1: a verify overflowed, >= 2: see
# fused_rows): the step needs the full path (nothing was written), or larger buffers; the
# step's metadata (meta_nb's part, run first) needs a wider token store (nothing written),
# or has arrivals to settle (its part done, nothing else).
FAST_FULL_PATH, FAST_GROW, FAST_GROW_STORE, FAST_SETTLE = -1, -2, -3, -4


# The scheduler's token id at positions whose forward input id the records do not take:
# vLLM's id of a prompt-embedding position (``Request._all_token_ids`` holds 0 there, while
# the model runner's input-id buffer holds a sentinel or a stale id: not a token's id).
FORWARD_ID_SKIP = 0

# A step's attention metadata as the one-call HEADs take it: int32 query_start_loc and
# seq_lens, then per group int64 slot_mapping and int32 block_table, all C-contiguous on the
# CPU (vLLM's CPU attention backend), by address and length (:func:`metadata_args`; right
# after vLLM's forward a single-group step's four numpy views took 6.9 us, this 5.2 us).
MD_QSL, MD_NUM_QSL, MD_SEQ, MD_NUM_SEQ = range(4)
MD_SLOTS, MD_NUM_SLOTS, MD_BT, MD_BT_ROWS, MD_BT_COLS = range(5)  # (a group's, from 0)
MD_GROUPS, MD_GROUP_WIDTH = 4, 5  # group g's values start at MD_GROUPS + g * MD_GROUP_WIDTH
_INT32, _INT64 = torch.int32, torch.int64


def metadata_args(metadata: Sequence[Any]) -> tuple[int, ...] | None:
    """The one-call HEADs' view of a step's attention metadata (``metadata[g]``: group g's;
    the batch from group 0's): query_start_loc and seq_lens (``MD_*``: address, length),
    then per group ``MD_SLOTS..MD_BT_COLS``; None when a tensor is not of the dtype and
    layout they read (the worker's full path then reads it)."""
    md = metadata[0]
    qsl, seq = md.query_start_loc, md.seq_lens
    if not (qsl.dtype is _INT32 and seq.dtype is _INT32 and qsl.is_contiguous()
            and seq.is_contiguous()):  # fmt: skip
        return None
    out = [qsl.data_ptr(), qsl.shape[0], seq.data_ptr(), seq.shape[0]]
    for md in metadata:
        slots, bt = md.slot_mapping, md.block_table
        if not (slots.dtype is _INT64 and bt.dtype is _INT32 and slots.is_contiguous()
                and bt.is_contiguous() and bt.dim() == 2):  # fmt: skip
            return None
        rows, cols = bt.shape
        out += (slots.data_ptr(), slots.shape[0], bt.data_ptr(), rows, cols)
    return tuple(out)


@numba.njit(cache=True, inline="always")
def _md_batch(md):
    """query_start_loc and seq_lens of :func:`metadata_args`' ``md``."""
    return (numba.carray(i32_ptr(md[MD_QSL]), (md[MD_NUM_QSL],)),
            numba.carray(i32_ptr(md[MD_SEQ]), (md[MD_NUM_SEQ],)))  # fmt: skip


@numba.njit(cache=True, inline="always")
def _md_group(md, g):
    """Group g's slot_mapping and block_table of :func:`metadata_args`' ``md``."""
    k = MD_GROUPS + MD_GROUP_WIDTH * g
    return (numba.carray(i64_ptr(md[k + MD_SLOTS]), (md[k + MD_NUM_SLOTS],)),
            numba.carray(i32_ptr(md[k + MD_BT]), (md[k + MD_BT_ROWS], md[k + MD_BT_COLS])))  # fmt: skip


# (a call of its own, not inlined: inlined, head_groups_nb measured 6-12 us slower a step)
@numba.njit(cache=True)
def _step_keys(meta, meta_out, num_keys, store, lens):
    """The step's first slots and their rows (``meta_out``'s rows 0-1, ``num_keys`` of
    them), :func:`meta_nb`'s part run first when it is pending (``num_keys`` < 0: the
    step's ``(rows, cols, tokens)`` in ``meta``). ``(code, value, num_keys)``: code 0;
    FAST_GROW_STORE (value: the columns the store needs; nothing written); FAST_SETTLE
    (value: the arrivals in ``meta_out``; the part done)."""
    if num_keys >= 0:
        return 0, 0, num_keys
    num_keys, num_arrived, end = meta_nb(meta[0], meta[1], meta[2], store, lens, meta_out)
    if end > store.shape[1]:
        return FAST_GROW_STORE, end, -1
    if num_arrived:
        return FAST_SETTLE, num_arrived, num_keys
    return 0, 0, num_keys


@numba.njit(cache=True)
def head_step_nb(md, meta, meta_out, num_keys, tokens, lens, fwd_ids, has_fwd, bs, window, r2t,
                 seen, row_buf, token_buf, batch, check_token, position_assert, blk):  # fmt: skip
    """One CPU step of a single-group canary in one compiled call, from the scheduler's
    metadata on (bind and HEAD in one call): :func:`_step_keys` (the step's token ids into
    the store, its first slots), the step's batch (:func:`batch_nb` on the attention
    metadata ``md``, :func:`metadata_args`' tuple; with ``has_fwd``, the records carry the
    forward's input ids ``fwd_ids``), :func:`group_rows_nb`, the batch block (``batch``, int64
    [18], pointing into ``row_buf`` [4, >= rows] and ``token_buf`` [3, >= tokens], which keep
    the batch for TAIL) and the fused HEAD (plans, writes, then the verify; ``blk`` the fused
    launches' argument block). Returns ``(code, rows, tokens, num_keys)``: :func:`_step_keys`'
    codes (``rows`` its value); FAST_FULL_PATH when the step needs the worker's full path (a
    row that depends on another, a row no request matched, tables too small; nothing
    written but the metadata's part), FAST_GROW when the buffers are too small, else the
    fused HEAD's code."""
    code, value, num_keys = _step_keys(meta, meta_out, num_keys, tokens, lens)
    if code < 0:
        return code, value, 0, num_keys
    qsl, seq_lens = _md_batch(md)
    slot_mapping, bt = _md_group(md, 0)
    code, n, num_tokens, prefix, seq, rows, ids, positions = _step_batch(
        qsl, seq_lens, slot_mapping, meta_out[0, :num_keys], meta_out[1, :num_keys], tokens,
        lens, fwd_ids, has_fwd, r2t.shape[1], row_buf, token_buf.shape[1])  # fmt: skip
    if code < 0:
        return code, n, num_tokens, num_keys
    code = _group_plan(bt, slot_mapping, bs, window, r2t, seen, prefix, seq, rows, ids,
                       positions, n, num_tokens, row_buf, token_buf, batch, tokens,
                       check_token, blk)  # fmt: skip
    if code >= _PLAN_FAILED:
        return code, n, num_tokens, num_keys
    _group_write(batch, position_assert, blk)
    status = _verify_body(n, check_token, check_token, blk)
    return (code if status == _DONE else status), n, num_tokens, num_keys


@numba.njit(cache=True)
def head_groups_nb(md, key_group, meta, meta_out, num_keys, tokens, lens, fwd_ids, has_fwd,
                   shapes, r2ts, seens, row_buf, token_bufs, batches, check_token,
                   position_assert, blks, codes):  # fmt: skip
    """:func:`head_step_nb` for a CPU step with several groups (hybrid models), in one
    compiled call: the metadata's part, the batch once (its rows matched on the key
    group's slots), then per group g its req->token rows, batch block and plans (its
    slot_mapping and block_table in ``md``, ``shapes[g]`` = (block size, window or 0),
    ``r2ts[g]``, ``seens[g]``, ``token_bufs[g]``, ``batches[g]``, ``blks[g]``), then every
    group's writes, then every group's verifies (the groups share record buffers: every
    verify after every write is the alias check), as the worker's full path orders them.
    Returns ``(code, rows, tokens, num_keys)``: :func:`_step_keys`' codes, FAST_FULL_PATH,
    FAST_GROW, or a group's failed plan (``>= _PLAN_FAILED``) before anything but the
    metadata's part was written; a verify's slot error; else ``_DONE`` with each group's
    fused HEAD code (done, or a verify overflowed) in ``codes[g]``."""
    code, value, num_keys = _step_keys(meta, meta_out, num_keys, tokens, lens)
    if code < 0:
        return code, value, 0, num_keys
    qsl, seq_lens = _md_batch(md)
    key_slot_mapping = _md_group(md, key_group)[0]
    code, n, num_tokens, prefix, seq, rows, ids, positions = _step_batch(
        qsl, seq_lens, key_slot_mapping, meta_out[0, :num_keys], meta_out[1, :num_keys],
        tokens, lens, fwd_ids, has_fwd, r2ts[0].shape[1], row_buf, token_bufs[0].shape[1])  # fmt: skip
    if code < 0:
        return code, n, num_tokens, num_keys
    num_groups = len(blks)
    for g in range(num_groups):
        slot_mapping, bt = _md_group(md, g)
        code = _group_plan(bt, slot_mapping, shapes[g, 0], shapes[g, 1], r2ts[g], seens[g],
                           prefix, seq, rows, ids, positions, n, num_tokens, row_buf,
                           token_bufs[g], batches[g], tokens, check_token, blks[g])  # fmt: skip
        if code >= _PLAN_FAILED:
            return code, n, num_tokens, num_keys
        codes[g] = code
    for g in range(num_groups):
        _group_write(batches[g], position_assert, blks[g])
    for g in range(num_groups):
        status = _verify_body(n, check_token, check_token, blks[g])
        if status != _DONE:
            return status, n, num_tokens, num_keys
    return _DONE, n, num_tokens, num_keys


@numba.njit(cache=True, inline="always")
def _step_batch(qsl, seq_lens, key_slot_mapping, keys, key_rows, tokens, lens, fwd_ids,
                has_fwd, table_width, row_buf, token_width):  # fmt: skip
    """The one-call HEADs' batch (:func:`batch_nb`; the forward's ids when ``has_fwd``),
    its rows written into ``row_buf`` (table row, prefix, new tokens, store length).
    Returns ``(code, n, num_tokens, prefix, seq, rows, ids, positions)``: code
    FAST_GROW (buffers too small), FAST_FULL_PATH, or 0."""
    n = qsl.shape[0] - 1
    num_tokens = max(qsl[n], 0)
    ql, prefix, seq, positions, max_seq, may_depend, rows, ids, unmatched = batch_nb(
        qsl, seq_lens, key_slot_mapping, keys, key_rows, tokens, lens)
    if n > row_buf.shape[1] or num_tokens > token_width:
        return FAST_GROW, n, num_tokens, prefix, seq, rows, ids, positions
    if may_depend or unmatched or max_seq > table_width:
        return FAST_FULL_PATH, n, num_tokens, prefix, seq, rows, ids, positions
    if has_fwd:  # the records carry the forward's ids (the store keeps the scheduler's),
        for t in range(num_tokens):  # but where the scheduler's id is 0 (FORWARD_ID_SKIP)
            if ids[t] != FORWARD_ID_SKIP:
                ids[t] = fwd_ids[t]
    for r in range(n):
        row_buf[0, r], row_buf[1, r], row_buf[2, r] = rows[r], prefix[r], ql[r]
        row_buf[3, r] = lens[rows[r]]
    return 0, n, num_tokens, prefix, seq, rows, ids, positions


@numba.njit(cache=True, inline="always")
def _group_plan(bt, slot_mapping, bs, window, r2t, seen, prefix, seq, rows, ids, positions, n,
                num_tokens, row_buf, token_buf, batch, tokens, check_token, blk):  # fmt: skip
    """One group's part of a one-call HEAD up to its plans, nothing written into records
    or the ring: its req->token rows (:func:`group_rows_nb`), its tokens into ``token_buf``
    (input id, position, slot), its batch block, then the fused HEAD's plans (its code)."""
    out = group_rows_nb(bt, slot_mapping, seq, prefix, bs, window, r2t, rows, num_tokens, seen)
    m = out.shape[0]
    for t in range(num_tokens):
        token_buf[0, t], token_buf[1, t] = ids[t], positions[t]
    for t in range(m):
        token_buf[2, t] = out[t]
    b_rows, b_prefix, b_ql, b_lens = row_buf[0, :n], row_buf[1, :n], row_buf[2, :n], row_buf[3, :n]
    b_ids, b_pos, b_out = token_buf[0, :num_tokens], token_buf[1, :num_tokens], token_buf[2, :m]
    batch[:] = _batch_block_nb(b_rows, b_prefix, b_ql, b_out, b_ids, b_pos, tokens, b_lens,
                               check_token)  # fmt: skip
    return _plan_phase(r2t, b_rows, b_prefix, b_ql, b_out, num_tokens, num_tokens, num_tokens,
                       num_tokens, tokens, b_lens, check_token, blk)  # fmt: skip


@numba.njit(cache=True, inline="always")
def _group_write(batch, position_assert, blk):
    """The writes of a group whose plans :func:`_group_plan` made (its batch block)."""
    ids, positions = _a1(batch, 8), _a1(batch, 10)
    _write_phase(batch[1], ids, positions, ids, positions, False, position_assert, blk)


@numba.njit(cache=True)
def tail_groups_nb(batches, check_token, position_assert, blks):
    """TAIL of a step :func:`head_groups_nb` opened, in one compiled call: each group's
    fused TAIL (verify, write; no store check: a host-run HEAD has none) on its batch block
    ``batches[g]`` and argument block ``blks[g]``, in group order. 0, or a slot error."""
    for g in range(len(blks)):
        status = _tail_batch_nb(batches[g], check_token, position_assert, 0, blks[g])
        if status != _DONE:
            return status
    return _DONE
