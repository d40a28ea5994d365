"""The protocol between the prefill and the decode worker, and what both sides share.

Each worker is an :class:`~kvcanary.engine.engine.Engine` (model runner, pools, scheduler,
canary) with a different way in: the prefill worker runs prompts for one token, the decode
worker admits requests through :class:`~.prealloc.DecodePreallocQueue` instead of
prefilling them. Per request::

    decode                                          prefill
    hello {layout}                       <------->  hello {layout}    (same buf-info item
                                                                       lens, page, window)
    queue -> pop_preallocated(): row + KV
    prefill {rid, prompt_ids, params,    ------->   run the prompt (max_new_tokens = 1)
             prefix_len, kv_page_ids,               ... first token sampled; before its KV
             state_page_ids}                        is released:
                                         <-------   kv {rid} + payload   (pages through the
                                                                           buf-infos)
                                         <-------   first_token {rid, token, generator}
    scatter the payload into its pages
    first token -> running (decode goes on) or finished
                                         <-------   failed {rid, error}  (instead, on failure)
    shutdown                             ------->   (prefill stops)

Failure handling: a request whose transfer fails (``failed``, a payload that does not fit,
no KV within ``transfer_timeout_s``) finishes with ``finish_reason="error"`` and its
pre-allocated memory is freed; a dead link fails every request not yet landed and every
later submission the same way, while requests already decoding run to completion. A late
payload for a failed request is dropped, never scattered (its pages may be reused).

Both workers (:mod:`.prefill_worker`, :mod:`.decode_worker`) are driven by calling
``poll()`` in a loop (two processes, or alternately in one process over an
:class:`~.transfer.InProcessLink`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcanary.disagg.pages import PageIO, TransferPages, request_pages
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import Req
from kvcanary.memory.swa_allocator import SWAAllocator


class DisaggError(RuntimeError):
    """The two workers cannot work together (layout mismatch, a worker died)."""


@dataclass(frozen=True, slots=True)
class DisaggOutput:
    rid: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    error: str | None = None
    num_cached_prompt_tokens: int = 0  # decode-side prefix-cache hit
    num_retractions: int = 0  # decode-side retractions


def kv_layout(engine: Engine, io: PageIO) -> dict[str, Any]:
    """What must match on both sides for transferred pages (and canary records) to mean the
    same thing; the canary's mode may differ, what its records contain may not."""
    runner, cfg = engine.runner, engine.config
    return {
        "model": cfg.model,
        "page_size": cfg.page_size,
        "sliding_window": runner.sliding_window,
        "pool": type(runner.token_to_kv_pool).__name__,
        "kv_canary_records": None if not cfg.canary.enabled else
        [cfg.canary.real_data, cfg.canary.real_data_layers, cfg.canary.v_half],
        **io.layout(),
    }  # fmt: skip


def check_peer_layout(mine: dict[str, Any], theirs: dict[str, Any], role: str) -> None:
    diff = {k: (mine.get(k), theirs.get(k)) for k in mine.keys() | theirs.keys()
            if mine.get(k) != theirs.get(k)}  # fmt: skip
    if diff:
        raise DisaggError(
            f"{role}: the peer's KV layout differs (mine, peer's): {diff}; both sides need the "
            "same model, page size and canary settings (canary records travel in the buf-infos)"
        )


def _window_and_mapping(engine: Engine) -> tuple[int | None, torch.Tensor | None]:
    runner = engine.runner
    if not isinstance(runner.allocator, SWAAllocator):
        return None, None
    return runner.sliding_window, runner.allocator.full_to_swa_index_mapping


def engine_request_pages(engine: Engine, req: Req, prefix_len: int, fill_len: int) -> TransferPages:
    window, mapping = _window_and_mapping(engine)
    row = engine.runner.req_to_token_pool.req_to_token[req.req_pool_idx]
    return request_pages(row, mapping, prefix_len, fill_len, window, engine.config.page_size)


def memory_report(engine: Engine) -> dict[str, Any]:
    """Integrity, then whether every slot and row is free once the prefix cache lets go
    (call when no request is left)."""
    cache, runner = engine.kv.prefix_cache, engine.runner
    out: dict[str, Any] = {"integrity_ok": False, "integrity_error": None, "memory_free": False}
    try:
        engine.check_integrity()
        if cache is not None:
            cache.free_all()
        engine.check_integrity()
        out["integrity_ok"] = True
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out["integrity_error"] = f"{type(e).__name__}: {e}"
        return out
    alloc = runner.allocator
    if isinstance(alloc, SWAAllocator):
        free = {
            "full_free": alloc.full_available_size() == alloc.size_full,
            "swa_free": alloc.swa_available_size() == alloc.size_swa,
            "mapping_clear": int((alloc.full_to_swa_index_mapping[:-1] != 0).sum()) == 0,
        }
    else:
        free = {"full_free": alloc.available_size() == alloc.size}
    rows = runner.req_to_token_pool
    free["rows_free"] = rows.available_size() == rows.size
    out.update(free)
    out["memory_free"] = all(free.values()) and not engine.has_unfinished()
    return out


def canary_report(engine: Engine, draft: bool = False) -> dict[str, Any] | None:
    """The stats and violation rows of ``engine``'s canary (``draft``: of its speculative
    draft model's canary); None without one."""
    canary = engine.draft_canary if draft else engine.canary
    if canary is None:
        return None
    return {
        "stats": canary.stats(),
        "violations": [row._asdict() for row in canary.violations],
    }
