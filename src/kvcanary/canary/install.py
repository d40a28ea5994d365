"""install_canary: attach the canary to a host (see :mod:`.host` and docs/CANARY_PROTOCOL.md).

What the host must offer (:class:`~kvcanary.canary.host.CanaryHost`)::

    host.token_to_kv_pool     a pool type with a registered attacher (MHA, SWA, DSV4)
    host.req_to_token_pool    .req_to_token int [rows, max_context_len], row 0 = padding
                              (+ .token_ids / .token_lens for --kv-canary-verify-tokens)
    host.device               where the pool lives
    host.sliding_window       int | None (SWA / DSV4 pools need it)
    host.is_draft_worker      True: slot p holds the KV of token p + 1

Installing attaches the record buffers to the pool (buf-infos spliced, host-copy sidecars
registered), builds the :class:`~kvcanary.canary.manager.CanaryManager` and attaches the
store check (``set_kv_buffer`` of the sub-pools that own fingerprinted buffers). It touches
nothing else of the host: the host keeps the manager and calls ``before_forward(batch)`` /
``after_forward(batch)`` around each forward and ``end_step()`` between steps.

Mode ``none`` installs nothing and returns None: no buffers, no patch, no cost.
"""

from __future__ import annotations

import logging

import torch

from kvcanary.canary.attach.registry import AttachOptions, attach_canary_buffers
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.host import CanaryHost, TokenMirror
from kvcanary.canary.manager import CanaryManager

logger = logging.getLogger("kvcanary.canary")

_BUF_INFO_METHODS = ("get_contiguous_buf_infos", "get_state_buf_infos")


def install_canary(
    host: CanaryHost, config: CanaryConfig, *, num_single_forward_managers: int = 1
) -> CanaryManager | None:
    """Attach record buffers to the host's pool and return the canary (None for mode
    ``none``). ``num_single_forward_managers``: forwards per step (speculative drafts)."""
    if not config.enabled:
        return None
    _check_host(host, config)
    pool = host.token_to_kv_pool
    options = AttachOptions(
        real_kv_mode=config.real_kv_hash_mode,
        real_data_layers=config.real_data_layers,
        window=host.sliding_window,
        kv_token_id_vs_position_offset=1 if host.is_draft_worker else 0,
    )
    groups = attach_canary_buffers(pool, options)
    manager = CanaryManager(
        config, groups, host.req_to_token_pool, device=torch.device(host.device),
        num_single_forward_managers=num_single_forward_managers, pool=pool,
    )  # fmt: skip
    manager.attach_store_check(pool)
    logger.info(
        "install_canary: pool=%s config=%s n_buffer_groups=%d buffer_group_kinds=%s "
        "swa_window_size=%s kv_token_id_vs_position_offset=%d verify_capacities=%s "
        "canary_bytes=%d",
        type(pool).__name__, config, len(groups),
        [g.kind.name for g in groups], options.window, options.kv_token_id_vs_position_offset,
        manager.runtime.verify_capacities, sum(g.nbytes for g in groups),
    )  # fmt: skip
    return manager


def is_installed(pool: object) -> bool:
    """True when a canary's records are already spliced into ``pool``'s buf-infos."""
    return any(
        getattr(getattr(pool, name, None), "__kv_canary_spliced__", False)
        for name in _BUF_INFO_METHODS
    )


def _check_host(host: CanaryHost, config: CanaryConfig) -> None:
    missing = [
        name for name in ("token_to_kv_pool", "req_to_token_pool", "device")
        if getattr(host, name, None) is None
    ]  # fmt: skip
    if missing:
        raise ValueError(f"kv-canary: the host lacks {missing}; cannot install")
    if is_installed(host.token_to_kv_pool):
        raise RuntimeError("kv-canary: a canary is already installed on this host's pool")
    r2t = getattr(host.req_to_token_pool, "req_to_token", None)
    if not isinstance(r2t, torch.Tensor) or r2t.dim() != 2:
        raise ValueError(
            "kv-canary: host.req_to_token_pool.req_to_token must be a 2-D tensor "
            "[rows, max_context_len] (row 0 = padding)"
        )
    if config.verify_tokens and not (
        isinstance(host.req_to_token_pool, TokenMirror)
        and all(
            isinstance(getattr(host.req_to_token_pool, a), torch.Tensor)
            for a in ("token_ids", "token_lens")
        )
    ):
        raise NotImplementedError(
            "--kv-canary-verify-tokens: req_to_token_pool must offer token_ids "
            "(int64 [rows, max_context_len]) and token_lens (int64 [rows]) mirroring each "
            "running request's prompt + output ids"
        )
    device = torch.device(host.device)
    if config.backend == "numba" and device.type != "cpu":
        raise ValueError(
            f"KVCANARY_KV_CANARY_KERNEL_BACKEND=numba runs on the CPU only; the pool is on "
            f"{device} (use auto or torch)"
        )
