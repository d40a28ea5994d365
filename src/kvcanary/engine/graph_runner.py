"""GraphRunner: static-shape decode with batch-size buckets and persistent input buffers.

A decode batch of ``bs`` requests runs as the smallest bucket ``B >= bs``; rows
``[bs, B)`` are padding::

    row            0 .. bs-1 (real)         bs .. B-1 (padding)
    req_pool_idx   real rows                0   (req→token padding row)
    seq_len        real lengths             1   (reads req_to_token[0, 0] = slot 0)
    out_cache_loc  real slots               0   (writes land in the sink slot 0;
                                                 SWA: mapping[0] = 0 → SWA sink)

Inputs are copied into buffers allocated once, so a captured CUDA graph (or the canary's
in-graph part) always sees the same addresses. On CPU the bucket is replayed eagerly with
the same buffer discipline, which exercises exactly the padding semantics a graph would.
"""

from __future__ import annotations

import bisect

import torch

from kvcanary.engine.forward_batch import ForwardBatch, ForwardMode
from kvcanary.engine.model_runner import ModelRunner


class GraphRunner:
    def __init__(self, runner: ModelRunner, batch_sizes: tuple[int, ...]):
        if not batch_sizes:
            raise ValueError("graph_batch_sizes is empty: nothing to capture")
        self.runner = runner
        self.batch_sizes = tuple(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        dev = runner.device
        z = lambda: torch.zeros(self.max_bs, dtype=torch.int64, device=dev)  # noqa: E731
        self.input_ids, self.positions, self.req_pool_indices = z(), z(), z()
        self.seq_lens, self.out_cache_loc = z(), z()
        self.num_replays = 0

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.is_decode and fb.batch_size <= self.max_bs

    def bucket_for(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        padded_bs = self.bucket_for(bs)
        pad = padded_bs - bs
        for buf, src, fill in (
            (self.input_ids, fb.input_ids, 0),
            (self.positions, fb.positions, 0),
            (self.req_pool_indices, fb.req_pool_indices, 0),
            (self.seq_lens, fb.seq_lens, 1),
            (self.out_cache_loc, fb.out_cache_loc, 0),
        ):
            buf[:bs].copy_(src)
            buf[bs:padded_bs].fill_(fill)
        padded = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=self.req_pool_indices[:padded_bs],
            seq_lens=self.seq_lens[:padded_bs],
            prefix_lens=self.seq_lens[:padded_bs] - 1,
            extend_seq_lens=torch.ones(padded_bs, dtype=torch.int64, device=self.runner.device),
            input_ids=self.input_ids[:padded_bs],
            positions=self.positions[:padded_bs],
            out_cache_loc=self.out_cache_loc[:padded_bs],
            seq_lens_cpu=fb.seq_lens_cpu + [1] * pad,
            prefix_lens_cpu=fb.prefix_lens_cpu + [0] * pad,
            extend_seq_lens_cpu=[1] * padded_bs,
            rids=fb.rids + [0] * pad,
            num_padding=pad,
        )
        self.num_replays += 1
        return self.runner.forward(padded)[:bs]
