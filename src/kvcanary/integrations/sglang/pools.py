"""Canary buffer groups on SGLang's own pool objects (SGLang 0.5.23).

Importing this module imports SGLang and registers one attacher per supported pool class
with :func:`kvcanary.canary.attach.registry.register_pool_attacher`; ``install_canary`` then picks
it by the pool's type, exactly as for kvcanary's own pools::

    SGLang pool                  groups (sub-pool, halves, slot translation, real-KV bytes)
    MHATokenToKVPool             FULL: the pool, K+V, k_buffer[l] / v_buffer[l] rows
    SWAKVPool                    FULL: full_kv_pool, K+V (records only when it has no layer:
                                       PureSWATokenToKVPoolAllocator, every layer slides)
                                 SWA:  swa_kv_pool, K+V, LUT = full_to_swa_index_mapping
    DeepSeekV4TokenToKVPool      SWA:     swa_kv_pool (latent, K only), LUT = the mapping
                                 C4:      kv_pools[4]     one record per row (full slot // 4)
                                 INDEXER: index_pools[4]  one record per row (full slot // 4)
                                 C128:    kv_pools[128]   one record per row (full slot // 128)
                                 C4_STATE:      compress_state_pools[l] of the C4 layers
                                 INDEXER_STATE: indexer_compress_state_pools[l] (C4 layers)
                                   rings addressed by SWA page: row = (swa // swa_page_size)
                                   * ring + swa % ring (ring 8), SGLang's
                                   translate_from_swa_loc_to_state_loc
                                 C128_STATE:    compress_state_pools[l] of the C128 layers,
                                   request-scoped: row = req_pool_idx * 128 + position % 128
                                   (online C128: one running row per request, ring 1)

Real-KV fingerprints read the live bytes of the chosen layers: MHA rows whole (``[H, D]``
of ``store_dtype``); DeepSeek-V4 pages hold ``page_size`` tokens of 576 data bytes (448 fp8
nope + 64 bf16 rope) followed by the per-token fp8 scales (8 bytes, not fingerprinted: not a
multiple of 16), the indexer ``page_size`` x 128 fp8 bytes followed by 4-byte scales (same).

Compress-state rows hold one token's raw compressor state (kv, score; fp32), written when
the token is processed and read back only while the token is in the live tail (the open
compression window, plus the previous one for the overlapping C4): one record per row
binds it to that token's position and chain, and real-KV fingerprints cover the row's
bytes (see :mod:`kvcanary.canary.plan.state`). Transfers carry the records: the state
buf-infos (page-scoped C4 rings) and the request-state buf-infos (C128) are spliced too.

Refused with a one-line error naming what is supported: another SGLang version, another
pool class (subclasses included: FP4 / MXFP8 / page-major MHA, HiSparse C4 ...), an MHA
layout other than ``nhd``, MLA / DSA sub-pools in an ``SWAKVPool``, DeepSeek-V4 pools in the
unified-KV, request-window, SWA-ring, uniform-FP8 or V4.1 layouts or with ratio-1/2 layers,
an SWA / DSV4 pool whose full->SWA mapping is not registered yet (create SGLang's
``SWATokenToKVPoolAllocator`` first), and a pool SGLang's own canary already wrapped.

SGLang pools have no ``register_slot_buffer``: host copies (HiCache / CPU offload) do not
carry our records. Buf-info transfers (PD disaggregation) do: the buf-info getters are
spliced like SGLang's own canary splices them.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.canary.attach.buffers import CanaryBufferGroup, allocate_group, real_kv_sources
from kvcanary.canary.attach.mha import attach_mha, attach_swa
from kvcanary.canary.attach.registry import AttachOptions, register_pool_attacher
from kvcanary.canary.attach.splice import Segment, patch_buf_infos
from kvcanary.canary.plan.state import StateRing
from kvcanary.canary.wire.constants import PoolKind, RealKvHashMode
from kvcanary.canary.wire.real_kv import RealKvSource, resolve_read_bytes

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
SUPPORTED_POOLS = ("MHATokenToKVPool", "SWAKVPool", "DeepSeekV4TokenToKVPool")
_BUF_INFO_METHODS = ("get_contiguous_buf_infos", "get_state_buf_infos",
                     "get_request_state_buf_infos")  # fmt: skip
# DeepSeek-V4 (V4 layout) page bytes per token before the scales: 448 fp8 + 64 bf16.
DSV4_DATA_BYTES_PER_TOKEN = 576


def sglang_version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def check_sglang_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless the installed (or given) SGLang version is supported."""
    version = sglang_version() if version is None else version
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise RuntimeError(
            f"kvcanary.integrations.sglang supports sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)} "
            f"(pools: {', '.join(SUPPORTED_POOLS)}); found sglang {version}"
        )


