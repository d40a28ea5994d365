"""Canary groups over MHA-layout pools, shared by every host whose pools keep one K and one
V tensor per layer with row ``s`` = slot ``s`` (ours: :mod:`kvcanary.integrations.native.pools`;
SGLang's ``MHATokenToKVPool`` / ``SWAKVPool``: :mod:`kvcanary.integrations.sglang.pools`).

A (sub-)pool is read through its attributes only: ``k_buffer`` / ``v_buffer`` (lists of
layer tensors, empty when it holds no layer), ``page_size``, ``size``, ``device``. A host's
attacher checks what it requires of its own pools, calls these, and adds what only its pools
have (our pools' slot sidecars)."""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.canary.attach.buffers import CanaryBufferGroup, allocate_group, real_kv_sources
from kvcanary.canary.attach.registry import AttachOptions
from kvcanary.canary.attach.splice import Segment, patch_buf_infos
from kvcanary.canary.wire.constants import PoolKind


def mha_group(sub: Any, kind: PoolKind, name: str, options: AttachOptions,
              **extra: object) -> CanaryBufferGroup:  # fmt: skip
    """K+V records over an MHA-layout (sub-)pool, the padded page included; records only
    (chain, token, position: no KV bytes to fingerprint) when it holds no layer, e.g. the
    full sub-pool of a model whose every layer slides. The V half is kept even then, so every
    group of an SWA pool launches the same tags and splices the same
    ``[k_head, k_tail, v_head, v_tail]`` layout."""
    mode, layers = options.real_kv_mode, options.real_data_layers
    k_layers, v_layers = list(sub.k_buffer or []), list(sub.v_buffer or [])
    if k_layers:
        num_slots, device = int(k_layers[0].shape[0]), k_layers[0].device
    else:
        num_slots, device = int(sub.size + sub.page_size), torch.device(sub.device)
    return allocate_group(
        kind, sub_pool=name, num_slots=num_slots, page_size=int(sub.page_size),
        device=device, with_v=True,
        real_kv_sources_k=real_kv_sources(k_layers, mode, layers, f"{name} K"),
        real_kv_sources_v=real_kv_sources(v_layers, mode, layers, f"{name} V"),
        kv_token_id_vs_position_offset=options.kv_token_id_vs_position_offset, **extra,
    )  # fmt: skip


def mha_segments(sub: Any, group: CanaryBufferGroup) -> list[Segment]:
    """The group's record buffers as buf-info segments after the sub-pool's K, then V."""
    return [
        Segment(len(sub.k_buffer or []), group.k_head, group.k_tail, group.page_size),
        Segment(len(sub.v_buffer or []), group.v_head, group.v_tail, group.page_size),
    ]


def attach_mha(pool: Any, name: str, options: AttachOptions) -> CanaryBufferGroup:
    """The FULL group of an MHA pool, spliced into its ``get_contiguous_buf_infos``."""
    group = mha_group(pool, PoolKind.FULL, name, options)
    patch_buf_infos(pool, "get_contiguous_buf_infos", mha_segments(pool, group))
    return group


def attach_swa(pool: Any, lut: torch.Tensor, window: int, options: AttachOptions,
               reads_window_start: bool = False) -> tuple[CanaryBufferGroup, CanaryBufferGroup]:  # fmt: skip
    """The FULL group (``full_kv_pool``) and the SWA group (``swa_kv_pool``, slots through
    ``lut``, window ``window``; ``reads_window_start``: the host's attention reads
    ``prefix_len - window`` too) of a hybrid pool, spliced into its contiguous and state
    buf-infos respectively."""
    full, swa = pool.full_kv_pool, pool.swa_kv_pool
    full_group = mha_group(full, PoolKind.FULL, "full_kv_pool", options)
    swa_group = mha_group(swa, PoolKind.SWA, "swa_kv_pool", options,
                          swa_index_lut=lut, window=window,
                          reads_window_start=reads_window_start)  # fmt: skip
    patch_buf_infos(pool, "get_contiguous_buf_infos", mha_segments(full, full_group))
    patch_buf_infos(pool, "get_state_buf_infos", mha_segments(swa, swa_group))
    return full_group, swa_group
