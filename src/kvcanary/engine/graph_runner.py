"""GraphRunner: static-shape decode with batch-size buckets and persistent buffers.

A decode batch of ``bs`` requests runs as the smallest bucket ``B >= bs``; rows
``[bs, B)`` are padding::

    row            0 .. bs-1 (real)         bs .. B-1 (padding)
    req_pool_idx   real rows                0   (req→token padding row)
    seq_len        real lengths             1   (reads req_to_token[0, 0] = slot 0)
    out_cache_loc  real slots               0   (writes land in the sink slot 0;
                                                 SWA: mapping[0] = 0 → SWA sink)

Inputs and the attention key tables live in buffers allocated once (full tables padded
to a multiple of ``KEY_WIDTH_BUCKET`` keys when graphs are captured — exact width on CPU,
where padding would only cost — sliding tables ``min(W, that width)`` wide: attention
gathers and reads every column, so a table wider than the keys a query can see costs
K/V traffic for nothing), so every replay of a bucket
``(B, key width)`` reads the same addresses. On CUDA, without forward hooks (the canary's
per-forward plans are host-driven, so its ``before_forward`` / ``after_forward`` must run
around every replay), each bucket is captured once as a CUDA graph and replayed; a capture
failure falls back to eager replay with a warning. Everywhere else the same buffers are
used eagerly through ``ModelRunner.forward`` (hooks included), so the padding and
static-table semantics a graph relies on are exercised by the CPU tests.

With the canary on, a bucket is captured only when the canary says its decode work can be
(``graph_capturable``: ``--kv-canary-graph-safe`` plans, Triton kernels, no per-forward
Python in them); its host parts run around each replay and HEAD / TAIL are recorded with
the model::

    canary.begin_forward(fb)      host: pre-ops (before attention's tables are built)
    init_forward_metadata; tables -> static buffers
    replay [canary.head(fb); model; canary.tail(fb)]
    canary.end_forward(fb)        host: step, pump (one step late on CUDA), health, ...

The capture's two warm-up runs execute HEAD / TAIL of the capturing step for real too
(the same records written again, the launch counters bumped twice more). Run once on an
H200 (docs/ARCHITECTURE.md, "On a GPU"): captured with and without the canary, outputs
identical to eager, a fault injected after capture reported from inside the graph.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import numpy as np
import torch

from kvcanary.engine.attention import PagedAttentionBackend, StaticKeyBuffers
from kvcanary.engine.forward_batch import ForwardBatch, ForwardMode
from kvcanary.engine.hooks import GraphForwardHooks
from kvcanary.engine.model_runner import ModelRunner
from kvcanary.memory.base import HOST
from kvcanary.utils import ceil_page

logger = logging.getLogger("kvcanary.engine")

KEY_WIDTH_BUCKET = 64


class GraphRunner:
    def __init__(self, runner: ModelRunner, batch_sizes: tuple[int, ...]):
        if not batch_sizes:
            raise ValueError("graph_batch_sizes is empty: nothing to capture")
        self.runner = runner
        self.batch_sizes = tuple(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        dev = runner.device
        def z() -> torch.Tensor:
            return torch.zeros(self.max_bs, dtype=torch.int64, device=dev)

        self.input_ids, self.positions, self.req_pool_indices = z(), z(), z()
        self.seq_lens, self.out_cache_loc, self.prefix_lens = z(), z(), z()
        self.ones = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        # On the host (not "cpu:0", a stand-in device): numpy views of the buffers _pad fills,
        # in its order, then prefix_lens.
        self._host_bufs = (
            tuple(b.numpy() for b in (self.input_ids, self.positions, self.req_pool_indices,
                                      self.seq_lens, self.out_cache_loc, self.prefix_lens))  # fmt: skip
            if torch.device(dev) == HOST else None
        )
        # CPU: numpy views of the static buffers per padded batch size (ForwardBatch.host_arrays).
        self._host_arrays: dict[int, tuple[np.ndarray, ...] | None] = {}
        self.max_keys = ceil_page(runner.max_context_len, KEY_WIDTH_BUCKET)
        self.full_keys = StaticKeyBuffers(self.max_bs, self.max_keys, dev)
        window = runner.attn_backend.sliding_window
        self.sliding_keys = StaticKeyBuffers(self.max_bs, window, dev) if window else None
        # DeepSeek-V4 decode builds per-request compressed-entry tables: eager only.
        self.supported = isinstance(runner.attn_backend, PagedAttentionBackend)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.capture_failed = False
        self.num_replays = 0

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.supported and fb.is_decode and fb.batch_size <= self.max_bs

    def bucket_for(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def key_width_for(self, seq_lens_cpu: list[int]) -> int:
        bucket = KEY_WIDTH_BUCKET if self.runner.device.type == "cuda" else 1
        return min(ceil_page(max(seq_lens_cpu), bucket), self.max_keys)

    def _uses_cuda_graphs(self) -> bool:
        r = self.runner
        if r.device.type != "cuda" or self.capture_failed:
            return False  # first: the protocol isinstance below costs tens of us per step
        return r.canary is None or (isinstance(r.canary, GraphForwardHooks)
                                    and r.canary.graph_capturable)  # fmt: skip

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        padded = self._pad(fb)
        width = self.key_width_for(padded.seq_lens_cpu)
        self.num_replays += 1
        if self._uses_cuda_graphs():
            return self._replay_cuda_graph(padded, width)[:bs]
        return self.runner.forward(padded, static=lambda: self._make_static(width))[:bs]

    def _make_static(self, width: int) -> None:
        backend = self.runner.attn_backend
        if not isinstance(backend, PagedAttentionBackend):
            raise RuntimeError("graph runner: only the paged attention backend has static tables")
        backend.make_static(self.full_keys, self.sliding_keys, width)

    def _pad(self, fb: ForwardBatch) -> ForwardBatch:
        bs = fb.batch_size
        padded_bs = self.bucket_for(bs)
        pad = padded_bs - bs
        fields = ((self.input_ids, fb.input_ids, 0), (self.positions, fb.positions, 0),
                  (self.req_pool_indices, fb.req_pool_indices, 0), (self.seq_lens, fb.seq_lens, 1),
                  (self.out_cache_loc, fb.out_cache_loc, 0))  # fmt: skip
        if self._host_bufs is not None and all(src.device == HOST for _, src, _ in fields):
            # Host buffers: numpy copies (a torch op on these few rows costs ~4 us).
            for (_, src, fill), host in zip(fields, self._host_bufs[:5], strict=True):
                host[:bs] = src.numpy()
                host[bs:padded_bs] = fill
            # Static too: a captured canary HEAD reads prefix_lens at these addresses.
            np.subtract(self._host_bufs[3][:padded_bs], 1, out=self._host_bufs[5][:padded_bs])
        else:
            for buf, src, fill in fields:
                buf[:bs].copy_(src)
                buf[bs:padded_bs].fill_(fill)
            torch.sub(self.seq_lens[:padded_bs], 1, out=self.prefix_lens[:padded_bs])
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=self.req_pool_indices[:padded_bs],
            seq_lens=self.seq_lens[:padded_bs],
            prefix_lens=self.prefix_lens[:padded_bs],
            extend_seq_lens=self.ones[:padded_bs],
            input_ids=self.input_ids[:padded_bs],
            positions=self.positions[:padded_bs],
            out_cache_loc=self.out_cache_loc[:padded_bs],
            seq_lens_cpu=fb.seq_lens_cpu + [1] * pad,
            prefix_lens_cpu=fb.prefix_lens_cpu + [0] * pad,
            extend_seq_lens_cpu=[1] * padded_bs,
            rids=fb.rids + [0] * pad,
            num_padding=pad,
            host_arrays=self._host_views(padded_bs),
        )

    def _host_views(self, bs: int) -> tuple[np.ndarray, ...] | None:
        """The first ``bs`` rows of the static buffers as numpy views (None off the CPU)."""
        if bs not in self._host_arrays:
            bufs = (self.req_pool_indices, self.prefix_lens, self.ones, self.input_ids,
                    self.positions, self.out_cache_loc)  # fmt: skip
            on_cpu = bufs[0].device.type == "cpu"
            self._host_arrays[bs] = tuple(b[:bs].numpy() for b in bufs) if on_cpu else None
        return self._host_arrays[bs]

    # ------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def _replay_cuda_graph(self, fb: ForwardBatch, width: int) -> torch.Tensor:
        runner = self.runner
        canary = self._graph_hooks()
        runner.begin_forward(fb)
        if canary is not None:  # its host part, before attention builds its tables
            canary.begin_forward(fb)
        runner.attn_backend.init_forward_metadata(fb)  # host work, outside the graph
        self._make_static(width)
        key = (fb.batch_size, width)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(fb)
            except RuntimeError as e:  # pragma: no cover - needs a GPU
                logger.warning("CUDA graph capture failed for bucket %s (%s); replaying eagerly", key, e)
                self.capture_failed = True
                logits = self._run_model(fb)
                if canary is not None:
                    canary.end_forward(fb)
                return logits
        graph, logits = self.graphs[key]
        graph.replay()
        if canary is not None:
            canary.end_forward(fb)
        return logits.clone()

    def _graph_hooks(self) -> GraphForwardHooks | None:
        canary = self.runner.canary
        if canary is None:
            return None
        if not isinstance(canary, GraphForwardHooks):
            raise RuntimeError("graph runner: the runner's hooks cannot be split around a graph")
        return canary

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        """What a decode graph holds: the model (and the canary's HEAD / TAIL when on)."""
        model, canary = self.runner.model, self._graph_hooks()
        if canary is not None:
            canary.head(fb)
        hidden = model(fb.input_ids, fb.positions, fb)
        if canary is not None:
            canary.tail(fb)
        return model.compute_logits(hidden)  # one token per row

    def _capture(self, fb: ForwardBatch) -> tuple[Any, torch.Tensor]:  # pragma: no cover
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels and the allocator off the capture
                self._run_model(fb)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._run_model(fb)
        return graph, logits