check_sglang_version()

from sglang.srt.mem_cache.deepseek_v4_memory_pool import (  # noqa: E402
    DeepSeekV4SingleKVPool,
    DeepSeekV4TokenToKVPool,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"kv-canary on SGLang: {what}; supported: sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)} "
        f"{', '.join(SUPPORTED_POOLS)} (MHA sub-pools, nhd layout; DeepSeek-V4 in the paged "
        "V4 layout)"
    )


def check_supported_pool(pool: Any) -> None:
    """Raise (one line, naming what is supported) unless ``pool`` can be attached to."""
    cls = type(pool)
    if cls not in (MHATokenToKVPool, SWAKVPool, DeepSeekV4TokenToKVPool):
        raise _refuse(f"pool class {cls.__module__}.{cls.__name__} is not supported")
    for name in _BUF_INFO_METHODS:
        if getattr(getattr(pool, name, None), "_kv_canary_wrapped_by", None) is not None:
            raise RuntimeError(
                f"kv-canary on SGLang: {cls.__name__}.{name} is already wrapped by SGLang's own "
                "KV canary; run one canary per pool (start SGLang without --enable-kv-canary)"
            )
    if cls is MHATokenToKVPool:
        _check_mha(pool, cls.__name__)
    elif cls is SWAKVPool:
        for name in ("full_kv_pool", "swa_kv_pool"):
            _check_mha(getattr(pool, name), f"SWAKVPool.{name}")
        _mapping(pool)
    else:
        _check_dsv4(pool)


def _check_mha(sub: Any, what: str) -> None:
    if type(sub) is not MHATokenToKVPool:
        raise _refuse(f"{what} is a {type(sub).__name__}, not an MHATokenToKVPool")
    if getattr(sub, "kv_cache_layout", None) != "nhd" or getattr(sub, "use_hnd", False):
        raise _refuse(f"{what} uses the {sub.kv_cache_layout!r} layout, not 'nhd'")
    if getattr(sub, "is_quantized_kv_cache", False):
        raise _refuse(f"{what} is a quantized (FP4) KV cache")


def _check_dsv4(pool: Any) -> None:
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    bad = [
        what for what, is_bad in (
            ("unified KV", bool(getattr(pool, "_unified_kv", False))),
            ("the request window", getattr(pool, "request_window", None) is not None),
            ("a per-request SWA ring", getattr(pool, "swa_req_ring_size", None) is not None),
            ("uniform FP8 (trtllm)", bool(getattr(pool, "uniform_fp8", False))),
            (f"the {pool.kv_layout} layout", pool.kv_layout is not KVLayout.V4),
            ("ratio-1/2 layers", bool(set(pool.compression_ratios) - {0, 4, 128})),
            ("online C128 MTP draft banks", any(
                getattr(p, "online_mtp_max_draft_tokens", 0)
                for p in (*pool.compress_state_pools, *pool.indexer_compress_state_pools)
                if p is not None
            )),
        ) if is_bad
    ]  # fmt: skip
    if bad or pool.swa_kv_pool is None:
        raise _refuse(f"DeepSeekV4TokenToKVPool with {', '.join(bad) or 'no swa_kv_pool'}")
    for ratio, sub in pool.kv_pools.items():
        if sub is not None and type(sub) is not DeepSeekV4SingleKVPool:
            raise _refuse(f"DeepSeekV4TokenToKVPool C{ratio} sub-pool is a {type(sub).__name__}")
    for ratio, sub in pool.index_pools.items():
        if sub.index_k_with_scale_buffer is None or sub.use_fp4_indexer:
            raise _refuse(f"DeepSeekV4TokenToKVPool C{ratio} indexer uses the FP4 layout")
    _mapping(pool)


