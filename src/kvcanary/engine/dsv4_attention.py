"""DSV4AttentionBackend: the paged memory behind a DeepSeek-V4 forward
(:class:`~kvcanary.model.deepseek_v4.DSV4Backend`) over a
:class:`~kvcanary.memory.dsv4_pool.DSV4KVPool` and the req->token table.

What each layer reads and writes, for a request with new positions ``[pre, seq)``::

    latent (every layer)  write  pool.set_kv_buffer(layer, full_loc, kv)   (SWA rows)
                          read   positions [max(0, pre - W + 1), seq), each query its
                                 window (t - W, t]
    ring (ratio r > 0)    write  the state of every new token at state_loc(its SWA
                                 slot); where two new tokens share a row (same SWA page,
                                 r apart) only the later one, as a sequential writer
                                 would leave it
                          read   the live tail at ``pre`` (state_tail_len(r, pre) rows),
                                 the part of a completing window processed earlier
    compressed            write  each window [r*w, r*w + r) with r*w + r in (pre, seq]:
                                 pool.set_compressed_buffer / set_indexer_buffer at the
                                 full slot of its first position (row full // r)
                          read   entries w < seq // r (rows req_to_token[r*w] // r), query
                                 t sees w < (t + 1) // r

A C4 window's state span is the window before it (its Ca series) and itself (Cb), so it
reads up to 7 tokens processed by earlier forwards: exactly the C4 live tail. A C128
window reads up to 127: the C128 live tail. Positions before 0 contribute an empty state
(kv 0, score -inf: no weight).

Prefix cache, retraction, host offload: they work unchanged. A DSV4 pool needs pages that
are a multiple of every compression ratio (128 with C128 layers), and the radix cache
shares whole pages, so a cached prefix always ends on a compression boundary: every
compressed entry before it is complete (rows of the shared full pages), the C128 live tail
is empty, and the C4 live tail (the previous window's Ca series) is the last 4 ring rows of
the shared page's ring, which nothing writes again once the page is full. The window-aware
match already requires the last ``W >= 8`` tokens SWA-resident, which keeps that ring.
Window eviction (``kv_len - W - P``) and host restore (the window tail) keep the live tails:
C4 needs 7 tokens (``W >= 8``), C128 127 (``P >= 128``). Host copies
(:mod:`kvcanary.memory.host_pool`) carry the latent window, the compressed rows and the
ring rows of the last ``ring`` tokens.

Index tables are built once per forward (``init_forward_metadata``) and shared by every
layer of a ratio; the latent write location's full->SWA translation is the pool's cached
one (one gather for all layers), read tables index the mapping directly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcanary.engine.attention import QueryLayout, key_view
from kvcanary.engine.forward_batch import ForwardBatch
from kvcanary.memory.dsv4_pool import STATE_RING_SIZE, DSV4KVPool
from kvcanary.memory.req_to_token import ReqToTokenPool
from kvcanary.model.deepseek_v4 import CompressWindows


class _RatioTables(NamedTuple):
    """One ratio's index tables for one forward."""

    write_token: torch.Tensor  # int64 [n]: new tokens whose state survives the forward
    write_swa: torch.Tensor  # int64 [n]: their SWA slots
    old_swa: torch.Tensor  # int64 [m]: SWA slots of earlier tokens windows read
    span_src: torch.Tensor  # int64 [num_windows, span] into cat(fresh [N], old [m], empty [1])
    start_positions: torch.Tensor  # int64 [num_windows]
    window_full_loc: torch.Tensor  # int64 [num_windows]
    entry_full_loc: torch.Tensor  # int64 [bs, T]: full slot of each visible entry (0: none)
    entry_visible: torch.Tensor  # bool [bs, max_q, T]


