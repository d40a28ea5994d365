"""Test-only reference attention for ONE sequence, plus a tiny greedy runner.

:class:`DenseAttentionBackend` keeps its own contiguous K/V per layer that grows with
every forward, so a prefill followed by one-token decode steps works. Positions are
implicit: the i-th token a layer ever stored sits at position i. Masking follows the
Hugging Face window rule from ``kvcanary.model.base``::

    full layer:            query i sees keys j with 0 <= j <= i
    sliding layer (W):     query i sees keys j with i - W < j <= i

Scores, softmax and the weighted sum run in float32; the output is cast back to q's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcanary.model import AttentionLayerSpec, HybridDecoder


class DenseAttentionBackend:
    """Implements ``kvcanary.model.base.AttentionBackend`` for one sequence."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}  # layer_id -> [num_tokens, kv_heads, head_dim]
        self.values: dict[int, torch.Tensor] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: object,
    ) -> torch.Tensor:
        lid = layer.layer_id
        keys = k if lid not in self.keys else torch.cat([self.keys[lid], k])
        values = v if lid not in self.values else torch.cat([self.values[lid], v])
        self.keys[lid], self.values[lid] = keys, values
        num_keys, num_queries = keys.shape[0], q.shape[0]
        q_pos = torch.arange(num_keys - num_queries, num_keys, device=q.device)[:, None]
        k_pos = torch.arange(num_keys, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if layer.sliding_window is not None:
            allowed &= k_pos > q_pos - layer.sliding_window
        group = layer.num_heads // layer.num_kv_heads
        keys = keys.float().repeat_interleave(group, dim=1)
        values = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q.float(), keys) * layer.scaling
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        return torch.einsum("hts,shd->thd", probs, values).to(q.dtype)


@dataclass
class DenseForwardBatch:
    """The only thing the model reads from a forward batch is ``attn_backend``."""

    attn_backend: DenseAttentionBackend = field(default_factory=DenseAttentionBackend)


class DenseRunner:
    """Feeds one sequence through ``model`` with a :class:`DenseAttentionBackend`."""

    def __init__(self, model: HybridDecoder) -> None:
        self.model = model
        self.batch = DenseForwardBatch()
        self.num_tokens = 0
        self.device = model.embed_tokens.weight.device

    @torch.no_grad()
    def extend(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids``; returns float32 logits ``[len(token_ids), vocab]``."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(self.num_tokens, self.num_tokens + len(ids), device=self.device)
        self.num_tokens += len(ids)
        return self.model.compute_logits(self.model(ids, positions, self.batch))

    def greedy(
        self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
    ) -> list[int]:
        """Prefill ``prompt`` then decode greedily one token per forward; stops after a stop id."""
        logits = self.extend(prompt)[-1]
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            out.append(token)
            if token in stop_ids:
                break
            logits = self.extend([token])[-1]
        return out
