"""ForwardBatch: everything one model forward needs, as tensors (the scheduler's hand-off).

Token layout of an extend batch (requests packed flat, batch order)::

    request        r0                      r1
    positions      [p0 .. s0)              [p1 .. s1)        p = prefix_len, s = seq_len
    input_ids      new tokens of r0        new tokens of r1
    out_cache_loc  full slots they fill    ...

A decode batch is the same with exactly one new token per request
(``prefix_len = seq_len - 1``). Graph-padded rows use req row 0, slot 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 [bs], after this forward
    prefix_lens: torch.Tensor  # int64 [bs], tokens already in the cache
    extend_seq_lens: torch.Tensor  # int64 [bs] = seq_lens - prefix_lens
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    out_cache_loc: torch.Tensor  # int64 [num_tokens], full-pool slots
    # Host copies (no device sync to read them).
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    # Request ids for oracle sampling / canary diagnostics (0 for padding rows).
    rids: list[int] = field(default_factory=list)
    num_padding: int = 0  # trailing padded rows (graph runner)
    # numpy views sharing memory with (req_pool_indices, prefix_lens, extend_seq_lens,
    # input_ids, positions, out_cache_loc) when those live in persistent CPU buffers (graph
    # runner): the canary reads the batch through them instead of making views per forward.
    host_arrays: tuple[np.ndarray, ...] | None = None
    req_to_token_pool: Any = None
    token_to_kv_pool: Any = None
    attn_backend: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        return self.forward_mode == ForwardMode.DECODE

    def last_token_indices(self) -> torch.Tensor:
        """Flat index of each request's last new token (whose logits are sampled)."""
        ends = torch.cumsum(torch.as_tensor(self.extend_seq_lens_cpu, dtype=torch.int64), 0)
        return (ends - 1).to(self.input_ids.device)
