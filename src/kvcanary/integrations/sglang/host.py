"""SGLang as a canary host: :func:`install_on_sglang`.

What crosses the boundary (:mod:`kvcanary.canary.host` names the protocols)::

    SGLang side                                   canary side
    token_to_kv_pool (MHATokenToKVPool,    ───►   KVPool: our record groups attached by
      SWAKVPool, DeepSeekV4TokenToKVPool)         pool type (:mod:`.pools`), buf-infos spliced
    req_to_token_pool (ReqToTokenPool)     ───►   ReqToTokenTable (int32 [size+1, ctx], row 0
                                                  padding)
    model_runner.sliding_window_size       ───►   CanaryHost.sliding_window (SWA pools)
    ForwardBatch                           ───►   ForwardBatchView via SGLangForwardBatchView
    set_kv_buffer (MHA sub-pools)          ───►   the store check (real-data partial / all)

Per forward the host calls ``canary.before_forward(view)`` before attention metadata is
built and ``canary.after_forward(view)`` after the model wrote its KV, with ``view =
SGLangForwardBatchView(forward_batch)``; ``canary.end_step()`` between scheduler steps.

The store check: SGLang's ``MHATokenToKVPool.set_kv_buffer(layer, loc_info, k, v, k_scale,
v_scale, layer_id_override, ...)`` takes a layer object or an override, a ``KVWriteLoc`` or a
tensor, and scales / casts inside. So instead of folding the K/V it is handed, the canary's
wrapper lets SGLang store, then folds the bytes SGLang put at each ``loc`` (per
fingerprinted layer): a store that went to another slot, missed tokens of the forward or was
overwritten before the TAIL write is caught (``write_kv_store``); the store's own
quantisation is SGLang's business. DeepSeek-V4 stores (``set_*_key_buffer``,
``set_index_k_scale_buffer``) are not wrapped: TAIL fingerprints those sub-pools as they are.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.install import install_canary
from kvcanary.canary.kernels.store_check import StoreChecker
from kvcanary.canary.manager import CanaryManager
from kvcanary.canary.wire.constants import KvHalf
from kvcanary.integrations.sglang.pools import check_sglang_version, check_supported_pool


@dataclass(frozen=True)
class SGLangHost:
    """The :class:`~kvcanary.canary.host.CanaryHost` SGLang offers (what a ``ModelRunner``
    holds: ``token_to_kv_pool``, ``req_to_token_pool``, its device, its sliding window)."""

    token_to_kv_pool: Any
    req_to_token_pool: Any
    device: torch.device
    sliding_window: int | None = None
    is_draft_worker: bool = False


def install_on_sglang(
    pool: Any,
    req_to_token_pool: Any,
    config: CanaryConfig,
    *,
    sliding_window: int | None = None,
    device: torch.device | str | None = None,
    is_draft_worker: bool = False,
    init_finished: bool = True,
) -> CanaryManager | None:
    """Attach kvcanary's canary to SGLang's own ``pool`` (records, groups, kernels: ours)
    and return the manager (None for mode ``none``).

    ``sliding_window``: the model's window (``model_runner.sliding_window_size``); SWA pools
    need it, DeepSeek-V4 pools default to their own ``sliding_window``. ``device``: default
    the pool's. ``init_finished=False`` leaves the chain-position assert disarmed until the
    host calls ``mark_init_finished()`` (after warm-up / CUDA-graph capture).

    Raises (one line, naming what is supported) on another SGLang version or pool type.
    """
    check_sglang_version()
    check_supported_pool(pool)
    if not config.enabled:
        return None
    host = SGLangHost(
        pool, req_to_token_pool, torch.device(device if device is not None else pool.device),
        sliding_window, is_draft_worker,
    )  # fmt: skip
    canary = install_canary(host, config)
    if canary is None:
        return None
    checker = canary.runtime.store_checker
    if checker is not None:
        _route_stores(pool, checker)
    if init_finished:
        canary.mark_init_finished()
    return canary


def _mha_sub_pools(pool: Any) -> list[Any]:
    return [pool] + [getattr(pool, n) for n in ("full_kv_pool", "swa_kv_pool") if hasattr(pool, n)]


def _route_stores(pool: Any, checker: StoreChecker) -> None:
    """Replace the generic store wrapper :class:`StoreChecker` put on each SGLang MHA
    sub-pool by one that speaks SGLang's ``set_kv_buffer`` (module doc)."""
    from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

    for sub in _mha_sub_pools(pool):
        targets = checker.targets(sub)
        wrapper = getattr(sub, "set_kv_buffer", None)
        original = getattr(wrapper, "__wrapped__", None)
        if targets is None or original is None:
            continue
        signature = inspect.signature(original)

        def set_kv_buffer(*args: Any, _sub: Any = sub, _original: Any = original,
                          _targets: Any = targets, _sig: Any = signature,
                          **kwargs: Any) -> Any:  # fmt: skip
            out = _original(*args, **kwargs)
            bound = _sig.bind(*args, **kwargs).arguments
            layer_id = bound.get("layer_id_override")
            if layer_id is None:
                layer_id = bound["layer"].layer_id
            local = int(layer_id) - int(getattr(_sub, "start_layer", 0) or 0)
            loc = unwrap_write_loc(bound["loc_info"])[0]
            for watch, j, half in _targets.get(local, ()):
                buf = (_sub.k_buffer if half == KvHalf.K else _sub.v_buffer)[local]
                rows = buf[loc.long()]
                checker.observe(watch, j, loc, rows, rows.dtype)
            return out

        sub.set_kv_buffer = functools.wraps(original)(set_kv_buffer)
