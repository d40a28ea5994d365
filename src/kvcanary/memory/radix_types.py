"""The prefix cache's data: tree nodes and what its API hands out (see
:mod:`~kvcanary.memory.radix_cache` for the policy, :class:`~kvcanary.memory.base.PrefixCache`
for the contract). Kept apart so the contract can name them without importing the cache."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

_node_ids = itertools.count()


@dataclass(slots=True, eq=False)
class RadixNode:
    key: list[int]
    value: torch.Tensor  # full slots, one per key token
    parent: RadixNode | None = field(default=None, repr=False)
    children: dict[int | tuple[int, ...], RadixNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # full locks: no eviction
    swa_lock_ref: int = 0  # SWA locks (<= lock_ref): no tombstoning
    tombstone: bool = False  # SWA slots freed (mapping 0); full slots still valid
    last_access: int = 0
    node_id: int = field(default_factory=lambda: next(_node_ids))


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # full slots of the usable prefix (tree-owned)
    last_node: RadixNode  # lock this; the root when nothing matched
    num_tokens: int


class SwaLock(NamedTuple):
    """What one :meth:`RadixCache.inc_lock_ref` holds, as positions on the path root → node:
    full locks on ``[0, path_len)``, SWA locks on ``[swa_start, path_len)`` (empty when
    ``swa_start == path_len``). Splits only add node boundaries, so a release by position
    takes back exactly the nodes (and split halves) that were locked."""

    path_len: int  # tokens on the path, the locked node included
    swa_start: int  # first SWA-locked position (a node boundary)


class CachedSpan(NamedTuple):
    node: RadixNode
    prefix_len: int  # tokens on the path before this node: slot i sits at position prefix_len + i
    slots: torch.Tensor
