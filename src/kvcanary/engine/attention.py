"""Paged attention in torch: reads K/V through ``req_to_token``, one gather of the
slot table per forward shared by all layers.

Keys a request's queries may see, for a forward over positions ``[prefix_len, seq_len)``::

    full layer     keys [0, seq_len)
    sliding layer  keys [key_start, seq_len), key_start = max(0, prefix_len - W + 1)
                   query at i sees j with i - W < j <= i  (Hugging Face's rule)

On sliding layers the slot table is translated full→SWA once per forward, in the same
gather as this forward's write locations, so N sliding layers cost one gather. Slots
before ``key_start`` may already be evicted from the SWA pool; they are never read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from numba.typed import List as typed_list

from kvcanary.engine.forward_batch import ForwardBatch
from kvcanary.memory.base import HOST
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.req_to_token import ReqToTokenPool
from kvcanary.memory.swa_pool import SWAKVPool
from kvcanary.model.base import AttentionLayerSpec
from kvcanary.ops.cpu import attention as attention_cpu
from kvcanary.ops.cpu import rope as rope_cpu


@dataclass
class _KeyView:
    slots: torch.Tensor  # int64 [bs, max_keys] slot table (0 where padded)
    mask: torch.Tensor | None  # bool [bs, max_q, max_keys]; None: mask_of makes it on first use
    write_loc: torch.Tensor  # int64 [num_tokens] where this forward's K/V go
    num_keys: torch.Tensor  # int64 [bs] keys of each request: slots[b, :num_keys[b]] (host)
    # CPU extend forwards: each request's first query's column in slots, where
    # attention_cpu.extend_attention pays (extend_pays; None: the torch path).
    first_col: np.ndarray | None = None
    # The four as numpy arrays (CPU decode tables: StaticKeyBuffers.fill copies these).
    host: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    # A CPU extend forward's mask, made only if the torch path reads it (the compiled
    # extend attention needs none; at tiny-swa's batch-64 prefill the masks cost ~15 ms).
    mask_of: Callable[[], torch.Tensor] | None = None
    _grouped: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def visible(self) -> torch.Tensor:
        """``mask``, made by ``mask_of`` where it was deferred."""
        if self.mask is None:
            if self.mask_of is None:
                raise RuntimeError("attention backend: a key view without a mask")
            self.mask = self.mask_of()
        return self.mask

    def grouped_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """``[bs, 1, group * max_q, max_keys]``: the mask for queries folded by GQA group,
        built once per forward and shared by every layer. On the host the additive ``dtype``
        mask (0 seen, -inf not) SDPA would make of the bool one on every call
        (``convert_boolean_attn_mask``: the same values, so the same results; tiny-swa's
        16 x 128-token prefill: 1.8 -> 1.0 ms an SDPA call). Elsewhere the bool mask, a view
        of the key view's for a decode: a CUDA graph captured after its warm-up runs reads
        the static buffer each replay refills (a mask materialised by a warm-up run would be
        reused by the capture and stay the capture step's: wrong outputs, seen on an H100)."""
        key = (group, dtype)
        if key not in self._grouped:
            mask = self.visible()
            bs, max_q, max_k = mask.shape
            m = mask[:, None, None].expand(bs, 1, group, max_q, max_k)
            m = m.reshape(bs, 1, group * max_q, max_k)
            if m.device == HOST:
                m = torch.zeros(m.shape, dtype=dtype).masked_fill_(~m, float("-inf"))
            self._grouped[key] = m
        return self._grouped[key]


class StaticKeyBuffers:
    """Persistent key tables for graph replay: a forward's tables are copied in (outside
    the graph) and attention reads views of these, whose addresses never change."""

    def __init__(self, max_bs: int, max_keys: int, device: torch.device):
        # Flat storage, viewed as [n, width] per replay: contiguous, same address per bucket.
        self.slots = torch.zeros(max_bs * max_keys, dtype=torch.int64, device=device)
        self.mask = torch.zeros(max_bs * max_keys, dtype=torch.bool, device=device)
        self.write_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.num_keys = torch.zeros(max_bs, dtype=torch.int64)  # host: the CPU kernel's
        # CPU: numpy views of the four buffers (fill's compiled copy).
        self._host = (
            (self.slots.numpy(), self.mask.numpy(), self.write_loc.numpy(), self.num_keys.numpy())
            if device.type == "cpu" else None
        )  # fmt: skip
        self._last: tuple[tuple[int, int], _KeyView] | None = None  # fill's last (n, width) views

    def fill(self, view: _KeyView, width: int) -> _KeyView:
        """Copy a decode view (``[n, k]`` tables, ``k <= width``) in, padded to ``width``
        (padding: slot 0, masked out)."""
        n, k = view.slots.shape
        last = self._last
        if last is None or last[0] != (n, width):  # (sliding tables: the same every step)
            out = _KeyView(self.slots[: n * width].view(n, width),
                           self.mask[: n * width].view(n, 1, width), self.write_loc[:n],
                           self.num_keys[:n])  # fmt: skip
            if self._host is not None:
                h = self._host
                out.host = (h[0][: n * width].reshape(n, width), h[1][: n * width].reshape(n, 1, width),
                            h[2][:n], h[3][:n])  # fmt: skip
            self._last = last = ((n, width), out)
        last[1]._grouped.clear()  # (the masks GQA folds are this forward's: rebuilt on use)
        if view.host is not None and self._host is not None and attention_cpu.fill_tables(
            *view.host, *self._host, width
        ):  # fmt: skip
            return last[1]  # the CPU decode tables, in one compiled copy
        slots, mask = last[1].slots, last[1].visible()
        slots.zero_()
        slots[:, :k].copy_(view.slots)
        mask.fill_(False)
        mask[:, :, :k].copy_(view.visible())
        self.write_loc[:n].copy_(view.write_loc)
        self.num_keys[:n].copy_(view.num_keys)
        return last[1]


class QueryLayout(NamedTuple):
    """Where each request's new tokens sit when padded to ``[bs, max_q]`` (CPU lengths,
    device index tables)."""

    pre: torch.Tensor  # int64 [bs] prefix lengths (CPU)
    seq: torch.Tensor  # int64 [bs] sequence lengths after the forward (CPU)
    ext: torch.Tensor  # int64 [bs] new tokens (CPU)
    q_pos: torch.Tensor  # int64 [bs, max_q] position of each padded query (CPU)
    valid: torch.Tensor  # bool [bs, max_q] real (not padding) queries
    valid_cpu: torch.Tensor  # the same on the CPU (no device read to build host masks)
    flat_index: torch.Tensor  # int64 [bs, max_q] flat token index (clamped for padding)
    dense: bool  # every request has max_q new tokens: the flat order already is [bs, max_q]

    @staticmethod
    def of(fb: ForwardBatch) -> QueryLayout:
        device = fb.input_ids.device
        ext = torch.as_tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
        pre = torch.as_tensor(fb.prefix_lens_cpu, dtype=torch.int64)
        seq = torch.as_tensor(fb.seq_lens_cpu, dtype=torch.int64)
        max_q = int(ext.max()) if fb.batch_size else 0
        starts = torch.cumsum(ext, 0) - ext
        qi = torch.arange(max_q)
        valid_cpu = qi[None, :] < ext[:, None]
        index = (starts[:, None] + qi[None, :]).clamp(max=max(fb.num_tokens - 1, 0)).to(device)
        return QueryLayout(pre, seq, ext, pre[:, None] + qi[None, :], valid_cpu.to(device),
                           valid_cpu, index, bool((ext == max_q).all()))  # fmt: skip


def key_view(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    layout: QueryLayout,
    key_start: torch.Tensor,
    window: int | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full slots of each request's keys ``[key_start, seq_len)`` ``[bs, max_k]`` (0 where
    padded), which keys each query sees ``[bs, max_q, max_k]`` (causal, and within
    ``window`` when given; padded query rows see key 0 only, so a softmax stays finite) and
    how many keys each request has ``[bs]`` (on the host: only the CPU decode kernel reads it)."""
    slots, num_keys = key_slots(req_to_token, rows, layout, key_start, device)
    return slots, key_mask(layout, key_start, num_keys, window, device), num_keys


def key_slots(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    layout: QueryLayout,
    key_start: torch.Tensor,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`key_view`'s slot table and key counts, without the mask."""
    num_keys = layout.seq - key_start
    max_k = int(num_keys.max()) if num_keys.numel() else 0
    kj = torch.arange(max_k)
    k_valid = kj[None, :] < num_keys[:, None]
    cols = torch.where(k_valid, key_start[:, None] + kj[None, :], 0).to(device)  # [bs, max_k]
    slots = req_to_token[rows[:, None], cols].to(torch.int64)
    slots = torch.where(k_valid.to(device), slots, torch.zeros_like(slots))
    return slots, num_keys


def key_mask(
    layout: QueryLayout, key_start: torch.Tensor, num_keys: torch.Tensor, window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """:func:`key_view`'s mask ``[bs, max_q, max_k]``."""
    max_k = int(num_keys.max()) if num_keys.numel() else 0
    kj = torch.arange(max_k)
    k_pos = key_start[:, None] + kj[None, :]  # [bs, max_k]
    q_pos = layout.q_pos
    vis = (kj[None, :] < num_keys[:, None])[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        vis &= k_pos[:, None, :] > q_pos[:, :, None] - window
    vis[:, :, 0] |= ~layout.valid_cpu
    return vis.to(device)


_NOT_WRAPPED = object()


# A store observer: ``observe(layer, loc, k, v)``, and the same observation from addresses
# where it offers one, ``observe_rows(layer, n, loc_addr, rows, k_addr, k_step, v_addr,
# v_step, row_bytes) -> bool`` (False: the layout is not one it reads; call observe).
Observer = tuple[Callable[..., None], Callable[..., bool] | None]


def _plain_store(sub: MHAKVPool) -> bool:
    """Whether ``sub`` stores through :class:`MHAKVPool`'s own method, nothing on the
    instance (or that very bound method put back, as a fault's undo does)."""
    store = vars(sub).get("set_kv_buffer")
    return store is None or (getattr(store, "__func__", None) is MHAKVPool.set_kv_buffer
                             and getattr(store, "__self__", None) is sub)  # fmt: skip


def _direct_store(sub: MHAKVPool, layer: int) -> tuple[Observer, ...] | None:
    """Whether a backend may store ``sub``'s layer ``layer`` itself, skipping nothing that
    ``sub.set_kv_buffer`` would do: the observers it must then call with what it stored
    (:data:`Observer`), or None where it may not. It may where the store is
    :class:`MHAKVPool`'s own method (nothing on the instance, or that very bound method put
    back, as a fault's undo does), or the canary store check's wrapper of such (marked with
    the layers it observes; on those layers its observer comes back); not under any other
    wrapper (a lost-store fault must see the store it loses)."""
    store = vars(sub).get("set_kv_buffer")
    observers: tuple[Observer, ...] = ()
    for _ in range(4):  # (wrappers over wrappers)
        if store is None or (getattr(store, "__func__", None) is MHAKVPool.set_kv_buffer
                             and getattr(store, "__self__", None) is sub):  # fmt: skip
            return observers
        observed = getattr(store, "kv_canary_observed_layers", None)
        observe = getattr(store, "kv_canary_observe", None)
        if observed is None or observe is None:
            return None
        if layer in observed:
            observers += ((observe, getattr(store, "kv_canary_observe_rows", None)),)
        store = getattr(store, "__wrapped__", _NOT_WRAPPED)
        if store is _NOT_WRAPPED:
            return None
    return None


class PagedAttentionBackend:
    def __init__(
        self,
        pool: MHAKVPool | SWAKVPool,
        req_to_token_pool: ReqToTokenPool,
        sliding_window: int | None,
    ):
        self.pool = pool
        self.req_to_token_pool = req_to_token_pool
        self.sliding_window = sliding_window
        self.swa_pool = pool if isinstance(pool, SWAKVPool) else None
        self.is_swa_pool = self.swa_pool is not None
        self._full: _KeyView | None = None
        self._sliding: _KeyView | None = None
        self._q_index: torch.Tensor | None = None  # [bs, max_q] flat token index (clamped)
        self._q_valid: torch.Tensor | None = None
        self._dense_q = False
        self._decode_query: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bs -> index, valid
        # A CPU extend forward's (first flat token, new tokens) per request, int64 numpy.
        self._extend_rows: tuple[np.ndarray, np.ndarray] | None = None
        # layer -> (its K, V buffers, their numpy views): the CPU decode kernel's arguments.
        self._kv_np: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]] = {}
        self._fused_layers: dict[int, tuple[Any, ...]] = {}  # layer -> rope_forward's entry
        self._decode_lists: tuple[Any, ...] | None = None  # decode_buffers' lists, per layers

    # ----------------------------------------------------------- metadata
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        if fb.is_decode and device == HOST and self._init_decode_cpu(fb):
            return  # (tables on the host: not where a device, even "cpu:0", wants them)
        layout = QueryLayout.of(fb)
        self._q_valid, self._dense_q, self._q_index = layout.valid, layout.dense, layout.flat_index
        rows = fb.req_pool_indices.to(torch.int64)
        bs = fb.batch_size
        self._extend_rows = None
        if device == HOST:  # CPU extend attention's request rows (attention_cpu.extend_attention)
            ext = layout.ext.numpy()
            self._extend_rows = (np.cumsum(ext) - ext, ext)
        loc = fb.out_cache_loc
        self._full = self._key_view(layout, rows, torch.zeros(bs, dtype=torch.int64), None, device,
                                    loc)  # fmt: skip
        self._sliding = None
        if self.sliding_window is not None:
            w = self.sliding_window
            key_start = (layout.pre - w + 1).clamp(min=0)
            view = self._key_view(layout, rows, key_start, w, device, loc)
            if self.swa_pool is not None:
                # One gather for this forward's write locations and the whole read table.
                both = torch.cat([loc.to(torch.int64), view.slots.reshape(-1)])
                swa = self.swa_pool.translate_loc_from_full_to_swa(both).clamp(min=0)
                view.write_loc = swa[: fb.num_tokens]
                view.slots = swa[fb.num_tokens :].reshape(view.slots.shape)
            self._sliding = view

    def _key_view(self, layout: QueryLayout, rows: torch.Tensor, key_start: torch.Tensor,
                  window: int | None, device: torch.device, write_loc: torch.Tensor) -> _KeyView:  # fmt: skip
        """An extend forward's key view (:func:`key_view`). On the host, where
        :func:`kvcanary.ops.cpu.attention.extend_attention` pays (``first_col`` set), the mask is
        deferred: that kernel reads none."""
        table = self.req_to_token_pool.req_to_token
        slots, num_keys = key_slots(table, rows, layout, key_start, device)
        view = _KeyView(slots, None, write_loc, num_keys,
                        mask_of=lambda: key_mask(layout, key_start, num_keys, window, device))  # fmt: skip
        if self._extend_rows is not None:
            first_col = (layout.pre - key_start).numpy()
            if attention_cpu.extend_pays(first_col, self._extend_rows[1], window or 0, slots.shape[1]):
                view.first_col = first_col
        if view.first_col is None:
            view.visible()  # (off the host, as before: made now, not inside a captured graph)
        return view

    def _init_decode_cpu(self, fb: ForwardBatch) -> bool:
        """:meth:`init_forward_metadata` of a CPU decode forward in one compiled pass
        (:func:`kvcanary.ops.cpu.attention.decode_tables`: the same tables); False when the slot table
        is not on the host (the torch path then runs)."""
        table = self.req_to_token_pool.host_table
        if table is None:
            return False
        bs = fb.batch_size
        host = fb.host_arrays  # (graph runner) persistent numpy views of the batch
        if host is not None:
            rows, pre = host[0], host[1]
        else:
            rows = fb.req_pool_indices.numpy()
            pre = np.asarray(fb.prefix_lens_cpu, dtype=np.int64)
        seq = np.asarray(fb.seq_lens_cpu, dtype=np.int64)
        loc = fb.out_cache_loc
        loc_np = loc.numpy()
        window = self.sliding_window or 0
        full_slots, full_mask, sliding = attention_cpu.decode_tables(
            table, rows, pre, seq, window, loc_np
        )
        query = self._decode_query.get(bs)
        if query is None:  # one query per request, in batch order
            query = self._decode_query[bs] = (
                torch.arange(bs, dtype=torch.int64)[:, None], torch.ones((bs, 1), dtype=torch.bool)
            )  # fmt: skip
        self._q_index, self._q_valid = query
        self._dense_q = True
        self._extend_rows = None
        self._full = _KeyView(torch.from_numpy(full_slots), torch.from_numpy(full_mask), loc,
                              torch.from_numpy(seq), host=(full_slots, full_mask, loc_np, seq))  # fmt: skip
        self._sliding = None
        if sliding is not None:
            both, mask, num_keys = sliding
            slots = torch.from_numpy(both)
            if self.swa_pool is not None:  # one gather: write locations and the read table
                slots = self.swa_pool.translate_loc_from_full_to_swa(slots).clamp(min=0)
                both = slots.to(torch.int64).numpy()  # (the mapping is int64: no copy)
            n = loc_np.shape[0]
            sw_slots = both[n:].reshape(bs, mask.shape[2])
            write_loc = both[:n] if self.swa_pool is not None else loc_np
            self._sliding = _KeyView(torch.from_numpy(sw_slots), torch.from_numpy(mask),
                                     torch.from_numpy(write_loc), torch.from_numpy(num_keys),
                                     host=(sw_slots, mask, write_loc, num_keys))  # fmt: skip
        return True

    def make_static(
        self, full: StaticKeyBuffers, sliding: StaticKeyBuffers | None, full_width: int
    ) -> None:
        """Decode only: move this forward's key tables into persistent buffers (full tables
        ``full_width`` wide, sliding tables ``min(W, full_width)`` wide: a decode query sees
        at most that many keys) so a captured graph can replay it."""
        if self._full is None or self._dense_q is False or self._q_index is None or self._q_index.shape[1] != 1:
            raise RuntimeError("make_static: needs the metadata of a decode forward")
        self._full = full.fill(self._full, full_width)
        if self._sliding is not None:
            if sliding is None or self.sliding_window is None:
                raise RuntimeError("make_static: sliding layers need sliding buffers")
            self._sliding = sliding.fill(self._sliding, min(self.sliding_window, full_width))

    # ----------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        view = self._sliding if layer.is_sliding else self._full
        if view is None or self._q_index is None or self._q_valid is None:
            raise RuntimeError("attention backend: init_forward_metadata was not called")
        k_buf, v_buf = self._write(layer, view.write_loc, k, v)
        bs, max_q = self._q_index.shape
        if max_q == 1 and self._dense_q and attention_cpu.applies(q, k_buf, v_buf):
            # Decode on the CPU: read K/V where they lie, no gathered copy (attention_cpu).
            kv_np = self._kv_np.get(layer.layer_id)
            if kv_np is None or kv_np[0] is not k_buf or kv_np[1] is not v_buf:
                kv_np = self._kv_np[layer.layer_id] = (k_buf, v_buf, k_buf.numpy(), v_buf.numpy())
            tables = None if view.host is None else (view.host[0], view.host[3])
            return attention_cpu.decode_attention(
                q, k_buf, v_buf, view.slots, view.num_keys, layer.scaling,
                host=(kv_np[2], kv_np[3], tables),
            )  # fmt: skip
        if self._extend_rows is not None and view.first_col is not None and attention_cpu.applies(
            q, k_buf, v_buf
        ):  # an extend on the CPU: request by request, no padding, no mask (attention_cpu)
            starts, ext = self._extend_rows
            return attention_cpu.extend_attention(
                q, k_buf, v_buf, view.slots.numpy(), view.num_keys.numpy(), starts, ext,
                view.first_col, (self.sliding_window or 0) if layer.is_sliding else 0, layer.scaling,
            )  # fmt: skip
        # index_select on the flat table: several times cheaper than advanced indexing on CPU.
        flat = view.slots.view(-1)
        keys = k_buf.index_select(0, flat).view(*view.slots.shape, *k_buf.shape[1:]).transpose(1, 2)
        values = v_buf.index_select(0, flat).view(*view.slots.shape, *v_buf.shape[1:]).transpose(1, 2)
        kvh, group, dim = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim
        # GQA without copying K/V: query head h = kv_head * group + g attends with kv_head,
        # so fold the group into the query axis.
        qb = q.view(bs, max_q, kvh, group, dim) if self._dense_q else q[self._q_index]
        qb = qb.view(bs, max_q, kvh, group, dim).permute(0, 2, 3, 1, 4)
        qb = qb.reshape(bs, kvh, group * max_q, dim).to(keys.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            qb, keys, values, attn_mask=view.grouped_mask(group, qb.dtype), scale=layer.scaling
        )
        out = out.view(bs, kvh, group, max_q, dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(bs, max_q, kvh * group, dim)
        out = out.reshape(-1, kvh * group, dim) if self._dense_q else out[self._q_valid]
        return out.to(q.dtype)

    def rope_forward(
        self,
        qkv: torch.Tensor,
        weight: torch.Tensor | None,
        norm_eps: float | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor | None:
        """A CPU decode layer's RoPE, K/V store and attention in one compiled call
        (:func:`kvcanary.ops.cpu.attention.decode_layer`), from the QKV projection ``qkv [tokens, (heads +
        2 kv heads) * head_dim]`` (q, k, v side by side, before RoPE): the bits of the q/k
        views through ``apply_rope(qk, cos, sin, weight, norm_eps)`` then :meth:`forward`.
        Taken when this forward's key tables are on the host, ``qkv`` and the layer's K/V
        buffers are contiguous CPU float32, and the layer's sub-pool stores through
        :class:`MHAKVPool`'s own ``set_kv_buffer`` or the canary store check's wrapper of it
        (:func:`_direct_store`; the check then observes what was stored, as its wrapper
        would); None otherwise, nothing done (the model rotates and calls :meth:`forward`)."""
        view = self._sliding if layer.is_sliding else self._full
        if view is None or view.host is None:  # (host tables: a CPU decode forward's)
            return None
        entry = self._fused_layers.get(layer.layer_id)
        if entry is None or (entry and (entry[0].k_buffer[entry[1]] is not entry[2]
                                        or entry[0].v_buffer[entry[1]] is not entry[3])):  # fmt: skip
            entry = self._fused_layers[layer.layer_id] = self._fused_entry(layer)  # (new buffers)
        if not entry or (observers := _direct_store(entry[0], entry[1])) is None:
            return None
        k_np, v_np = entry[4], entry[5]
        if (qkv.dtype is not torch.float32 or cos.dtype is not torch.float32 or not qkv.is_cpu
                or not qkv.is_contiguous() or torch.compiler.is_compiling()):  # fmt: skip
            return None
        bs, dim = qkv.shape[0], layer.head_dim
        out = torch.empty((bs, layer.num_heads, dim), dtype=torch.float32, device=qkv.device)
        cos_np, sin_np = rope_cpu.tables(cos, sin, bs, dim)
        k_out = None  # the stored k rows, for the observers
        if observers:
            k_out = torch.empty((bs, layer.num_kv_heads, dim), dtype=torch.float32)
        if not attention_cpu.decode_layer(
            qkv.numpy().reshape(bs, -1, dim), layer.num_heads, cos_np, sin_np,
            None if weight is None else weight.numpy(), norm_eps, k_np, v_np, view.host[2],
            view.host[0], view.host[3], layer.scaling, out.numpy(),
            None if k_out is None else k_out.numpy(),
        ):  # fmt: skip
            return None
        if k_out is not None:
            first_v = layer.num_heads + layer.num_kv_heads
            v = qkv.view(bs, -1, dim)[:, first_v : first_v + layer.num_kv_heads]
            self._observe(observers, entry[1], view.write_loc, k_out, v)
        return out

    def decode_buffers(self, layers: Sequence[AttentionLayerSpec]) -> tuple[Any, ...] | None:
        """What :mod:`kvcanary.ops.cpu.decode`'s compiled decode forward needs of every layer in
        ``layers`` (in order): ``(K buffers, V buffers)`` as numba typed lists of numpy
        views, each layer's sliding flag (int64) and scale (float32), the full and sliding
        key tables ``(slots, write slots, key counts, tasks a request, split)`` (sliding: the
        full ones again when no layer slides), then the layers whose store the canary's
        store check observes (``[(layer index, observers, sub-pool layer, write slots)]``,
        for :meth:`observe_decode`). None where some layer would not take
        :meth:`rope_forward`'s fused call, or its store is wrapped by anything else (a
        fault's wrapper must see the store)."""
        full, sliding = self._full, self._sliding
        if full is None or full.host is None:
            return None
        entries, observed = [], []
        for i, layer in enumerate(layers):
            view = sliding if layer.is_sliding else full
            if view is None or view.host is None:
                return None
            entry = self._fused_layers.get(layer.layer_id)
            if entry is None or (entry and (entry[0].k_buffer[entry[1]] is not entry[2]
                                            or entry[0].v_buffer[entry[1]] is not entry[3])):  # fmt: skip
                entry = self._fused_layers[layer.layer_id] = self._fused_entry(layer)
            if not entry:
                return None
            if not _plain_store(entry[0]):
                observers = _direct_store(entry[0], entry[1])
                if observers is None:
                    return None
                if observers:
                    observed.append((i, observers, entry[1], view.write_loc))
            entries.append(entry)
        key = tuple(id(e) for e in entries)
        cached = self._decode_lists
        if cached is None or cached[0] != key:
            ks, vs = typed_list(), typed_list()
            for e in entries:
                ks.append(e[4])
                vs.append(e[5])
            flags = np.array([int(layer.is_sliding) for layer in layers], dtype=np.int64)
            scales = np.array([layer.scaling for layer in layers], dtype=np.float32)
            cached = self._decode_lists = (key, ks, vs, flags, scales, entries)
        tables: list[tuple[Any, ...]] = []
        for view, kind in ((full, False), (sliding, True)):
            if view is None or view.host is None:
                tables.append(tables[0])
                continue
            k_np = next((e[4] for e, layer in zip(entries, layers, strict=True)
                         if layer.is_sliding == kind), entries[0][4])  # fmt: skip
            slots, _, loc, num_keys = view.host
            if not all(a.dtype == np.int64 and a.flags.c_contiguous for a in (slots, loc, num_keys)):
                return None  # (the compiled forward is typed for these)
            split, parts = attention_cpu._split(slots.shape[0], k_np, slots)
            tables.append((slots, loc, num_keys, parts, split))
        return cached[1], cached[2], cached[3], cached[4], tables[0], tables[1], observed

    @classmethod
    def observe_decode(cls, observed: Sequence[tuple[Any, ...]], k_rows: Sequence[torch.Tensor],
                       v_rows: Sequence[torch.Tensor]) -> None:  # fmt: skip
        """After a compiled decode forward: each observed layer's store (:meth:`decode_buffers`)
        handed to its observers, its stored k and v rows ``[bs, kv heads, dim]`` given."""
        for (_, observers, local, loc), k, v in zip(observed, k_rows, v_rows, strict=True):
            cls._observe(observers, local, loc, k, v)

    @staticmethod
    def _observe(observers: tuple[Observer, ...], local: int, loc: torch.Tensor,
                 k_out: torch.Tensor, v: torch.Tensor) -> None:  # fmt: skip
        """Hand each observer what a fused decode layer stored at ``loc``: the k rows it
        wrote to ``k_out`` and the v rows ``v [bs, kv heads, dim]`` (float32, as the buffers
        store them; each row contiguous, rows ``v.stride(0)`` apart: a view of the QKV
        projection), from addresses where the observer reads them so (contiguous rows),
        else as tensors."""
        bs, kv_heads, dim = v.shape
        row_bytes = kv_heads * dim * 4
        for observe, observe_rows in observers:
            if observe_rows is not None and loc.dtype is torch.int64 and loc.stride(0) == 1 and observe_rows(
                local, loc.shape[0], loc.data_ptr(), bs, k_out.data_ptr(), row_bytes,
                v.data_ptr(), v.stride(0) * 4, row_bytes,
            ):  # fmt: skip
                continue
            observe(local, loc, k_out, v)

    def _fused_entry(self, layer: AttentionLayerSpec) -> tuple[Any, ...] | tuple[()]:
        """Layer ``layer``'s (sub-pool, its layer index, K, V buffers and their numpy views)
        for :meth:`rope_forward`; () where it cannot fuse (a sub-pool of another store, or
        buffers that are not contiguous CPU float32 ``[slots, kv heads, dim]``)."""
        sub, local = self._store_of(layer.layer_id)
        if not isinstance(sub, MHAKVPool) or type(sub).set_kv_buffer is not MHAKVPool.set_kv_buffer:
            return ()
        k_buf, v_buf = sub.k_buffer[local], sub.v_buffer[local]
        if not all(b.dtype is torch.float32 and b.is_cpu and b.is_contiguous() and b.dim() == 3
                   and b.shape[1:] == (layer.num_kv_heads, layer.head_dim) for b in (k_buf, v_buf)):  # fmt: skip
            return ()
        return sub, local, k_buf, v_buf, k_buf.numpy(), v_buf.numpy()

    def _write(
        self, layer: AttentionLayerSpec, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sub, local = self._store_of(layer.layer_id)
        sub.set_kv_buffer(local, loc, k, v)  # loc is pre-translated for SWA layers
        return sub.get_key_buffer(local), sub.get_value_buffer(local)

    def _store_of(self, layer_id: int) -> tuple[MHAKVPool | SWAKVPool, int]:
        """The pool that stores layer ``layer_id`` (an SWA pool's full or SWA sub-pool) and
        the layer's index there."""
        if self.swa_pool is not None:
            return self.swa_pool._sub(layer_id)
        return self.pool, layer_id
