"""The canary's attachers for kvcanary's own pools (registered on import; the engine host
:mod:`.host` imports this module): which groups each pool type gets.

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
the KV (DSV4KVPool: every sub-pool, rings included). A missing or empty sub-pool is a clear
``ValueError``, never a half-attached pool -- except the full sub-pool of an all-sliding
``SWAKVPool``: its slots are still the logical index space every request's req->token row
points into, so its FULL group keeps one record per full slot (the chain over each
request's whole history, verified every forward, so a remapped entry anywhere in the
history is caught) while the SWA group fingerprints the sliding layers' bytes in the
window. The records ride with the (layerless) full sub-pool like any sidecar: they are the
whole KV channel of its buf-infos and its host copies.
"""
from __future__ import annotations

from typing import Any

import torch

from kvcanary.canary.attach.buffers import CanaryBufferGroup, allocate_group, real_kv_sources
from kvcanary.canary.attach.mha import attach_mha, attach_swa
from kvcanary.canary.attach.registry import AttachOptions, register_pool_attacher
from kvcanary.canary.attach.splice import Segment, patch_buf_infos
from kvcanary.canary.plan.state import StateRing
from kvcanary.canary.wire.constants import PoolKind
from kvcanary.memory.dsv4_pool import DSV4KVPool, LatentKVPool
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.swa_pool import SWAKVPool

# ------------------------------------------------------------------ helpers


def _sub_pool(pool: object, name: str) -> Any:
    sub = getattr(pool, name, None)
    if sub is None:
        raise ValueError(f"kv-canary: {type(pool).__name__}.{name} is missing; cannot attach")
    return sub


def _layers(owner: str, buffers: list[torch.Tensor] | None) -> list[torch.Tensor]:
    if not buffers:
        raise ValueError(f"kv-canary: {owner} has no layers; cannot attach a canary group to it")
    return buffers


def _lut(pool: SWAKVPool | DSV4KVPool) -> torch.Tensor:
    try:
        return pool.full_to_swa_index_mapping
    except RuntimeError as e:
        raise ValueError(f"kv-canary: {e}") from None


def _window(pool: object, options: AttachOptions) -> int:
    if options.window is None or options.window < 1:
        raise ValueError(
            f"kv-canary: {type(pool).__name__} has sliding-window sub-pools but the runner "
            f"reports sliding window {options.window!r}; allowed: an integer >= 1"
        )
    return options.window


def _register(sub: MHAKVPool | LatentKVPool, group: CanaryBufferGroup) -> None:
    """Host copies (retraction / offload) carry the group's records with the sub-pool's rows."""
    for buf in group.buffers():
        sub.register_slot_buffer(buf)


# ------------------------------------------------------------------ attachers


def _attach_mha(pool: MHAKVPool, options: AttachOptions) -> list[CanaryBufferGroup]:
    name = type(pool).__name__
    _layers(f"{name} K", pool.k_buffer)
    _layers(f"{name} V", pool.v_buffer)
    group = attach_mha(pool, name, options)
    _register(pool, group)
    return [group]


def _attach_swa(pool: SWAKVPool, options: AttachOptions) -> list[CanaryBufferGroup]:
    full, swa = _sub_pool(pool, "full_kv_pool"), _sub_pool(pool, "swa_kv_pool")
    lut, window = _lut(pool), _window(pool, options)
    if full.k_buffer or full.v_buffer:  # else every layer slides: records only (module doc)
        _layers("full_kv_pool K", full.k_buffer)
        _layers("full_kv_pool V", full.v_buffer)
    _layers("swa_kv_pool K", swa.k_buffer)
    _layers("swa_kv_pool V", swa.v_buffer)
    full_group, swa_group = attach_swa(pool, lut, window, options)
    _register(full, full_group)
    _register(swa, swa_group)
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
