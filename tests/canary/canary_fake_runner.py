"""A model runner without a model: real pools, allocators and req->token table, and a fake
model that stores random K/V bytes where attention would (so real-KV fingerprints have
something to read). A minimal canary host (:class:`kvcanary.canary.host.CanaryHost`): drives
the canary's runtime in unit tests without the engine, calling ``before_forward`` /
``after_forward`` around its forward as every host does."""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.engine.forward_batch import ForwardBatch, ForwardMode
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.req_to_token import ReqToTokenPool
from kvcanary.memory.swa_pool import SWAKVPool


class StoreKVModel:
    """``forward(input_ids, positions, forward_batch)``: appends "model" to ``log`` and writes
    random bytes into every layer at this forward's slots."""

    def __init__(self, pool: Any, log: list[Any]):
        self.pool = pool
        self.log = log
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> Any:
        self.log.append("model")
        loc = forward_batch.out_cache_loc
        for buf, rows in self._targets(loc):
            fresh = torch.randn((rows.numel(), *buf.shape[1:]), generator=self.gen)
            buf[rows] = fresh.to(buf.dtype)
        return None

    def _targets(self, loc: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pool = self.pool
        if isinstance(pool, MHAKVPool):
            return [(b, loc) for b in pool.all_buffers()]
        if isinstance(pool, SWAKVPool):
            swa = pool.full_to_swa_index_mapping[loc]
            return [(b, loc) for b in pool.full_kv_pool.all_buffers()] + [
                (b, swa) for b in pool.swa_kv_pool.all_buffers()
            ]
        assert isinstance(pool, DSV4KVPool)
        swa = pool.full_to_swa_index_mapping[loc]
        out = [(b, swa) for b in pool.swa_kv_pool.buffers]
        for sub, ratio in ((pool.c4_kv_pool, 4), (pool.c4_indexer_kv_pool, 4),
                           (pool.c128_kv_pool, 128)):  # fmt: skip
            out += [(b, loc // ratio) for b in sub.buffers]
        for ring in (*pool.compress_state_pools.values(), pool.indexer_compress_state_pool):
            rows = (swa // pool.page_size) * ring.rows_per_page + swa % ring.rows_per_page
            out += [(b, rows) for b in ring.buffers]  # each token's raw state in its ring row
        return out


class FakeRunner:
    """What :func:`install_canary` needs from a host, plus a ``forward`` over (row, n) pairs
    that calls the installed canary (``self.canary``, set by the test) around the model."""

    def __init__(self, pool: Any, allocator: Any, *, sliding_window: int | None = None,
                 max_context_len: int = 64):  # fmt: skip
        self.token_to_kv_pool = pool
        self.allocator = allocator
        self.req_to_token_pool = ReqToTokenPool(4, max_context_len)
        self.device = torch.device("cpu")
        self.sliding_window = sliding_window
        self.is_draft_worker = False
        self.log: list[Any] = []
        self.model = StoreKVModel(pool, self.log)
        self.canary: Any = None
        self.tokens: dict[int, list[int]] = {}
        self.gen = torch.Generator().manual_seed(1)

    def batch(self, work: list[tuple[int, int]]) -> ForwardBatch:
        """Allocate and map ``n`` new tokens for each ``(row, n)``; the forward batch."""
        r2t = self.req_to_token_pool.req_to_token
        rows, pre, seq, ids, pos, locs = [], [], [], [], [], []
        for row, n in work:
            toks = self.tokens.setdefault(row, [])
            p = len(toks)
            last = r2t[row, p - 1].long().reshape(1) if p else torch.tensor([-1])
            out = self.allocator.alloc_extend([p], [p + n], last)
            assert out is not None, "fake runner pool exhausted"
            r2t[row, p : p + n] = out.to(torch.int32)
            new = torch.randint(0, 200, (n,), generator=self.gen).tolist()
            toks += new
            rows.append(row), pre.append(p), seq.append(p + n)
            ids += new
            pos += range(p, p + n)
            locs.append(out)
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, req_pool_indices=t(rows), seq_lens=t(seq),
            prefix_lens=t(pre), extend_seq_lens=t(seq) - t(pre), input_ids=t(ids),
            positions=t(pos), out_cache_loc=torch.cat(locs).long(), seq_lens_cpu=seq,
            prefix_lens_cpu=pre, extend_seq_lens_cpu=[s - p for s, p in zip(seq, pre, strict=True)],
        )  # fmt: skip

    def forward(self, work: list[tuple[int, int]]) -> ForwardBatch:
        fb = self.batch(work)
        self.canary.before_forward(fb)
        self.model.forward(fb.input_ids, fb.positions, fb)
        self.canary.after_forward(fb)
        return fb