class DSV4AttentionBackend:
    def __init__(self, pool: DSV4KVPool, req_to_token_pool: ReqToTokenPool, sliding_window: int):
        self.pool = pool
        self.req_to_token_pool = req_to_token_pool
        self.sliding_window = sliding_window
        self._layout: QueryLayout | None = None
        self._write_loc: torch.Tensor | None = None
        self._sliding: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ratios: dict[int, _RatioTables] = {}

    # ----------------------------------------------------------- metadata
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        layout = QueryLayout.of(fb)
        rows = fb.req_pool_indices.to(torch.int64)
        table = self.req_to_token_pool.req_to_token
        mapping = self.pool.full_to_swa_index_mapping
        w = self.sliding_window
        slots, visible, _ = key_view(table, rows, layout, (layout.pre - w + 1).clamp(min=0), w, device)
        self._sliding = (mapping[slots].clamp(min=0), visible)
        self._layout, self._write_loc = layout, fb.out_cache_loc.to(torch.int64)
        self._ratios = {
            r: self._ratio_tables(r, fb, layout, rows)
            for r in sorted(set(self.pool.compression_ratios) - {0})
        }

    def _ratio_tables(
        self, ratio: int, fb: ForwardBatch, layout: QueryLayout, rows: torch.Tensor
    ) -> _RatioTables:
        device, page = fb.input_ids.device, self.pool.page_size
        table = self.req_to_token_pool.req_to_token
        mapping = self.pool.full_to_swa_index_mapping
        ring = STATE_RING_SIZE[ratio]
        span = 2 * ratio if ratio == 4 else ratio
        num_tokens = fb.num_tokens
        new_swa = mapping[fb.out_cache_loc.to(torch.int64)]
        new_swa_cpu, row_ids = new_swa.cpu(), rows.tolist()  # one device read each
        write_token: list[torch.Tensor] = []
        old_pos: list[tuple[int, int]] = []  # (req row, position) of earlier tokens windows read
        srcs: list[torch.Tensor] = []
        starts: list[int] = []
        win_pos: list[tuple[int, int]] = []  # (req row, first position) of each window
        start = 0
        for b, (pre, seq) in enumerate(zip(fb.prefix_lens_cpu, fb.seq_lens_cpu, strict=True)):
            row = row_ids[b]
            pos = torch.arange(pre, seq)
            # Two new tokens share a ring row iff same SWA page and `ring` apart: keep the later.
            offset = new_swa_cpu[start : start + seq - pre] % page
            keep = (pos + ring >= seq) | (offset + ring >= page)
            write_token.append(torch.nonzero(keep).reshape(-1) + start)
            for w in range(pre // ratio, seq // ratio):  # windows ending in (pre, seq]
                span_pos = torch.arange(w * ratio + ratio - span, (w + 1) * ratio)
                src = torch.full((span,), -1, dtype=torch.int64)  # -1: empty
                fresh = span_pos >= pre
                src[fresh] = span_pos[fresh] - pre + start
                old = (span_pos >= 0) & ~fresh
                src[old] = -2 - (len(old_pos) + torch.arange(int(old.sum())))  # old: -2 - k
                old_pos += [(row, int(p)) for p in span_pos[old]]
                srcs.append(src)
                starts.append(w * ratio)
                win_pos.append((row, w * ratio))
            start += seq - pre
        num_old = len(old_pos)
        span_src = torch.stack(srcs) if srcs else torch.zeros((0, span), dtype=torch.int64)
        # Remap: fresh i -> i, old k (-2 - k) -> N + k, empty (-1) -> N + num_old.
        span_src = torch.where(span_src >= 0, span_src,
                               torch.where(span_src == -1, num_tokens + num_old,
                                           num_tokens - 2 - span_src))  # fmt: skip
        old_swa = torch.zeros(0, dtype=torch.int64, device=device)
        if old_pos:
            r_idx, p_idx = zip(*old_pos, strict=True)
            full = table[torch.tensor(r_idx), torch.tensor(p_idx)].to(torch.int64)
            old_swa = mapping[full.to(device)]
        win_rows, win_cols = (torch.tensor([p[i] for p in win_pos], dtype=torch.int64) for i in (0, 1))
        win_loc = table[win_rows, win_cols].to(device, torch.int64)  # one gather
        entry_full_loc, entry_visible = self._entries(ratio, layout, rows)
        tok = torch.cat(write_token).to(device)
        return _RatioTables(
            tok, new_swa[tok], old_swa, span_src.to(device),
            torch.tensor(starts, dtype=torch.int64, device=device),
            win_loc,
            entry_full_loc, entry_visible,
        )  # fmt: skip

    def _entries(
        self, ratio: int, layout: QueryLayout, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = layout.flat_index.device
        num = layout.seq // ratio  # entries complete after this forward
        max_t = int(num.max()) if num.numel() else 0
        wt = torch.arange(max_t)
        have = wt[None, :] < num[:, None]
        cols = torch.where(have, wt[None, :] * ratio, torch.zeros_like(wt[None, :]))
        table = self.req_to_token_pool.req_to_token
        full = table[rows[:, None], cols.to(device)].to(torch.int64)
        full = torch.where(have.to(device), full, torch.zeros_like(full))
        visible = have[:, None, :] & (wt[None, None, :] < (layout.q_pos[:, :, None] + 1) // ratio)
        return full, (visible & layout.valid_cpu[:, :, None]).to(device)

    # ----------------------------------------------------------- layout
    def _get_layout(self) -> QueryLayout:
        if self._layout is None:
            raise RuntimeError("DSV4 attention backend: init_forward_metadata was not called")
        return self._layout

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        layout = self._get_layout()
        if layout.dense:
            return x.view(*layout.flat_index.shape, *x.shape[1:])
        return x[layout.flat_index]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        layout = self._get_layout()
        return x.reshape(-1, *x.shape[2:]) if layout.dense else x[layout.valid]

    # ----------------------------------------------------------- latent
    def store_latent(self, layer_id: int, kv: torch.Tensor) -> None:
        if self._write_loc is None:
            raise RuntimeError("DSV4 attention backend: init_forward_metadata was not called")
        self.pool.set_kv_buffer(layer_id, self._write_loc, kv)

    def sliding_keys(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._sliding is None:
            raise RuntimeError("DSV4 attention backend: init_forward_metadata was not called")
        slots, visible = self._sliding
        buf = self.pool.get_key_buffer(layer_id)
        return buf.index_select(0, slots.reshape(-1)).view(*slots.shape, buf.shape[-1]), visible

    # ----------------------------------------------------------- compressed
    def _tables(self, layer_id: int) -> _RatioTables:
        return self._ratios[self.pool.layer_mapping[layer_id].ratio]

    def compress_windows(self, layer_id: int, indexer: bool, states: torch.Tensor) -> CompressWindows:
        t = self._tables(layer_id)
        pool = self.pool
        ring = pool.get_indexer_state_buffer(layer_id) if indexer else pool.get_state_buffer(layer_id)
        old = ring[pool.state_loc(layer_id, t.old_swa)].to(states.dtype)
        empty = torch.zeros((1, states.shape[1]), dtype=states.dtype, device=states.device)
        empty[:, states.shape[1] // 2 :] = float("-inf")
        windows = torch.cat([states, old, empty])[t.span_src]
        # Reads first: a window's old rows are never this forward's rows, but keep it obvious.
        ring[pool.state_loc(layer_id, t.write_swa)] = states[t.write_token].to(ring.dtype)
        return CompressWindows(windows, t.start_positions, t.window_full_loc)

    def store_compressed(
        self, layer_id: int, indexer: bool, windows: CompressWindows, entries: torch.Tensor
    ) -> None:
        if indexer:
            self.pool.set_indexer_buffer(layer_id, windows.full_loc, entries)
        else:
            self.pool.set_compressed_buffer(layer_id, windows.full_loc, entries)

    def compressed_keys(self, layer_id: int, indexer: bool) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._tables(layer_id)
        pool = self.pool
        buf = pool.get_indexer_buffer(layer_id) if indexer else pool.get_compressed_buffer(layer_id)
        rows = pool.compressed_loc(layer_id, t.entry_full_loc)
        keys = buf.index_select(0, rows.reshape(-1)).view(*rows.shape, buf.shape[-1])
        return keys, t.entry_visible
