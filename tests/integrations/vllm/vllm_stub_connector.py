"""A loading KV connector for the replay tests: the stand-in for an offload tier or a P/D
prefill instance, loaded beside the canary through vLLM's ``MultiConnector``
(``kv_connector_module_path: "vllm_stub_connector"``, :func:`transfer_config`).

Its "remote tier" is :data:`STORE`, module state shared by every engine of this process:
an engine with ``save`` stores the KV of every prompt position its forwards compute (each
layer's K and V rows of the token, keyed by the checkpoint and a hash of the token ids up
to the position: a prefill instance's output); an engine with ``load`` serves requests
whose id starts with that prefix from it, the longest run of stored positions after the
local hit (never the last prompt token: vLLM computes it). Options
(``kv_connector_extra_config``)::

    save        str     store the KV of the computed prompt positions of requests whose id
                        starts with this, at wait_for_save ("": none)
    load        str     serve requests whose id starts with this ("": none)
    async       bool    load asynchronously (WAITING_FOR_REMOTE_KVS) instead of in the step
    delay       int     an async load lands (bytes written, finished_recving reported) in
                        the get_finished call this many steps after it starts (>= 1)
    fail_blocks [int]   block indices (position // block size) of a request whose load
                        fails: nothing written there, their block ids reported through
                        get_block_ids_with_load_errors in the landing step (one KV cache
                        group only: vLLM's limit for block-level errors)
    max_tokens  int     cap on the tokens one request loads

Where the bytes land: a sync load in ``start_load_kv`` before the forward (vLLM calls it
first when a step has sync loads), an async one in ``get_finished`` (the last bytes land,
then the transfer reports done) - written into the block ids the scheduler gave the load,
whoever holds them by then (vLLM #32255: an in-flight transfer cannot be called back).

:data:`OBSERVERS` (the read oracle) hear what lands where: ``load(rid, tokens, positions,
block_ids)`` when bytes are written (a sync load: when the step is planned, before the
forward that reads them), ``load_failed(rid, block_ids)`` for a sync load's failed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

# (hash of the checkpoint and token ids [0, p], p) -> {layer name: [num_kv_heads, 2,
# head_size] (the K and V rows)}
STORE: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
OBSERVERS: list[Any] = []
NAME = "StubLoadConnector"


def transfer_config(**options: Any) -> dict[str, Any]:
    """One ``MultiConnector`` child config of the stub (options: module doc)."""
    return {"kv_connector": NAME, "kv_connector_module_path": __name__, "kv_role": "kv_both",
            "kv_connector_extra_config": options}  # fmt: skip


def prefix_keys(model: str, tokens: list[int]) -> list[int]:
    """The store key of each position (a running hash of the token ids up to it)."""
    out, running = [], hash(("stub", model))
    for t in tokens:
        running = hash((running, int(t)))
        out.append(running)
    return out


@dataclass
class Transfer:
    """One load (or save): request ``rid``'s positions ``[start, end)`` with its token ids
    ``tokens`` (at least ``[0, end)``), into (from) ``block_ids`` (per KV cache group)."""

    rid: str
    tokens: list[int]
    start: int
    end: int
    block_ids: tuple[list[int], ...]
    fail_blocks: tuple[int, ...] = ()
    steps_left: int = 0


@dataclass
class StubMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


# ---------------------------------------------------------------- vLLM's CPU KV layout


def token_kv(kv: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    """The K and V rows of one slot of a CPU-layout layer tensor ``[num_blocks, heads,
    block_size, 2 * head_size]`` (per (block, head): K transposed ``[head_size,
    block_size]``, then V ``[block_size, head_size]``): ``[heads, 2, head_size]``."""
    nb, heads, bs, two_hs = kv.shape
    hs = two_hs // 2
    chunk = kv.view(nb, heads, 2, hs * bs)[block]
    k = chunk[:, 0].view(heads, hs, bs)[:, :, offset]
    v = chunk[:, 1].view(heads, bs, hs)[:, offset, :]
    return torch.stack((k, v), dim=1)


def put_token_kv(kv: torch.Tensor, block: int, offset: int, value: torch.Tensor) -> None:
    nb, heads, bs, two_hs = kv.shape
    hs = two_hs // 2
    chunk = kv.view(nb, heads, 2, hs * bs)[block]
    chunk[:, 0].view(heads, hs, bs)[:, :, offset] = value[:, 0]
    chunk[:, 1].view(heads, bs, hs)[:, offset, :] = value[:, 1]


class StubLoadConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.model = str(vllm_config.model_config.model)
        self.save_prefix = str(extra.get("save", ""))
        self.load_prefix = str(extra.get("load", ""))
        self.load_async = bool(extra.get("async", False))
        self.delay = max(1, int(extra.get("delay", 1)))
        self.fail_blocks = tuple(int(b) for b in extra.get("fail_blocks", ()))
        self.max_tokens = int(extra.get("max_tokens", 1 << 30))
        groups = [] if kv_cache_config is None else kv_cache_config.kv_cache_groups
        self.block_sizes = [int(g.kv_cache_spec.block_size) for g in groups]
        self.group_layers = [list(g.layer_names) for g in groups]
        self.layers = [n for names in self.group_layers for n in names]
        # scheduler side
        self._matched: dict[str, tuple[int, int]] = {}  # rid -> (local hit, tokens to load)
        self._pending: list[Transfer] = []
        self._requests: dict[str, Any] = {}
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._in_flight: list[Transfer] = []
        self._errors: set[int] = set()
        self._saves: list[Transfer] = []
        # For the tests: the loads that landed (block ids as planned), the block ids
        # reported failed.
        self.landed: list[Transfer] = []
        self.reported: list[int] = []

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:  # fmt: skip
        rid = request.request_id
        if not self.load_prefix or not rid.startswith(self.load_prefix):
            return 0, False
        tokens = list(request.prompt_token_ids)
        keys = prefix_keys(self.model, tokens)
        n = 0
        limit = min(len(tokens) - 1, num_computed_tokens + self.max_tokens)
        for p in range(num_computed_tokens, limit):
            entry = STORE.get((keys[p], p))
            if entry is None or any(name not in entry for name in self.layers):
                break
            n += 1
        if n == 0:
            return 0, False
        self._matched[rid] = (num_computed_tokens, n)
        return n, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:  # fmt: skip
        rid = request.request_id
        self._requests[rid] = request
        if num_external_tokens <= 0 or rid not in self._matched:
            return
        local, n = self._matched.pop(rid)
        assert n == num_external_tokens, (n, num_external_tokens)
        self._pending.append(Transfer(rid, list(request.prompt_token_ids), local, local + n,
                                      tuple(list(b) for b in blocks.get_block_ids()),
                                      self.fail_blocks, self.delay if self.load_async else 0))  # fmt: skip

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = StubMetadata(loads=self._pending)
        self._pending = []
        for load in meta.loads:
            if load.steps_left:
                continue
            for observer in OBSERVERS:  # a sync load lands before this step's forward
                observer.load(load.rid, load.tokens, self._written(load), load.block_ids)
                failed = self._failed_blocks(load)
                if failed:
                    observer.load_failed(load.rid, failed)
        if self.save_prefix:
            meta.saves = self._save_plans(scheduler_output)
        return meta

    def _save_plans(self, so: Any) -> list[Transfer]:
        manager = self._kv_cache_manager
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        saves = []
        for rid, n in so.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None or manager is None or not rid.startswith(self.save_prefix):
                continue
            k = computed.get(rid, request.num_computed_tokens)
            end = min(k + n, request.num_prompt_tokens)
            if end > k:
                saves.append(Transfer(rid, list(request.prompt_token_ids), k, end,
                                      tuple(list(b) for b in manager.get_block_ids(rid))))  # fmt: skip
        return saves

    def request_finished(self, request: Any, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        self._requests.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        self._requests.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StubMetadata)
        for load in meta.loads:
            if load.steps_left:
                self._in_flight.append(load)
            else:
                self._land(load)
        meta.loads = []
        self._saves = meta.saves

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return None

    def wait_for_save(self) -> None:
        for save in self._saves:
            keys = prefix_keys(self.model, save.tokens[: save.end])
            for p in range(save.start, save.end):
                entry = STORE.setdefault((keys[p], p), {})
                for bs, names, ids in zip(self.block_sizes, self.group_layers, save.block_ids,
                                          strict=True):  # fmt: skip
                    block = ids[p // bs] if p // bs < len(ids) else 0
                    if block:
                        for name in names:
                            entry[name] = token_kv(self.kv_caches[name], block, p % bs).clone()
        self._saves = []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = set()
        for load in list(self._in_flight):
            load.steps_left -= 1
            if load.steps_left <= 0:
                self._in_flight.remove(load)
                self._land(load)
                for observer in OBSERVERS:
                    observer.load(load.rid, load.tokens, self._written(load), load.block_ids)
                done.add(load.rid)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        self.reported += sorted(out)
        return out

    def _failed_blocks(self, load: Transfer) -> list[int]:
        """The block ids (group 0) of the load's failed block indices."""
        ids, bs = load.block_ids[0], self.block_sizes[0]
        first, last = load.start // bs, (load.end - 1) // bs
        return [ids[i] for i in load.fail_blocks if first <= i <= last and i < len(ids)]

    def _written(self, load: Transfer) -> list[int]:
        bs = self.block_sizes[0]
        return [p for p in range(load.start, load.end) if p // bs not in load.fail_blocks]

    def _land(self, load: Transfer) -> None:
        """Write the load's stored KV into its blocks (all groups), but its failed blocks."""
        keys = prefix_keys(self.model, load.tokens[: load.end])
        self._errors.update(self._failed_blocks(load))
        for p in self._written(load):
            entry = STORE[(keys[p], p)]
            for bs, names, ids in zip(self.block_sizes, self.group_layers, load.block_ids,
                                      strict=True):  # fmt: skip
                block = ids[p // bs] if p // bs < len(ids) else 0
                if block:
                    for name in names:
                        put_token_kv(self.kv_caches[name], block, p % bs, entry[name])
        self.landed.append(load)
