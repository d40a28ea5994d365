"""ForwardBatch: everything one model forward needs, as tensors (the scheduler's hand-off).

Token layout of an extend batch (requests packed flat, batch order)::

    request        r0                      r1
    positions      [p0 .. s0)              [p1 .. s1)        p = prefix_len, s = seq_len
    input_ids      new tokens of r0        new tokens of r1
    out_cache_loc  full slots they fill    ...

A decode batch is the same with exactly one new token per request
(``prefix_len = seq_len - 1``). Graph-padded rows use req row 0, slot 0. A speculative
verify batch is an extend batch of ``[last token, d1 .. dK]`` per request at positions
``[p, p + K]`` whose forward returns the logits of every token (``all_logits``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from kvcanary.engine.request import Req


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
    # The forward returns the logits of every token, not just each request's last one
    # (a speculative verify batch).
    all_logits: bool = False

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


def build_extend_batch(
    device: torch.device, req_to_token: torch.Tensor, plan: list[tuple[Req, int, int, list[int]]]
) -> ForwardBatch:
    """An extend batch: per ``(req, start, end, tokens)``, ``tokens`` (``end - start`` of
    them) at positions ``[start, end)``, in the slots the request's req->token row maps
    them to (allocated by the caller)."""
    ids: list[int] = []
    pos: list[int] = []
    locs = []
    for req, start, end, tokens in plan:
        if len(tokens) != end - start:
            raise ValueError(f"extend batch: {len(tokens)} tokens for positions [{start}, {end})")
        ids.extend(tokens)
        pos.extend(range(start, end))
        locs.append(req_to_token[req.req_pool_idx, start:end])
    prefix = [s for _, s, _, _ in plan]
    seq = [e for _, _, e, _ in plan]
    ext = [e - s for _, s, e, _ in plan]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        req_pool_indices=torch.tensor([r.req_pool_idx for r, _, _, _ in plan], device=device),
        seq_lens=torch.tensor(seq, device=device),
        prefix_lens=torch.tensor(prefix, device=device),
        extend_seq_lens=torch.tensor(ext, device=device),
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        out_cache_loc=torch.cat(locs).to(torch.int64),
        seq_lens_cpu=seq,
        prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=ext,
        rids=[r.rid for r, _, _, _ in plan],
    )


def build_decode_batch(device: torch.device, reqs: list[Req], out: torch.Tensor) -> ForwardBatch:
    """A decode batch: each request's newest token at position ``kv_len``, in slot ``out[i]``."""
    kv = [r.kv_len for r in reqs]
    seq = [n + 1 for n in kv]
    ones = [1] * len(reqs)
    last = [(r.output_ids or r.prompt_ids)[-1] for r in reqs]  # each request's newest token
    # One tensor, a row per field (one host-to-device copy, not six; built in numpy:
    # torch.tensor of the nested lists costs ~2x).
    rows, seq_lens, prefix_lens, extend_lens, input_ids, positions = torch.from_numpy(
        np.array([[r.req_pool_idx for r in reqs], seq, kv, ones, last, kv], dtype=np.int64)
    ).to(device)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=rows,
        seq_lens=seq_lens,
        prefix_lens=prefix_lens,
        extend_seq_lens=extend_lens,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out.to(torch.int64),
        seq_lens_cpu=seq,
        prefix_lens_cpu=kv,
        extend_seq_lens_cpu=ones,
        rids=[r.rid for r in reqs],
    )
