"""Per-request state held by the scheduler.

KV regions of a request with a req→token row (``L = seq_len``)::

    positions  0 ........ cache_protected_len ...... swa_evicted_seqlen ....... kv_len ... L
               [ tree-owned prefix (locked) )
                                            [ own slots, SWA freed )[ own, in window )
                                                                             next input: [kv_len, L)

``kv_len`` tokens have K/V in the cache; the last sampled token never does until the
next forward computes it. ``swa_evicted_seqlen`` only grows (page aligned) while the
request runs; the tree-owned prefix's SWA is the tree's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvcanary.config import SamplingParams
from kvcanary.memory.host_pool import HostCopy
from kvcanary.memory.radix_cache import RadixNode, SwaLock


@dataclass(frozen=True, slots=True)
class PrefixLock:
    """Opaque to everyone but the KV manager: the prefix-cache node a request locked for
    its protected prefix, and the lock token (its SWA part may be released early, which
    replaces the handle)."""

    node: RadixNode
    lock: SwaLock


class TokenLogprob(NamedTuple):
    """A sampled token's log-probability (of the model's distribution, before temperature /
    top-k / top-p) and the ``params.logprobs`` most likely tokens, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True, eq=False)
class Req:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # params.logprobs set
    generator: torch.Generator | None = None
    req_pool_idx: int = 0  # 0: holds no row
    kv_len: int = 0
    cache_protected_len: int = 0
    prefix: PrefixLock | None = None  # the prefix-cache lock on the protected prefix
    swa_evicted_seqlen: int = 0
    finish_reason: str | None = None
    host_copy: HostCopy | None = None  # KV saved at retraction (host offload)
    host_kv_len: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    num_retractions: int = 0
    admitted_once: bool = False

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def has_row(self) -> bool:
        return self.req_pool_idx != 0

    @property
    def decode_ready(self) -> bool:
        """Only the last token lacks KV: one decode forward continues it."""
        return self.has_row and self.kv_len == self.seq_len - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)
