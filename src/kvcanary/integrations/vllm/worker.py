"""The worker side of the vLLM host: vLLM's KV cache groups as canary pools, and each step's
attention metadata as the canary's forward batches. Nothing here imports vLLM (the
connector, :mod:`.connector`, hands plain tensors and duck-typed metadata in), so it is
tested without vLLM too.

What crosses (host contract: :mod:`kvcanary.canary.host`)::

    vLLM (worker)                                    canary
    KV cache group g (layers, block size, window) -> VllmGroupPool (attacher: .pool): one
                                                     canary group, FULL or SWA (window W)
    slot = block_id * block_size + offset            the group's slot index space; block 0
                                                     (vLLM's null block) -> slot 0 (none)
    attn_metadata[first layer of g]                  ForwardBatchView of group g:
      block_table, seq_lens, query_start_loc,          req->token rows kept up to date
      slot_mapping                                      from the block table attention reads
    connector metadata (scheduler side)              token ids (input ids, token mirror) and
                                                     the request of each batch row
      seals, invalid slots                           KV another connector loaded: records
                                                     written for it (sealed), or cleared

The pools: :mod:`.pool`; the step tables and their compiled passes: :mod:`.steps`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from itertools import repeat
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import torch

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.errors import KVCanaryViolation
from kvcanary.canary.install import install_canary
from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.kernels.fused_rows import FusedRowLaunches
from kvcanary.canary.kernels.numba_kernels import entry_point
from kvcanary.canary.manager import AbortHandler, CanaryManager
from kvcanary.canary.plan.types import WritePlan
from kvcanary.canary.wire.constants import LaunchStage, launch_tag
from kvcanary.integrations.vllm.meta import (
    COL_COMPUTED,
    COL_COUNT,
    COL_SCHEDULED,
    COL_SLOT,
    COL_START,
    NUM_COLS,
    GroupSpec,
    StepMeta,
)
from kvcanary.integrations.vllm.pool import SharedRecords, VllmGroupPool
from kvcanary.integrations.vllm.steps import (
    FAST_FULL_PATH,
    FAST_GROW,
    FAST_GROW_STORE,
    FORWARD_ID_SKIP,
    BufferStepBatch,
    GroupHost,
    GroupTableView,
    StepBatch,
    StepTables,
    batch_nb,
    chain_seed_nb,
    group_rows_nb,
    head_groups_nb,
    head_step_nb,
    input_ids_nb,
    meta_nb,
    metadata_args,
    settle_nb,
    settle_t,
    tail_groups_nb,
)
from kvcanary.jit.parallel import parallel_lock

logger = logging.getLogger("kvcanary.canary")
_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_META = (_NO_IDS, _NO_IDS, _NO_IDS)  # the one-call HEADs' metadata once its part ran


class VllmCanaryWorker:
    """Every group's canary on one vLLM worker; the connector's worker side drives it::

        on_meta(meta)                 bind_connector_metadata: rows for the step's
                                      requests, finished requests, the records of invalid
                                      slots cleared (the token ids into the store: in
                                      HEAD's compiled call)
        before_forward(metadata)      bind_connector_metadata too (before the forward;
                                      else the first layer's wait_for_layer_load): the
                                      seals' HEAD records, then HEAD (all groups)
        after_forward()               wait_for_save: the seals' TAIL records, TAIL, reports,
                                      abort-mode blocks
        take_invalid_blocks()         get_block_ids_with_load_errors (abort mode)

    Seals (KV another connector loaded, :mod:`.connector`): the loaded positions' records
    are written as a forward would write them (the same write kernel: token, position,
    chain, and in TAIL the fingerprint of the loaded bytes), each group from its first slot
    on (a sliding group holds no block below its window), chained from the request's own
    token ids (no predecessor record is trusted: the chain hash is a function of them).
    """

    def __init__(self, config: CanaryConfig, specs: Sequence[GroupSpec],
                 layers: dict[str, torch.Tensor]):  # fmt: skip
        if not specs:
            raise ValueError("kv-canary (vLLM): the model has no KV cache group")
        self.config = config
        self.specs = list(specs)
        first = layers[self.specs[0].layer_names[0]]
        self.device = first.device
        self.num_blocks = int(first.shape[1] if first.dim() == 5 else first.shape[0])
        self.tables = StepTables(len(self.specs), self.device)
        records: dict[int, SharedRecords] = {}
        self.managers: list[CanaryManager] = []
        self.pools: list[VllmGroupPool] = []
        for spec in self.specs:
            if spec.block_size not in records:
                records[spec.block_size] = SharedRecords.allocate(
                    self.num_blocks * spec.block_size, self.device, config.v_half)
            pool = VllmGroupPool(spec, [layers[n] for n in spec.layer_names],
                                 records[spec.block_size])  # fmt: skip
            host = GroupHost(pool, GroupTableView(self.tables, spec.index), self.device,
                             spec.sliding_window)  # fmt: skip
            self.pools.append(pool)
            manager = install_canary(host, config)
            assert manager is not None  # parse_options refuses mode none
            if config.mode == "abort":
                manager.set_abort_handler(self._abort_handler(spec))
            manager.mark_init_finished()  # vLLM's warm-up runs carry no connector metadata
            self.managers.append(manager)
        self.records = records
        # The group whose slots identify a batch row's request: a full one if any.
        self._key_group = next((s.index for s in self.specs if s.sliding_window is None), 0)
        # Each live request's row of the tables (StepTables), rows free for reuse, rows lent
        # to this step's batch rows that match no request (given back after TAIL).
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._num_rows = 1  # row 0: padding
        self._lent: list[int] = []
        self._step = StepMeta()
        # This step's metadata as on_meta converted it, (rows, cols, tokens), until its
        # compiled part ran (meta_nb: the token ids into the store; in the one-call HEADs,
        # first); then this step's requests by the key group's slot of their first new
        # token, for matching batch rows in one compiled pass: _meta_out[0:2, :_num_keys]
        # (slots sorted, their rows).
        self._pending_meta: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._num_keys = 0
        self._open: list[list[StepBatch]] | None = None
        self.num_dependent_passes = 0
        self._invalid_blocks: set[int] = set()
        self._unmatched_warned = False
        self.num_steps = 0
        # This step's seals, per group: (write plan, seed record or None); made at HEAD,
        # written again (TAIL records) at TAIL.
        self._seals: list[list[tuple[WritePlan, tuple[int, int, int] | None]]] | None = None
        self._seal_pending = False  # this step's metadata has seals not written yet
        self.num_sealed = 0  # positions sealed (per group written, summed)
        self.num_cleared = 0  # slots whose records were cleared
        # Async scheduling (docs/VLLM.md, "Tokens"): positions planned before their token
        # was known whose token arrived since, and the records settled with it.
        self.num_arrived = 0
        self.num_settled = 0
        # The buffer the model runner's forward takes its input ids from (int, [>= tokens
        # of a step], on the device), when the connector found it: the records carry the
        # ids the forward took, the store the scheduler's (.connector).
        self._forward_input_ids: torch.Tensor | None = None
        self._fwd_np = _NO_IDS  # its numpy view on the CPU (the one-call HEADs read it)
        # The one-call HEAD of a CPU worker (_fast_head; several groups: _fast_heads): the
        # batch it keeps for TAIL (rows: table row, prefix, new tokens, token-store length;
        # per group tokens: input id, position, slot) and each group's batch block; steps
        # it ran.
        self._fast_ok = self.device.type == "cpu"
        self._row_buf = np.zeros((4, 64), dtype=np.int64)
        self._token_bufs = [np.zeros((3, 256), dtype=np.int64) for _ in self.specs]
        self._batch_blocks = [np.zeros(18, dtype=np.int64) for _ in self.specs]
        self._token_buf, self._batch_block = self._token_bufs[0], self._batch_blocks[0]
        self._group_shapes = np.array([(s.block_size, s.sliding_window or 0) for s in self.specs],
                                      dtype=np.int64)  # fmt: skip
        self._group_codes = np.zeros(len(self.specs), dtype=np.int64)
        # A step _fast_heads opened: its calls' batch blocks and argument blocks, for TAIL
        self._open_groups: tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] | None = None
        self.num_fast_steps = 0
        # head_step_nb's or head_groups_nb's compiled entry (numba_kernels.entry_point: no
        # typing of its arguments a step), made by the first one-call HEAD: every argument
        # is an int64 array the worker owns (replaced by one of the same type when it
        # grows), a tuple of them, a Python scalar or the attention metadata's tuple of
        # ints, but the forward's input ids, whose setter drops it.
        self._step_entry: Any = None
        self._tail_entry: Any = None  # tail_groups_nb's (a hybrid step's TAIL)
        self._fast_rt = self.managers[0].runtime
        self._fast_args = (self.specs[0].block_size, self.specs[0].sliding_window or 0,
                           self._fast_rt.config.verify_tokens)  # fmt: skip
        # meta_nb's output (keys, their rows, arrivals; grown on demand) and compiled
        # function (its argument types are fixed: int64 arrays made here), for the steps
        # the one-call HEADs do not take
        self._meta_out = np.zeros((5, 64), dtype=np.int64)
        self._meta_entry = entry_point(meta_nb, _NO_IDS, _NO_IDS, _NO_IDS, self.tables.tokens,
                                       self.tables.lens, self._meta_out)  # fmt: skip

    @property
    def forward_input_ids(self) -> torch.Tensor | None:
        return self._forward_input_ids

    @forward_input_ids.setter
    def forward_input_ids(self, ids: torch.Tensor | None) -> None:
        self._forward_input_ids = ids
        self._fwd_np = ids.numpy() if ids is not None and ids.is_cpu else _NO_IDS
        self._step_entry = None  # (its type may differ)

    # -------------------------------------------------------------- scheduler input
    def on_meta(self, meta: StepMeta) -> None:
        """The scheduler's metadata of the step about to run: rows for its requests, its
        numbers as arrays; their compiled part (:func:`.steps.meta_nb`) runs in the one-call
        HEAD, or :meth:`_take_meta` (the full path, or a step that ran no forward)."""
        if self._pending_meta is not None:  # a step without a forward
            self._take_meta()
        if meta.final_req_ids:  # their rows still hold them
            self._settle_final(meta)
        if meta.finished:  # (map, filter: no Python loop; rows are >= 1)
            self._free_rows.extend(filter(None, map(self._rows.pop, meta.finished,
                                                    repeat(None))))  # fmt: skip
        self._step = meta
        if meta.invalid_slots:
            self._clear(meta.invalid_slots)
        self._seal_pending = bool(meta.seal_req_ids)
        rows_list = list(map(self._rows.get, meta.req_ids))  # (no comprehension's frame)
        if None in rows_list:  # requests seen for the first time
            self._new_rows(meta.req_ids, rows_list)
        rows = np.array(rows_list, dtype=np.int64)
        cols = np.array(meta.cols, dtype=np.int64)
        if meta.packed is not None:  # (StepMeta.pack: native int64, no conversion)
            tokens = np.frombuffer(meta.packed, dtype=np.int64)
        else:
            tokens = np.array(meta.tokens, dtype=np.int64)
        num = tokens.shape[0]
        if max(rows.shape[0], num) > self._meta_out.shape[1]:
            self._meta_out = np.zeros((5, 2 * max(rows.shape[0], num)), dtype=np.int64)
        self._pending_meta = (rows, cols, tokens)

    def _take_meta(self) -> None:
        """The pending metadata's compiled part (:func:`.steps.meta_nb`), then the
        settling of its arrivals."""
        assert self._pending_meta is not None
        (rows, cols, tokens), tables, out = self._pending_meta, self.tables, self._meta_out
        while True:
            num_keys, num_arrived, end = self._meta_entry(rows, cols, tokens, tables.tokens,
                                                          tables.lens, out)  # fmt: skip
            if end <= tables.tokens.shape[1]:
                break
            tables.ensure(self._num_rows, end)
        self._pending_meta, self._num_keys = None, num_keys
        if num_arrived:
            self._settle(out, num_arrived)

    def _retry_keys(self, code: int, value: int, num_keys: int) -> tuple[Any, ...] | None:
        """After a one-call HEAD returned :func:`.steps._step_keys`' ``code`` (its
        ``value``): the token store grown (the part not run), or the part taken and its
        arrivals settled. The metadata to call again with (None: taken)."""
        if code == FAST_GROW_STORE:
            self.tables.ensure(self._num_rows, value)
            return self._pending_meta
        self._pending_meta, self._num_keys = None, num_keys
        self._settle(self._meta_out, value)
        return None

    def _settle_final(self, meta: StepMeta) -> None:
        """Async scheduling: finished requests' token ids of positions they computed with
        the token not known yet, into their rows and settled (as arrivals in a running
        request's metadata are), so a later prefix hit on those slots reads the request's
        own tokens."""
        known = [(i, self._rows[rid]) for i, rid in enumerate(meta.final_req_ids)
                 if rid in self._rows]  # fmt: skip
        if not known:
            return
        counts = np.subtract(meta.final_computed, meta.final_starts)
        at = np.concatenate(([0], np.cumsum(counts)))
        idx = [i for i, _ in known]
        tokens = np.concatenate([meta.final_tokens[at[i]:at[i + 1]] for i in idx]).astype(np.int64)
        rows = np.array([row for _, row in known], dtype=np.int64)
        cols = np.zeros((len(idx), NUM_COLS), dtype=np.int64)
        cols[:, COL_COMPUTED] = np.array(meta.final_computed)[idx]
        cols[:, COL_START], cols[:, COL_COUNT], cols[:, COL_SLOT] = (
            np.array(meta.final_starts)[idx], counts[idx], -1)  # fmt: skip
        # (the rows' tokens were stored before: the store is wide enough)
        out = np.zeros((5, max(len(rows), len(tokens))), dtype=np.int64)
        _, num_arrived, _ = meta_nb(rows, cols.reshape(-1), tokens, self.tables.tokens,
                                    self.tables.lens, out)  # fmt: skip
        if num_arrived:
            self._settle(out, num_arrived)

    def _settle(self, out: np.ndarray, num_arrived: int) -> None:
        """Async scheduling: the records of positions whose token arrived in this step's
        metadata (:func:`.steps.meta_nb`'s ``out``: its first ``num_arrived`` arrivals),
        settled (:func:`.steps.settle_nb`) in every group's HEAD and TAIL buffers, before
        anything reads them; their mirror entries already hold it."""
        arrivals = np.ascontiguousarray(out[2:, :num_arrived])
        self.num_arrived += arrivals.shape[1]
        tables = self.tables
        if self.device.type != "cpu":
            dev_arrivals = torch.from_numpy(arrivals).to(self.device)
            tables.publish(np.unique(arrivals[0]))
        for spec in self.specs:
            records = self.records[spec.block_size]
            for buf in (records.k_head, records.k_tail, records.v_head, records.v_tail):
                if buf is None:
                    continue
                if self.device.type == "cpu":
                    num = settle_nb(buf.view(torch.int64).numpy(), tables.r2t_host[spec.index],
                                    arrivals, tables.lens)  # fmt: skip
                else:
                    num = settle_t(buf.view(torch.int64), tables.r2t[spec.index], dev_arrivals,
                                   tables.token_lens)  # fmt: skip
                if buf is records.k_head:
                    self.num_settled += num

    def _new_rows(self, req_ids: list[str], rows: list[int | None]) -> None:
        """A row for each request of ``req_ids`` whose entry in ``rows`` is None, put there
        as ``-1 - row``: :func:`.steps.meta_nb` empties such a row (no token ids known)
        before it stores the step's token ids (one compiled pass; emptied here, a prefill
        of 16 new requests cost ~1.2 us a row)."""
        taken = self._rows
        for i, row in enumerate(rows):
            if row is None:
                row = taken[req_ids[i]] = self._free_row()
                rows[i] = -1 - row
        self.tables.ensure(self._num_rows, 1)

    def _row(self, rid: str) -> int:
        """Request ``rid``'s row of the tables (a fresh one the first time)."""
        row = self._rows.get(rid)
        if row is None:
            row = self._rows[rid] = self._take_row()
        return row

    def _take_row(self) -> int:
        """A row no live request holds, emptied (no token ids known)."""
        row = self._free_row()
        self.tables.ensure(row + 1, 1)
        self.tables.tokens[row] = -1
        self.tables.lens[row] = 0
        return row

    def _free_row(self) -> int:
        """A row no live request holds (a freed one, else the next new one), as it is."""
        if self._free_rows:
            return self._free_rows.pop()
        row, self._num_rows = self._num_rows, self._num_rows + 1
        return row

    # -------------------------------------------------------------- the forward
    def before_forward(self, metadata: Sequence[Any]) -> None:
        """HEAD of every group; ``metadata[g]``: group g's attention metadata (block_table,
        seq_lens, query_start_loc, slot_mapping).

        vLLM may serve a prefix hit on blocks that another row of the same step is filling
        (both rows' K/V are stored before attention reads): such a *dependent* row is
        checked in a second canary pass, once the rows it reads from wrote their records
        (at ``wait_for_save``; level ``L`` rows after level ``L - 1``)."""
        self._open = self._open_groups = None  # a forward that raised before wait_for_save
        if self._fast_ok and not self._lent and not self._seal_pending and (
                self._fast_head(metadata) if len(self.specs) == 1
                else self._fast_heads(metadata)):  # fmt: skip
            return
        if self._pending_meta is not None:
            self._take_meta()
        if self._lent:
            self._give_back_lent()
        self._seals = None
        if self._seal_pending:  # KV loaded by another connector: its records first
            self._seal_pending = False
            self._seals = self._seal_plans()
            self._write_seals(LaunchStage.HEAD)
        md0, g = metadata[0], self._key_group
        tables = self.tables
        ql, prefix, seq, positions, max_seq, may_depend, rows, input_ids, unmatched = batch_nb(
            _host(md0.query_start_loc), _host(md0.seq_lens), _host(metadata[g].slot_mapping),
            self._meta_out[0, : self._num_keys], self._meta_out[1, : self._num_keys],
            tables.tokens, tables.lens,
        )  # fmt: skip
        n, num_tokens, dev = ql.shape[0], positions.shape[0], self.device
        if unmatched:  # rows no first slot matched (rare): the slow path
            input_ids = self._unmatched_rows(rows, prefix, ql, num_tokens, input_ids)
        fwd = self.forward_input_ids if num_tokens else None
        if fwd is not None and dev.type == "cpu":  # the records carry the forward's ids
            input_ids = np.where(input_ids != FORWARD_ID_SKIP, fwd[:num_tokens].numpy(),
                                 input_ids).astype(np.int64)  # fmt: skip
        tables.ensure(self._num_rows, max_seq)
        outs = [self._group_rows(spec, md, n, num_tokens, prefix, seq, max_seq, rows)
                for spec, md in zip(self.specs, metadata, strict=True)]  # fmt: skip
        if dev.type == "cpu":
            if not may_depend:  # the usual step: numpy, no tensors made
                batches = [StepBatch(None, (rows, prefix, ql, input_ids, positions, out))
                           for out in outs]  # fmt: skip
                self._head(batches)
                self._open = [batches]
                return
            outs = [torch.from_numpy(out) for out in outs]
        tables.publish(rows)
        row_idx, prefix_t, ql_t, positions_t, ids_t = (
            _tensor(a, dev) for a in (rows, prefix, ql, positions, input_ids))  # fmt: skip
        if fwd is not None and dev.type != "cpu":  # on the device: no copy to the host
            ids_t = torch.where(ids_t != FORWARD_ID_SKIP, fwd[:num_tokens].to(ids_t.dtype), ids_t)
        levels = [0] * n
        if may_depend:
            # Only a row that starts this step on a prefix (a prefix hit, a resumed
            # request: several new tokens after K > 0) can read blocks another row fills.
            token_rows = torch.repeat_interleave(torch.arange(n), ql_t.cpu(),
                                                 output_size=num_tokens)  # fmt: skip
            deps: list[set[int]] = [set() for _ in range(n)]
            pos = torch.arange(max_seq, device=dev)
            for spec, out in zip(self.specs, outs, strict=True):
                table = tables.r2t[spec.index][row_idx, :max_seq]
                verify_slots = torch.where(pos[None, :] < prefix_t[:, None], table, 0)
                self._add_dependencies(deps, verify_slots, out, token_rows)
            levels = _levels(deps)
        passes = []
        for level in range(max(levels, default=0) + 1):
            idx = row_idx if level == 0 and not any(levels) else torch.where(
                torch.tensor(levels, device=dev) == level, row_idx, 0)  # fmt: skip
            passes.append([StepBatch((idx, prefix_t, ql_t, ids_t, positions_t, out))
                           for out in outs])  # fmt: skip
        self._head(passes[0])
        self._open = passes

    def _fast_head(self, metadata: Sequence[Any]) -> bool:
        """HEAD of a single-group CPU step in one compiled call (:func:`.steps.head_step_nb`:
        the step's metadata part, the batch, the group's req->token rows and the fused
        HEAD), when the step needs nothing else (no row that depends on another or that no
        request matched; the manager's
        :meth:`~kvcanary.canary.manager.CanaryManager.host_fused`); the same work as the
        full path. False otherwise, with nothing done but the metadata's part and, when
        HEAD's plan needs more scratch, the req->token rows brought up to date (the full
        path writes the same rows again, then grows the scratch)."""
        manager = self.managers[0]
        fused = manager.host_fused()
        md_args = metadata_args(metadata)
        if fused is None or md_args is None:
            return False
        tables, fwd, (bs, window, check_token) = self.tables, self._forward_input_ids, self._fast_args
        pending = self._pending_meta
        while True:
            args = (md_args, _NO_META if pending is None else pending, self._meta_out,
                    self._num_keys if pending is None else -1, tables.tokens, tables.lens,
                    self._fwd_np, fwd is not None, bs, window, tables.r2t_host[0],
                    tables.seen(0, bs), self._row_buf, self._token_buf, self._batch_block,
                    check_token, self._fast_rt.chain_position_assert, fused.block)  # fmt: skip
            entry = self._step_entry
            if entry is None:  # (the types of these arguments do not change: see __init__)
                entry = self._step_entry = entry_point(head_step_nb, *args)
            with parallel_lock:
                code, n, num_tokens, num_keys = entry(*args)
            if code <= FAST_GROW_STORE:  # the metadata's part: a wider store, arrivals
                pending = self._retry_keys(code, n, num_keys)
                continue
            self._pending_meta = pending = None
            self._num_keys = num_keys
            if code != FAST_GROW:
                break
            self._grow_fast_buffers(n, num_tokens)
        if code == FAST_FULL_PATH:
            return False
        if code >= fused.SLOT_ERROR:
            raise IndexError("kv-canary: plan slot out of range of the canary buffer")
        if code >= fused.PLAN_FAILED:  # (left no trace) more scratch, or the planner's error
            return False
        manager.opened_fused(fused, self._batch_block, code == fused.OVERFLOW)
        self._open = [[BufferStepBatch(self._row_buf, self._token_buf, n, num_tokens)]]
        self.num_fast_steps += 1
        return True

    def _grow_fast_buffers(self, n: int, num_tokens: int) -> None:
        """Room in the one-call HEAD's buffers for ``n`` rows and ``num_tokens`` tokens."""
        self._row_buf = np.zeros((4, max(2 * n, self._row_buf.shape[1])), dtype=np.int64)
        width = max(2 * num_tokens, self._token_bufs[0].shape[1])
        self._token_bufs = [np.zeros((3, width), dtype=np.int64) for _ in self.specs]
        self._token_buf = self._token_bufs[0]

    def _fast_heads(self, metadata: Sequence[Any]) -> bool:
        """HEAD of a CPU step with several groups (hybrid models) in one compiled call
        (:func:`.steps.head_groups_nb`: the batch, then per group its req->token rows and
        plans, then every group's writes, then every group's verifies: the full path's
        work in its order, :meth:`_head`); its TAIL is one call too (:meth:`after_forward`:
        :func:`.steps.tail_groups_nb`). False when the step needs the full path (as
        :meth:`_fast_head`), before any group wrote (the metadata's part done; a plan leaves no
        trace; the req->token rows brought up to date are the full path's)."""
        maybe = tuple(manager.host_fused() for manager in self.managers)
        md_args = metadata_args(metadata)
        if None in maybe or md_args is None:
            return False
        fused = cast(tuple[FusedRowLaunches, ...], maybe)
        tables, fwd, check_token = self.tables, self._forward_input_ids, self._fast_args[2]
        blks, batches = tuple(f.block for f in fused), tuple(self._batch_blocks)
        pending = self._pending_meta
        while True:  # (the tables' arrays each time: a wider store grows them)
            seens = tuple(tables.seen(s.index, s.block_size) for s in self.specs)
            args = (md_args, self._key_group, _NO_META if pending is None else pending,
                    self._meta_out, self._num_keys if pending is None else -1, tables.tokens,
                    tables.lens, self._fwd_np, fwd is not None, self._group_shapes,
                    tuple(tables.r2t_host), seens, self._row_buf, tuple(self._token_bufs),
                    batches, check_token, self._fast_rt.chain_position_assert, blks,
                    self._group_codes)  # fmt: skip
            entry = self._step_entry
            if entry is None:  # (as _fast_head's)
                entry = self._step_entry = entry_point(head_groups_nb, *args)
            with parallel_lock:
                code, n, num_tokens, num_keys = entry(*args)
            if code <= FAST_GROW_STORE:  # (as _fast_head's)
                pending = self._retry_keys(code, n, num_keys)
                continue
            self._pending_meta = pending = None
            self._num_keys = num_keys
            if code != FAST_GROW:
                break
            self._grow_fast_buffers(n, num_tokens)
        f0 = fused[0]
        if code >= f0.SLOT_ERROR:
            raise IndexError("kv-canary: plan slot out of range of the canary buffer")
        if code == FAST_FULL_PATH or code >= f0.PLAN_FAILED:
            return False
        for manager, f, batch, g_code in zip(self.managers, fused, self._batch_blocks,
                                             self._group_codes.tolist(), strict=True):  # fmt: skip
            manager.opened_fused(f, batch, g_code == f0.OVERFLOW)
        self._open_groups = (batches, blks)
        self._open = [[BufferStepBatch(self._row_buf, buf, n, num_tokens)
                       for buf in self._token_bufs]]  # fmt: skip
        self.num_fast_steps += 1
        return True

    def _head(self, batches: Sequence[StepBatch]) -> None:
        """HEAD of every group: every group's writes, then every group's verifies. The
        groups share one record buffer per block size, so a block this step writes in one
        group that another group's row reads at another position fails that read's verify
        here (the alias check), whichever group comes first."""
        for manager, batch in zip(self.managers, batches, strict=True):
            manager.before_forward(batch, verify=len(self.managers) == 1)
        if len(self.managers) > 1:
            for manager in self.managers:
                manager.head_verify()

    def after_forward(self) -> None:
        """TAIL of every group, then the dependent passes (HEAD + TAIL), then the reports
        (``raise``: after every group closed)."""
        if self._seals is not None:  # the loaded slots' TAIL records, before TAIL verifies
            self._write_seals(LaunchStage.TAIL)
            self._seals = None
        if self._open is None:
            return
        passes, self._open = self._open, None
        groups, self._open_groups = self._open_groups, None
        error: KVCanaryViolation | None = None
        if groups is None and len(passes) == 1 and len(self.managers) == 1:  # the usual
            try:  # single-group step (no loops)
                self.managers[0].after_forward(passes[0][0])
            except KVCanaryViolation as e:
                error = e
        else:
            if groups is not None:  # _fast_heads' step: every group's TAIL in one call
                args = (groups[0], self._fast_args[2], self._fast_rt.chain_position_assert,
                        groups[1])  # fmt: skip
                if self._tail_entry is None:  # (fixed types: the worker's arrays, flags)
                    self._tail_entry = entry_point(tail_groups_nb, *args)
                with parallel_lock:
                    status = self._tail_entry(*args)
                if status:
                    raise IndexError("kv-canary: plan slot out of range of the canary buffer")
            for i, batches in enumerate(passes):
                for manager, batch in zip(self.managers, batches, strict=True):
                    if i > 0:
                        manager.before_forward(batch)
                    try:
                        manager.after_forward(batch, tail_ran=groups is not None)
                    except KVCanaryViolation as e:
                        error = error or e
        for manager in self.managers:
            manager.end_step()
        if self._lent:
            self._give_back_lent()
        self.num_steps += 1
        self.num_dependent_passes += len(passes) - 1
        if error is not None:
            raise error

    @staticmethod
    def _add_dependencies(deps: list[set[int]], verify_slots: torch.Tensor, out: torch.Tensor,
                          token_rows: torch.Tensor) -> None:  # fmt: skip
        """deps[r] += the rows that write (this step) a slot row r verifies."""
        written = out >= 0
        if not bool(written.any()):
            return
        hit = torch.isin(verify_slots, out[written]) & (verify_slots > 0)
        if not bool(hit.any()):  # the usual step: one check per group
            return
        writer = dict(zip(out[written].tolist(), token_rows[written.cpu()].tolist(), strict=True))
        for r, slot in zip(*torch.nonzero(hit, as_tuple=True), strict=True):
            w = writer[int(verify_slots[r, slot])]
            if w != int(r):
                deps[int(r)].add(w)

    def flush(self) -> None:
        for manager in self.managers:
            manager.flush()

    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    # -------------------------------------------------------------- external loads
    def _clear(self, slots: Sequence[Sequence[int]]) -> None:
        """Clear the records of ``slots[g]`` (group g's slots): all-zero records, which no
        verify accepts (the chain hash of a zero record is 0)."""
        for spec, group_slots in zip(self.specs, slots, strict=True):
            if not group_slots:
                continue
            records = self.records[spec.block_size]
            idx = torch.tensor(group_slots, dtype=torch.int64, device=self.device)
            for buf in (records.k_head, records.k_tail, records.v_head, records.v_tail):
                if buf is not None:
                    buf[idx] = 0
            self.num_cleared += len(group_slots)

    def _seal_plans(self) -> list[list[tuple[WritePlan, tuple[int, int, int] | None]]]:
        """This step's seals as write plans, per group (class doc). A seal of a position p0
        > 0 chains from a seed record ``(token, position, prev_hash)`` of position p0 - 1
        made from the request's token ids; a request with no row (not in the step) or
        with a token id not known yet is not sealed (its reads are reported)."""
        step, tables = self._step, self.tables
        plans: list[list[tuple[WritePlan, tuple[int, int, int] | None]]] = [[] for _ in self.specs]
        at = 0
        for rid, start, end in zip(step.seal_req_ids, step.seal_starts, step.seal_ends,
                                   strict=True):  # fmt: skip
            n, first = end - start, at
            at += n
            row = self._rows.get(rid)
            if row is None or end > tables.lens[row]:
                continue
            tokens = tables.tokens[row, :end]
            if bool((tokens < 0).any()):
                continue
            prev = chain_seed_nb(tokens)  # prev[p]: the chain hash position p stores
            for g, group_slots in enumerate(step.seal_slots):
                slots = np.asarray(group_slots[first : first + n], dtype=np.int64)
                held = np.flatnonzero(slots >= 0)
                if not held.size:
                    continue
                i0 = int(held[0])
                p0 = start + i0
                seed = None if p0 == 0 else (int(tokens[p0 - 1]), p0 - 1, int(prev[p0 - 1]))
                count, dev = n - i0, self.device
                plans[g].append((WritePlan(
                    torch.tensor([-1 if seed is None else 0], device=dev),
                    torch.zeros(1, dtype=torch.int64, device=dev),
                    torch.tensor([count], device=dev),
                    torch.from_numpy(tokens[p0:end].copy()).to(dev),
                    torch.arange(p0, end, dtype=torch.int64, device=dev),
                    torch.from_numpy(slots[i0:]).to(dev), count, count), seed))  # fmt: skip
        return plans

    def _write_seals(self, stage: LaunchStage) -> None:
        """The seals' records of ``stage`` (HEAD: no KV read; TAIL: fingerprints of the
        loaded bytes), through the canary's write kernel. A seed record goes into slot 0
        (reserved padding: never verified, never a write target) for the write and is
        cleared after it."""
        assert self._seals is not None
        for manager, plans in zip(self.managers, self._seals, strict=True):
            if not plans:
                continue
            group, rt = manager.groups[0], manager.runtime
            for half in group.halves(self.config.v_half):
                records = group.records(stage, half)
                view = records.view(torch.int64)
                for plan, seed in plans:
                    if seed is not None:
                        view[0, :3] = torch.tensor(seed, dtype=torch.int64, device=self.device)
                    kernels.write(
                        records, plan, rt.ring, int(launch_tag(group.kind, stage, half)),
                        real_kv_sources=group.real_kv_sources(stage, half),
                        chain_position_assert=rt.chain_position_assert,
                        counters=rt.write_counters, backend=self.config.backend,  # type: ignore[arg-type]
                    )  # fmt: skip
                    if seed is not None:
                        view[0] = 0
            if stage == LaunchStage.HEAD:
                self.num_sealed += sum(plan.total_num_tokens for plan, _ in plans)

    # -------------------------------------------------------------- helpers
    def _abort_handler(self, spec: GroupSpec) -> AbortHandler:
        def handler(full: torch.Tensor, swa: torch.Tensor, req_rows: torch.Tensor) -> list[int]:
            # (req_rows: request-addressed compress-state rings, which vLLM groups lack)
            slots = torch.cat([full.long(), swa.long()]).tolist()
            self._invalid_blocks.update(s // spec.block_size for s in slots
                                        if s >= spec.block_size)  # fmt: skip
            return []  # vLLM fails / recomputes them after get_block_ids_with_load_errors

        return handler

    def _give_back_lent(self) -> None:
        self._free_rows.extend(self._lent)
        self._lent = []

    def _unmatched_rows(self, rows: np.ndarray, prefix: np.ndarray, ql: np.ndarray,
                        num_tokens: int, input_ids: np.ndarray) -> np.ndarray:  # fmt: skip
        """Rows (-1 in ``rows``) whose first new token's slot is no scheduled request's: the
        request with their (computed, scheduled) counts, when it is the only one; else a row
        of their own for this step (no token ids known). Fills ``rows`` in; the step's input
        ids again when a request was found."""
        found, step = False, self._step
        for r in np.flatnonzero(rows < 0).tolist():
            k, e = int(prefix[r]), int(ql[r])
            cands = [rid for rid, k2, e2 in zip(step.req_ids, step.column(COL_COMPUTED),
                                                step.column(COL_SCHEDULED), strict=True)
                     if k2 == k and e2 == e]  # fmt: skip
            if len(cands) == 1:
                rows[r], found = self._row(cands[0]), True
                continue
            if not self._unmatched_warned:
                self._unmatched_warned = True
                logger.warning("kv-canary (vLLM): batch row %d matches no scheduled request; "
                               "its token ids are not checked", r)  # fmt: skip
            rows[r] = self._take_row()
            self._lent.append(int(rows[r]))
        if not found:
            return input_ids
        return input_ids_nb(self.tables.tokens, self.tables.lens, rows, prefix, ql, num_tokens)

    def _group_rows(self, spec: GroupSpec, md: Any, n: int, num_tokens: int,
                    prefix: np.ndarray, seq: np.ndarray, max_seq: int,
                    rows: np.ndarray) -> Any:  # fmt: skip
        """The batch rows' req->token rows of the group (batch row r -> table row
        ``rows[r]``) from the block table attention reads: position p ->
        ``block_table[r, p // bs] * bs + p % bs``, 0 for the null block, past the sequence
        and (sliding groups) before ``K - W + 1``; returns the step's slots of the group
        (``slot_mapping``, -1 for padding and the null block): numpy on the CPU, else a
        tensor on the device."""
        bs, tables = spec.block_size, self.tables
        window = spec.sliding_window or 0
        if self.device.type == "cpu":  # one compiled pass (the per-step path on CPU)
            return group_rows_nb(
                md.block_table.numpy(), md.slot_mapping.numpy(), seq, prefix, bs, window,
                tables.r2t_host[spec.index], rows, num_tokens, tables.seen(spec.index, bs))  # fmt: skip
        table = tables.r2t[spec.index]
        row_idx = torch.from_numpy(rows).to(self.device)
        bt = md.block_table[:n].long()
        seq_t = torch.from_numpy(seq).to(self.device)
        prefix_t = torch.from_numpy(prefix).to(self.device)
        pos = torch.arange(max_seq, dtype=torch.int64, device=self.device)
        idx = torch.clamp(pos // bs, max=max(bt.shape[1] - 1, 0))
        blocks = bt[:, idx]
        valid = (pos[None, :] < seq_t[:, None]) & (blocks != 0)
        if window:  # positions the scheduler keeps (module doc)
            valid &= pos[None, :] >= (prefix_t - window + 1)[:, None]
        table[row_idx, :max_seq] = torch.where(valid, blocks * bs + pos % bs, 0)
        out = md.slot_mapping[:num_tokens].long()
        return torch.where(out >= bs, out, -1)  # padding / the null block

    # -------------------------------------------------------------- inspection
    def stats(self) -> dict[str, Any]:
        """Every group's :meth:`CanaryManager.stats`, and their sums."""
        per_group = [m.stats() for m in self.managers]
        total = {k: sum(s[k] for s in per_group)
                 for k in ("protected_tokens", "verify_entries", "write_entries", "violations",
                           "violations_reported", "verify_overflow_steps")}  # fmt: skip
        return {**total, "steps": self.num_steps,
                "dependent_passes": self.num_dependent_passes, "sealed": self.num_sealed,
                "cleared": self.num_cleared, "async_arrived": self.num_arrived,
                "async_settled": self.num_settled, "groups": per_group}  # fmt: skip

    @property
    def violations(self) -> list[Any]:
        return [row for m in self.managers for row in m.violations]

    @property
    def reporter(self) -> Any:
        """Every group's reported rows (what :class:`~kvcanary.canary.report.metrics.CanaryCollector`
        reads, with :meth:`collector_stats`)."""
        return SimpleNamespace(rows=self.violations)

    def collector_stats(self) -> dict[str, Any]:
        """The keys :class:`~kvcanary.canary.report.metrics.CanaryCollector` reads, summed."""
        by_tag: Counter[str] = Counter()
        for m in self.managers:
            by_tag.update(m.stats()["verify_entries_by_tag"])
        stats = self.stats()
        return {"violations": stats["violations"], "protected_tokens": stats["protected_tokens"],
                "verify_entries_by_tag": dict(by_tag), "sweep_passes": 0,
                "swa_divergence": {}}  # fmt: skip


class MetricsView:
    """A :class:`VllmCanaryWorker` as :class:`~kvcanary.canary.report.metrics.CanaryCollector`'s
    ``canary`` (``stats()`` and ``reporter.rows``)."""

    def __init__(self, worker: VllmCanaryWorker):
        self._worker = worker

    def stats(self) -> dict[str, Any]:
        return self._worker.collector_stats()

    @property
    def reporter(self) -> Any:
        return self._worker.reporter


def _levels(deps: list[set[int]], max_level: int = 8) -> list[int]:
    """Pass of each row: 0 without dependencies, else 1 + the deepest row it reads from."""
    levels = [0] * len(deps)
    if not any(deps):
        return levels
    for _ in range(max_level):
        new = [max((levels[w] + 1 for w in d), default=0) for d in deps]
        new = [min(v, max_level) for v in new]
        if new == levels:
            break
        levels = new
    return levels


def _host(t: torch.Tensor) -> np.ndarray:
    """``t`` as host numpy (a view on the CPU)."""
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)
