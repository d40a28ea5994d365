"""The contract between the model and whatever stores its KV.

The model never sees the scheduler or the pools. Each attention layer hands its
freshly projected (and RoPE'd) q/k/v for this forward's tokens to
``forward_batch.attn_backend`` together with an :class:`AttentionLayerSpec`; the
backend stores k/v in the KV cache and returns the attention output.

Window semantics (identical to Hugging Face): on a sliding layer with window ``W``
the query at position ``i`` sees keys at positions ``j`` with ``i - W < j <= i``
(``W`` keys including itself). Full layers see ``0 <= j <= i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    layer_id: int  # global layer index in the model
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float  # multiplied into q·k before softmax
    sliding_window: int | None  # None: full attention

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer: AttentionLayerSpec,
        forward_batch: Any,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v for this forward's tokens, attend over the cached sequence, return output."""
        ...

    # Optional (looked up with getattr; a backend without it gets forward only):
    #     rope_forward(qkv, weight, norm_eps, cos, sin, layer, forward_batch) -> Tensor | None
    # qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: the q, k and v projections
    # side by side, before RoPE; weight / norm_eps / cos / sin as
    # ``kvcanary.model.rope.apply_rope`` takes them for the q and k heads. Returns what
    # apply_rope on q and k then forward would, bit for bit, or None with nothing done (the
    # model then calls apply_rope and forward).