def _mapping(pool: Any) -> torch.Tensor:
    lut = getattr(pool, "full_to_swa_index_mapping", None)
    if lut is None:
        raise ValueError(
            f"kv-canary on SGLang: {type(pool).__name__}.full_to_swa_index_mapping is not "
            "registered yet; create SGLang's SWATokenToKVPoolAllocator on the pool first"
        )
    return lut


def _window(pool: Any, options: AttachOptions) -> int:
    window = options.window
    if window is None:  # DeepSeek-V4 pools know their window
        window = getattr(pool, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(
            f"kv-canary on SGLang: {type(pool).__name__} has sliding-window layers but the "
            f"sliding window is {window!r}; pass sliding_window=model_runner.sliding_window_size"
        )
    return window


# ------------------------------------------------------------------ MHA / SWA


def _attach_mha(pool: Any, options: AttachOptions) -> list[CanaryBufferGroup]:
    check_supported_pool(pool)
    if not pool.k_buffer:
        raise ValueError("kv-canary on SGLang: MHATokenToKVPool has no layers")
    return [attach_mha(pool, "MHATokenToKVPool", options)]


def _attach_swa(pool: Any, options: AttachOptions) -> list[CanaryBufferGroup]:
    check_supported_pool(pool)
    if not pool.swa_kv_pool.k_buffer:
        raise ValueError("kv-canary on SGLang: SWAKVPool.swa_kv_pool has no layers")
    lut, window = _mapping(pool), _window(pool, options)
    # SGLang's sliding layers see keys q - W .. q (W + 1 of them): position prefix_len - W
    # is read, and must be resident.
    return list(attach_swa(pool, lut, window, options, reads_window_start=True))


# ------------------------------------------------------------------ DeepSeek-V4


def _paged_sources(buffers: list[torch.Tensor], rows_per_page: int, bytes_per_token: int,
                   options: AttachOptions, what: str) -> tuple[RealKvSource, ...]:  # fmt: skip
    """Sources over page-row buffers ``[pages, page_bytes]`` whose first
    ``rows_per_page * bytes_per_token`` bytes are the tokens' data, token-major."""
    mode = options.real_kv_mode
    if mode == RealKvHashMode.NONE or not buffers:
        return ()
    chosen = buffers[:1] if options.real_data_layers == "first" else buffers
    # real_kv_sources enforces the layer count and contiguity; reuse its checks
    real_kv_sources([b.view(b.shape[0], -1) for b in chosen], RealKvHashMode.ALL,
                    options.real_data_layers, what)  # fmt: skip
    read = resolve_read_bytes(mode, bytes_per_token)
    return tuple(
        RealKvSource(b.view(torch.uint8).view(b.shape[0], -1), rows_per_page, bytes_per_token, read)
        for b in chosen
    )


def _dsv4_group(kind: PoolKind, name: str, buffers: list[torch.Tensor], rows_per_page: int,
                bytes_per_token: int, options: AttachOptions,
                **extra: object) -> CanaryBufferGroup:  # fmt: skip
    return allocate_group(
        kind, sub_pool=name, num_slots=int(buffers[0].shape[0]) * rows_per_page,
        page_size=rows_per_page, device=buffers[0].device, with_v=False,
        real_kv_sources_k=_paged_sources(buffers, rows_per_page, bytes_per_token, options,
                                         f"DeepSeekV4TokenToKVPool.{name}"),
        kv_token_id_vs_position_offset=options.kv_token_id_vs_position_offset, **extra,
    )  # fmt: skip


def _attach_dsv4(pool: Any, options: AttachOptions) -> list[CanaryBufferGroup]:
    check_supported_pool(pool)
    lut, window = _mapping(pool), _window(pool, options)
    swa = pool.swa_kv_pool
    data = swa.qk_nope_head_dim + swa.qk_rope_head_dim * swa.rope_storage_dtype.itemsize
    if data != DSV4_DATA_BYTES_PER_TOKEN:
        raise _refuse(f"DeepSeek-V4 latent of {data} data bytes per token (V4: 576)")
    swa_group = _dsv4_group(PoolKind.SWA, "swa_kv_pool", list(swa.kv_buffer), swa.page_size,
                            data, options, swa_index_lut=lut, window=window)  # fmt: skip
    groups, contiguous = [swa_group], []
    full_slots = torch.arange(lut.shape[0], device=lut.device)
    # SGLang's contiguous buf-infos: per ratio (dict order), its KV layers, then its indexer's
    for ratio, kv_pool in pool.kv_pools.items():
        parts: list[tuple[PoolKind, str, list[torch.Tensor], int, int]] = []
        if kv_pool is not None:
            parts.append((PoolKind.C4 if ratio == 4 else PoolKind.C128, f"c{ratio}_kv_pool",
                          list(kv_pool.kv_buffer), kv_pool.page_size, data))  # fmt: skip
        indexer = pool.index_pools.get(ratio)
        if indexer is not None:
            parts.append((PoolKind.INDEXER, f"c{ratio}_indexer_kv_pool",
                          list(indexer.index_k_with_scale_buffer), indexer.page_size,
                          indexer.index_head_dim))  # fmt: skip
        for kind, name, bufs, rows_per_page, nbytes in parts:
            if not bufs:  # no layer of this ratio: nothing to protect, nothing to splice
                continue
            group = _dsv4_group(kind, name, bufs, rows_per_page, nbytes, options,
                                swa_index_lut=full_slots // ratio,
                                compression_ratio=ratio)  # fmt: skip
            groups.append(group)
            contiguous.append(Segment(len(bufs), group.k_head, group.k_tail, group.page_size))
    state = [Segment(len(swa.kv_buffer), swa_group.k_head, swa_group.k_tail, swa_group.page_size)]
    request_state: list[Segment] = []
    for kind, name, pools, segments in (
        (PoolKind.C4_STATE, "compress_state_pools", _state_pools(pool.compress_state_pools, 4),
         state),
        (PoolKind.INDEXER_STATE, "indexer_compress_state_pools",
         _state_pools(pool.indexer_compress_state_pools, 4), state),
        (PoolKind.C128_STATE, "compress_state_pools",
         _state_pools(pool.compress_state_pools, 128), request_state),
    ):  # fmt: skip
        if not pools:
            continue
        group = _state_group(kind, name, pools, lut, options)
        groups.append(group)
        segments.append(Segment(len(pools), group.k_head, group.k_tail, group.page_size))
    patch_buf_infos(pool, "get_contiguous_buf_infos", contiguous)
    # SGLang's state buf-infos: SWA layers, then page-scoped attention rings (the C4 layers:
    # C128 is request-scoped), then the indexer rings; request-state: the C128 rings.
    patch_buf_infos(pool, "get_state_buf_infos", state)
    if request_state:
        patch_buf_infos(pool, "get_request_state_buf_infos", request_state)
    return groups


def _state_pools(pools: list[Any], ratio: int) -> list[Any]:
    """The compress-state pools of the ``ratio`` layers, in layer order."""
    return [p for p in pools if p is not None and p.ratio == ratio]


def _state_group(kind: PoolKind, name: str, pools: list[Any], lut: torch.Tensor,
                 options: AttachOptions) -> CanaryBufferGroup:  # fmt: skip
    first = pools[0]
    if first.request_scoped:
        ring = StateRing(first.ratio, first.ring_size, "request")
    else:
        ring = StateRing(first.ratio, first.ring_size, "swa_page", overlap=first.ratio == 4,
                         swa_page_size=int(first.swa_page_size))  # fmt: skip
    tensors = [p.kv_score_buffer.kv_score for p in pools]
    what = f"DeepSeekV4TokenToKVPool.{name}[C{first.ratio}]"
    return allocate_group(
        kind, sub_pool=name, num_slots=int(tensors[0].shape[0]), page_size=first.ring_size,
        device=tensors[0].device, with_v=False,
        real_kv_sources_k=real_kv_sources(tensors, options.real_kv_mode,
                                          options.real_data_layers, what),
        swa_index_lut=None if first.request_scoped else lut, state_ring=ring,
        kv_token_id_vs_position_offset=options.kv_token_id_vs_position_offset,
    )  # fmt: skip


register_pool_attacher(MHATokenToKVPool, _attach_mha)
register_pool_attacher(SWAKVPool, _attach_swa)
register_pool_attacher(DeepSeekV4TokenToKVPool, _attach_dsv4)
