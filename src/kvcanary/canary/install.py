"""install_canary: attach the canary to a model runner (see docs/CANARY_PROTOCOL.md).

What the runner must offer (duck-typed)::

    runner.token_to_kv_pool     a pool type with a registered attacher (MHA, SWA, DSV4)
    runner.req_to_token_pool    .req_to_token int [rows, max_context_len], row 0 = padding
                                (+ .token_ids / .token_lens for --kv-canary-verify-tokens)
    runner.model.forward(...)   takes the forward batch as ``forward_batch=`` or positionally
    runner.device               where the pool lives
    runner.sliding_window       int | None (SWA / DSV4 pools need it)
    runner.is_draft_worker      optional; True: slot p holds the KV of token p + 1
    runner.canary               set here; the runner's forward wraps itself in
                                ``runner.canary.forward_scope(fb)`` when it is not None

Mode ``none`` installs nothing and returns None: no buffers, no patch, no cost.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from kvcanary.canary.adapters import AttachOptions, attach_canary_buffers
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.manager import CanaryManager

logger = logging.getLogger("kvcanary.canary")


def install_canary(
    runner: Any, config: CanaryConfig, *, num_single_forward_managers: int = 1
) -> CanaryManager | None:
    """Attach buffers to the runner's pool, patch its model's forward, set ``runner.canary``."""
    if not config.enabled:
        return None
    _check_runner(runner, config)
    is_draft = bool(getattr(runner, "is_draft_worker", False))
    options = AttachOptions(
        real_kv_mode=config.real_kv_hash_mode,
        real_data_layers=config.real_data_layers,
        window=getattr(runner, "sliding_window", None),
        kv_token_id_vs_position_offset=1 if is_draft else 0,
    )
    groups = attach_canary_buffers(runner.token_to_kv_pool, options)
    manager = CanaryManager(
        config, groups, runner.req_to_token_pool, device=torch.device(runner.device),
        num_single_forward_managers=num_single_forward_managers,
    )  # fmt: skip
    patch_model_forward(runner.model, manager)
    manager.attach_store_check(runner.token_to_kv_pool)
    runner.canary = manager
    logger.info(
        "install_canary: pool=%s config=%s n_buffer_groups=%d buffer_group_kinds=%s "
        "swa_window_size=%s kv_token_id_vs_position_offset=%d verify_capacities=%s "
        "canary_bytes=%d",
        type(runner.token_to_kv_pool).__name__, config, len(groups),
        [g.kind.name for g in groups], options.window, options.kv_token_id_vs_position_offset,
        manager.runtime.verify_capacities, sum(g.nbytes for g in groups),
    )  # fmt: skip
    return manager


def _check_runner(runner: Any, config: CanaryConfig) -> None:
    missing = [
        name for name in ("model", "token_to_kv_pool", "req_to_token_pool", "device")
        if getattr(runner, name, None) is None
    ]  # fmt: skip
    if missing:
        raise ValueError(f"kv-canary: the runner lacks {missing}; cannot install")
    if getattr(runner, "canary", None) is not None:
        raise RuntimeError("kv-canary: a canary is already installed on this runner")
    if not callable(getattr(runner.model, "forward", None)):
        raise ValueError("kv-canary: runner.model has no forward method to patch")
    r2t = getattr(runner.req_to_token_pool, "req_to_token", None)
    if not isinstance(r2t, torch.Tensor) or r2t.dim() != 2:
        raise ValueError(
            "kv-canary: runner.req_to_token_pool.req_to_token must be a 2-D tensor "
            "[rows, max_context_len] (row 0 = padding)"
        )
    if config.verify_tokens and not all(
        isinstance(getattr(runner.req_to_token_pool, a, None), torch.Tensor)
        for a in ("token_ids", "token_lens")
    ):
        raise NotImplementedError(
            "--kv-canary-verify-tokens: req_to_token_pool must offer token_ids "
            "(int64 [rows, max_context_len]) and token_lens (int64 [rows]) mirroring each "
            "running request's prompt + output ids"
        )
    device = torch.device(runner.device)
    if config.backend == "numba" and device.type != "cpu":
        raise ValueError(
            f"KVCANARY_KV_CANARY_KERNEL_BACKEND=numba runs on the CPU only; the pool is on "
            f"{device} (use auto or torch)"
        )


def find_forward_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward batch of a ``model.forward`` call: ``forward_batch=`` or the first
    positional argument that looks like one (has ``out_cache_loc``)."""
    fb = kwargs.get("forward_batch")
    if fb is not None:
        return fb
    for arg in args:
        if hasattr(arg, "out_cache_loc") and hasattr(arg, "req_pool_indices"):
            return arg
    raise RuntimeError(
        "kv-canary: model.forward was called without a forward batch (pass it as "
        "forward_batch= or positionally)"
    )


def patch_model_forward(model: Any, manager: CanaryManager) -> None:
    """Replace ``model.forward`` (on the instance) so the outermost call runs the canary's
    HEAD ops before and TAIL ops after the original forward."""
    original = model.forward
    if getattr(original, "__kv_canary_patched__", False):
        raise RuntimeError("kv-canary: model.forward is already patched")

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with manager.model_forward_bracket_scope() as outermost:
            if not outermost:
                return original(*args, **kwargs)
            fb = find_forward_batch(args, kwargs)
            plans = manager.pre_ops_maybe_inside_graph(fb)
            out = original(*args, **kwargs)
            manager.post_ops_maybe_inside_graph(fb, plans)
            return out

    forward.__kv_canary_patched__ = True  # type: ignore[attr-defined]
    model.forward = forward
