"""Pool adapters: which canary buffer groups a KV pool gets, chosen by the pool's type.

    pool                 groups (kind: sub-pool, halves, slot translation)
    MHAKVPool            FULL: the pool itself, K+V
    SWAKVPool            FULL: full_kv_pool, K+V; records only (no real-KV sources) when
                               the model has no full-attention layer (all sliding, e.g.
                               Mistral): the full-history chain still lives there
                         SWA:  swa_kv_pool, K+V, LUT = full_to_swa_index_mapping, window W
    DSV4KVPool           SWA:  swa_kv_pool (latent, K only), LUT = the mapping, window W
                         C4 / INDEXER / C128: c4_kv_pool / c4_indexer_kv_pool / c128_kv_pool,
                         K only, one record per compressed row (full slot // ratio)
                         C4_STATE / C128_STATE / INDEXER_STATE: the compress-state rings
                         (compress_state_pools[4] / [128], indexer_compress_state_pool),
                         one record per ring row, rows addressed by SWA page (.state_plan)
                         Only sub-pools that have layers (SGLang covers the SWA part only).

Attaching also (1) splices the groups' record buffers into the pool's buf-infos
(:mod:`.splice`) and (2) registers them as slot sidecars of their sub-pool
(``register_slot_buffer``), so host copies for retraction/offload carry the records with
the KV (DSV4KVPool: every sub-pool, rings included). Other pool types raise
``NotImplementedError`` naming the supported ones; more can be added with
:func:`register_pool_attacher`. A missing or empty sub-pool is a clear
``ValueError``, never a half-attached pool -- except the full sub-pool of an all-sliding
``SWAKVPool``: its slots are still the logical index space every request's req->token row
points into, so its FULL group keeps one record per full slot (the chain over each
request's whole history, verified every forward, so a remapped entry anywhere in the
history is caught) while the SWA group fingerprints the sliding layers' bytes in the
window. The records ride with the (layerless) full sub-pool like any sidecar: they are the
whole KV channel of its buf-infos and its host copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcanary.canary.buffers import CanaryBufferGroup, allocate_group, real_kv_sources
from kvcanary.canary.constants import PoolKind, RealKvHashMode
from kvcanary.canary.splice import Segment, patch_buf_infos
from kvcanary.canary.state_plan import StateRing
from kvcanary.memory.dsv4_pool import DSV4KVPool, LatentKVPool
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.swa_pool import SWAKVPool


@dataclass(frozen=True)
class AttachOptions:
    real_kv_mode: RealKvHashMode
    real_data_layers: str  # "first" | "all"
    window: int | None  # the model's sliding window (SWA groups need it)
    kv_token_id_vs_position_offset: int = 0


PoolAttacher = Callable[[Any, AttachOptions], list[CanaryBufferGroup]]
_ATTACHERS: dict[type, PoolAttacher] = {}


def register_pool_attacher(pool_type: type, attacher: PoolAttacher) -> None:
    """Teach :func:`attach_canary_buffers` a new pool type (subclasses inherit it)."""
    _ATTACHERS[pool_type] = attacher


def supported_pool_types() -> list[str]:
    return [t.__name__ for t in _ATTACHERS]


def attach_canary_buffers(pool: Any, options: AttachOptions) -> list[CanaryBufferGroup]:
    """Allocate, splice and register the canary groups of ``pool``; returns the groups."""
    attacher = next((_ATTACHERS[t] for t in type(pool).__mro__ if t in _ATTACHERS), None)
    if attacher is None:
        raise NotImplementedError(
            f"kv-canary: no attacher registered for pool class {type(pool).__name__}; "
            f"supported: {', '.join(supported_pool_types())}"
        )
    return attacher(pool, options)


# ------------------------------------------------------------------ helpers


def _sub_pool(pool: Any, name: str) -> Any:
    sub = getattr(pool, name, None)
    if sub is None:
        raise ValueError(f"kv-canary: {type(pool).__name__}.{name} is missing; cannot attach")
    return sub


def _layers(owner: str, buffers: list[torch.Tensor] | None) -> list[torch.Tensor]:
    if not buffers:
        raise ValueError(f"kv-canary: {owner} has no layers; cannot attach a canary group to it")
    return buffers


def _lut(pool: Any) -> torch.Tensor:
    try:
        return pool.full_to_swa_index_mapping
    except RuntimeError as e:
        raise ValueError(f"kv-canary: {e}") from None


def _window(pool: Any, options: AttachOptions) -> int:
    if options.window is None or options.window < 1:
        raise ValueError(
            f"kv-canary: {type(pool).__name__} has sliding-window sub-pools but the runner "
            f"reports sliding window {options.window!r}; allowed: an integer >= 1"
        )
    return options.window


def _mha_group(sub: MHAKVPool, kind: PoolKind, name: str, options: AttachOptions,
               **extra: object) -> CanaryBufferGroup:  # fmt: skip
    """A K+V group over an MHA-layout (sub-)pool (sidecars: :func:`_register`, once every
    group of the pool was built, so a failure leaves the pool untouched)."""
    k_layers = _layers(f"{name} K", sub.k_buffer)
    v_layers = _layers(f"{name} V", sub.v_buffer)
    mode, layers = options.real_kv_mode, options.real_data_layers
    return allocate_group(
        kind, sub_pool=name, num_slots=int(k_layers[0].shape[0]), page_size=sub.page_size,
        device=k_layers[0].device, with_v=True,
        real_kv_sources_k=real_kv_sources(k_layers, mode, layers, f"{name} K"),
        real_kv_sources_v=real_kv_sources(v_layers, mode, layers, f"{name} V"),
        kv_token_id_vs_position_offset=options.kv_token_id_vs_position_offset, **extra,
    )  # fmt: skip


def _records_only_group(sub: MHAKVPool, kind: PoolKind, name: str,
                        options: AttachOptions) -> CanaryBufferGroup:  # fmt: skip
    """A K+V group over the slot index space of a sub-pool that holds no layer: records
    only (chain, token, position), no real-KV source since there are no KV bytes. The V
    half is kept so every group of an SWA pool launches the same tags and splices the same
    ``[k_head, k_tail, v_head, v_tail]`` layout."""
    return allocate_group(
        kind, sub_pool=name, num_slots=sub.num_slots, page_size=sub.page_size,
        device=sub.device, with_v=True,
        kv_token_id_vs_position_offset=options.kv_token_id_vs_position_offset,
    )  # fmt: skip


def _has_no_layers(sub: MHAKVPool) -> bool:
    return not sub.k_buffer and not sub.v_buffer


def _register(sub: MHAKVPool, group: CanaryBufferGroup) -> None:
    for buf in group.buffers():
        sub.register_slot_buffer(buf)


def _mha_segments(sub: MHAKVPool, group: CanaryBufferGroup) -> list[Segment]:
    return [
        Segment(len(sub.k_buffer), group.k_head, group.k_tail, group.page_size),
        Segment(len(sub.v_buffer), group.v_head, group.v_tail, group.page_size),
    ]


# ------------------------------------------------------------------ attachers


def _attach_mha(pool: MHAKVPool, options: AttachOptions) -> list[CanaryBufferGroup]:
    group = _mha_group(pool, PoolKind.FULL, type(pool).__name__, options)
    _register(pool, group)
    patch_buf_infos(pool, "get_contiguous_buf_infos", _mha_segments(pool, group))
    return [group]


def _attach_swa(pool: SWAKVPool, options: AttachOptions) -> list[CanaryBufferGroup]:
    full, swa = _sub_pool(pool, "full_kv_pool"), _sub_pool(pool, "swa_kv_pool")
    lut, window = _lut(pool), _window(pool, options)
    if _has_no_layers(full):  # every layer slides: the full sub-pool is an index space only
        full_group = _records_only_group(full, PoolKind.FULL, "full_kv_pool", options)
    else:
        full_group = _mha_group(full, PoolKind.FULL, "full_kv_pool", options)
    swa_group = _mha_group(swa, PoolKind.SWA, "swa_kv_pool", options,
                           swa_index_lut=lut, window=window)  # fmt: skip
    _register(full, full_group)
    _register(swa, swa_group)
    patch_buf_infos(pool, "get_contiguous_buf_infos", _mha_segments(full, full_group))
    patch_buf_infos(pool, "get_state_buf_infos", _mha_segments(swa, swa_group))
    return [full_group, swa_group]


_DSV4_COMPRESSED = (
    (PoolKind.C4, "c4_kv_pool", 4),
    (PoolKind.INDEXER, "c4_indexer_kv_pool", 4),
    (PoolKind.C128, "c128_kv_pool", 128),
)


def _attach_dsv4(pool: DSV4KVPool, options: AttachOptions) -> list[CanaryBufferGroup]:
    mode, layers = options.real_kv_mode, options.real_data_layers
    lut, window = _lut(pool), _window(pool, options)
    offset = options.kv_token_id_vs_position_offset

    def latent_group(kind: PoolKind, name: str, sub: LatentKVPool, **extra: object) -> CanaryBufferGroup:
        bufs = _layers(f"DSV4KVPool.{name}", sub.buffers)
        return allocate_group(
            kind, sub_pool=name, num_slots=sub.num_slots, page_size=sub.rows_per_page,
            device=bufs[0].device, with_v=False,
            real_kv_sources_k=real_kv_sources(bufs, mode, layers, f"DSV4KVPool.{name}"),
            kv_token_id_vs_position_offset=offset, **extra,
        )  # fmt: skip

    def wrap(group: CanaryBufferGroup, sub: LatentKVPool) -> Segment:
        return Segment(len(sub.buffers), group.k_head, group.k_tail, group.page_size)

    swa_group = latent_group(PoolKind.SWA, "swa_kv_pool", pool.swa_kv_pool, swa_index_lut=lut,
                             window=window)  # fmt: skip
    groups = [swa_group]
    owners = [(swa_group, pool.swa_kv_pool)]
    contiguous: list[Segment] = []
    state: list[Segment] = [wrap(swa_group, pool.swa_kv_pool)]
    full_slots = torch.arange(lut.shape[0], device=lut.device)
    for kind, name, ratio in _DSV4_COMPRESSED:
        sub = _sub_pool(pool, name)
        if not sub.buffers:  # no layer of this ratio: nothing to protect, nothing to splice
            continue
        group = latent_group(kind, name, sub, swa_index_lut=full_slots // ratio,
                             compression_ratio=ratio)  # fmt: skip
        groups.append(group)
        owners.append((group, sub))
        contiguous.append(wrap(group, sub))
    # Compress-state rings, in get_state_buf_infos order: one ring per SWA page.
    rings = [
        (PoolKind.C4_STATE, "compress_state_pools[4]", pool.compress_state_pools[4], 4),
        (PoolKind.C128_STATE, "compress_state_pools[128]", pool.compress_state_pools[128], 128),
        (PoolKind.INDEXER_STATE, "indexer_compress_state_pool",
         pool.indexer_compress_state_pool, 4),
    ]  # fmt: skip
    for kind, name, sub, ratio in rings:
        if not sub.buffers:
            continue
        ring = StateRing(ratio, sub.rows_per_page, "swa_page", overlap=ratio == 4,
                         swa_page_size=pool.page_size)  # fmt: skip
        group = latent_group(kind, name, sub, swa_index_lut=lut, state_ring=ring)
        groups.append(group)
        owners.append((group, sub))
        state.append(wrap(group, sub))
    patch_buf_infos(pool, "get_contiguous_buf_infos", contiguous)
    patch_buf_infos(pool, "get_state_buf_infos", state)
    # Host copies (retraction / offload) carry each group's records with its sub-pool's rows.
    for group, sub in owners:
        for buf in group.buffers():
            sub.register_slot_buffer(buf)
    return groups


register_pool_attacher(MHAKVPool, _attach_mha)
register_pool_attacher(SWAKVPool, _attach_swa)
register_pool_attacher(DSV4KVPool, _attach_dsv4)
