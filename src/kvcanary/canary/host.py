"""The host contract: what an inference engine offers the canary, as typed Protocols.

A *host* runs model forwards over a paged KV cache and carries the canary as a guest:
kvcanary's own engine (:mod:`kvcanary.integrations.native.host`), and later vLLM (through
its KV-connector hooks) and SGLang (its pool objects, driven from its forward batch). The
canary never imports a host; a host offers the objects below and makes three calls on the
:class:`~kvcanary.canary.manager.CanaryManager` that :func:`~kvcanary.canary.install.install_canary`
returns (docs/CANARY_PROTOCOL.md has the picture)::

    host offers                          canary reads / does
    CanaryHost.token_to_kv_pool  KVPool  attach record buffers (per pool type: adapters.py)
    CanaryHost.req_to_token_pool         which slots each request's positions live in
    ForwardBatchView (per forward)       which slots this forward reads and writes

    host calls                           canary does
    before_forward(batch, forward_index) host pre-ops, fault injection, plan, HEAD verify/write
    after_forward(batch)                 TAIL verify/write, reports, observability, step += 1
    end_step()                           abort mode: the AbortHandler; end-of-step injection

Optional surface: an :data:`AbortHandler` (abort mode), a :class:`PrefixCacheView` (radix
sweep), :data:`ExpectedInputs` (write-input assertion), a :class:`TokenMirror` on the
req->token table (``--kv-canary-verify-tokens``).

Everything is structural (``typing.Protocol``): a host satisfies it by having the members,
never by importing this module. The protocols are ``runtime_checkable`` so a host's tests
can assert ``isinstance(runner, CanaryHost)`` (members present; types are mypy's job).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from kvcanary.canary.attach.splice import BufInfos

#: ``handler(full_slots, swa_slots, req_rows) -> aborted request ids`` (abort mode; int64
#: tensors on the canary's device). Abort the running requests whose req->token rows
#: reference those slots (SWA slots through the full->SWA mapping) or are one of
#: ``req_rows`` (a request-addressed compress-state ring is its request's own), free their
#: memory without caching it, quarantine the slots. Pages two holders share must be freed
#: exactly once (a violation often means a remapped entry), and never while a survivor or
#: the prefix cache holds them.
AbortHandler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]

#: ``fn(batch) -> (token_ids, positions)``, int64 ``[num_tokens]``: what every token the
#: forward writes must carry (arms the write-input assertion). It may read host-specific
#: batch fields (ours: :class:`~kvcanary.canary.observe.token_oracle.TokenOracleExpectations`).
ExpectedInputs = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class KVPool(Protocol):
    """The token->KV pool.

    Which canary groups it gets is decided by its *type*: the attacher registered for it
    with :func:`kvcanary.canary.attach.registry.register_pool_attacher` (built in: ``MHAKVPool``,
    ``SWAKVPool``, ``DSV4KVPool``; each attacher's docstring and adapters.py's module doc
    list what it reads: ``k_buffer`` / ``v_buffer`` / ``buffers`` per sub-pool, the live
    ``full_to_swa_index_mapping``, ``register_slot_buffer`` for host-copy sidecars). What
    every pool offers is its buf-infos, ``(data_ptrs, data_lens, item_lens)`` of the KV
    buffers, which the attacher replaces on the instance by versions that carry each group's
    record buffers beside its KV (so a prefill->decode transfer ships the records).

    Sub-pools with a ``set_kv_buffer(layer, loc, k, v)`` that owns a fingerprinted buffer get
    the store check (:mod:`kvcanary.canary.kernels.store_check`); a pool that stores another way
    simply gets none.
    """

    def get_contiguous_buf_infos(self) -> BufInfos: ...

    def get_state_buf_infos(self) -> BufInfos: ...


@runtime_checkable
class ReqToTokenTable(Protocol):
    """The req->token table: ``req_to_token[r, p]`` = the full-pool slot of position ``p`` of
    row ``r``'s request; int ``[rows, max_context_len]``, row 0 the padding row (slot 0).
    Mutated in place by the host (the canary holds the tensor, not a copy)."""

    @property
    def req_to_token(self) -> torch.Tensor: ...


@runtime_checkable
class TokenMirror(Protocol):
    """Optional beside :class:`ReqToTokenTable` (``--kv-canary-verify-tokens``):
    ``token_ids`` int64 ``[rows, max_context_len]``, each running request's prompt + output
    ids by position, valid for the first ``token_lens[r]`` (int64 ``[rows]``) positions."""

    @property
    def token_ids(self) -> torch.Tensor: ...

    @property
    def token_lens(self) -> torch.Tensor: ...


@runtime_checkable
class ForwardBatchView(Protocol):
    """The per-forward batch, as the canary reads it (int32 or int64 tensors on the pool's
    device; used as they are, never copied or kept past ``after_forward``)::

        req_pool_indices  [bs]          req->token row per batch row (0: padding, no effect)
        prefix_lens       [bs]          tokens already in the cache (decode: the position)
        extend_seq_lens   [bs]          tokens this forward computes per row
        input_ids         [num_tokens]  rows packed in batch order
        positions         [num_tokens]  prefix_lens[r] + j for the j-th token of row r
        out_cache_loc     [num_tokens]  full-pool slot each new token's K/V lands in

    A static-shape replay pads with row 0 / slot 0 and needs nothing else. Optional
    ``host_arrays``: numpy arrays of the six fields (this order) on the CPU, the same tuple
    every forward when they live in persistent buffers (docs/CANARY_PROTOCOL.md).
    """

    @property
    def req_pool_indices(self) -> torch.Tensor: ...

    @property
    def prefix_lens(self) -> torch.Tensor: ...

    @property
    def extend_seq_lens(self) -> torch.Tensor: ...

    @property
    def input_ids(self) -> torch.Tensor: ...

    @property
    def positions(self) -> torch.Tensor: ...

    @property
    def out_cache_loc(self) -> torch.Tensor: ...


@runtime_checkable
class CanaryHost(Protocol):
    """What :func:`~kvcanary.canary.install.install_canary` takes: the pool, the req->token
    table, where they live, the model's sliding window (``None`` without sliding layers;
    SWA / DSV4 pools need it) and whether this is a speculative draft worker (True: slot
    ``p`` holds the KV of token ``p + 1``)."""

    @property
    def token_to_kv_pool(self) -> KVPool: ...

    @property
    def req_to_token_pool(self) -> ReqToTokenTable: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def sliding_window(self) -> int | None: ...

    @property
    def is_draft_worker(self) -> bool: ...


@runtime_checkable
class PrefixCacheView(Protocol):
    """Optional: the host's prefix cache, for the radix sweep (``--kv-canary-sweep-interval``)
    and cached-slot fault injection. ``iter_cached()`` yields ``(node, prefix_len, slots)``
    for every cached node in DFS order (``slots``: its full-pool slots, positions
    ``[prefix_len, prefix_len + len(slots))``)."""

    def iter_cached(self) -> Iterable[tuple[Any, int, torch.Tensor]]: ...
