"""PerturbConfig: which faults to inject, how often, where (frozen, validated).

Each mode has its own probability per hook call (SGLang's five, then kvcanary's own)::

    mode                  hook           what it corrupts
    req_to_token          pre-forward    one committed req->token entry -> another live slot
    real_kv_used          pre-forward    byte 0 of a running request's slot in a K real-KV source
    real_kv_unused_cache  pre-forward    the same, on a cached slot no request holds (sweep steps)
    real_kv_post_forward  post-forward   the same, on a slot this forward just wrote
    next_token_swap       end of step    two requests' freshly sampled tokens (oracle sampler)
    swa_mapping           pre-forward    a live in-window full slot's mapping -> another SWA slot
    stale_reuse           pre-forward    a request's new token lands in another's live slot
    page_shift            pre-forward    one request's page table shifted by one page
    premature_window_eviction pre-forward  the SWA mapping of an in-window page zeroed (as if
                                         free_swa ran a few pages too early)
    lost_kv_store         in the forward the K/V store of one token this forward writes is
                                         undone right after attention made it

Speculative decoding (the host's ``spec_fault_site``; the first two on the draft model's
canary, whose lines end with `` pool=draft``, the others on the target's)::

    draft_position_shift  pre-forward    one row of a draft decode forward at position + 1
                                         (its KV written one position off, SGLang #25015)
    draft_chunk_rotation  pre-forward    the last input id of a non-final chunk of the
                                         draft's catch-up prefill -> the next position's
                                         token (inputs rotated at a chunk boundary, #26329)
    rejected_kv_kept      pre-forward    the bonus token after a verify that rejected a
                                         draft written to a free slot; the request's entry
                                         keeps the slot holding the rejected draft's KV
    rollback_frees_cached pre-forward    a fresh page of this forward's writes -> a page an
                                         unlocked prefix-cache node holds (a rollback freed
                                         it, the allocator handed it out); sweep steps only
    draft_page_leak       pre-forward    one committed req->token entry -> a slot the draft
                                         model's allocator holds (a page taken from it)

A hook fires when its probability is > 0, the forward step is >= ``warmup_steps``, fewer than
``max_injections`` (0 = no limit) of that mode happened, and the seeded RNG draws below the
probability: the same seed and workload inject the same faults. ``target_group`` picks the
group of the byte-flip modes (any group kind, lower case: ``full``, ``swa``, and on a
DeepSeek-V4 pool ``c4``, ``c128``, ``indexer``, ``c4_state``, ``c128_state``,
``indexer_state``) and is required when the pool has more than one. On a compressed group
the byte lands in a complete compressed entry; on a compress-state ring, in a live tail row
(one the next read of the ring uses). ``real_kv_unused_cache`` and ``lost_kv_store`` need a
per-position group (full, swa): the radix sweep and the store check cover only those.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from kvcanary.canary.wire.constants import PoolKind


class PerturbMode(StrEnum):
    REQ_TO_TOKEN = "req_to_token"
    REAL_KV_USED = "real_kv_used"
    REAL_KV_UNUSED_CACHE = "real_kv_unused_cache"
    REAL_KV_POST_FORWARD = "real_kv_post_forward"
    NEXT_TOKEN_SWAP = "next_token_swap"
    SWA_MAPPING = "swa_mapping"
    STALE_REUSE = "stale_reuse"
    PAGE_SHIFT = "page_shift"
    PREMATURE_WINDOW_EVICTION = "premature_window_eviction"
    LOST_KV_STORE = "lost_kv_store"
    DRAFT_POSITION_SHIFT = "draft_position_shift"
    DRAFT_CHUNK_ROTATION = "draft_chunk_rotation"
    REJECTED_KV_KEPT = "rejected_kv_kept"
    ROLLBACK_FREES_CACHED = "rollback_frees_cached"
    DRAFT_PAGE_LEAK = "draft_page_leak"


PERTURB_MODES: tuple[str, ...] = tuple(m.value for m in PerturbMode)
TARGET_GROUPS: tuple[str, ...] = tuple(k.name.lower() for k in PoolKind)
# Modes that corrupt the real KV bytes of one buffer group (they need target_group on SWA pools).
BYTE_FLIP_MODES = frozenset({
    PerturbMode.REAL_KV_USED, PerturbMode.REAL_KV_UNUSED_CACHE, PerturbMode.REAL_KV_POST_FORWARD,
    PerturbMode.LOST_KV_STORE,
})  # fmt: skip
# Byte-flip modes only a per-position group (full, swa) serves: the radix sweep reads cached
# slots of those groups, the store check watches their layer buffers.
PER_POSITION_BYTE_MODES = frozenset({PerturbMode.REAL_KV_UNUSED_CACHE, PerturbMode.LOST_KV_STORE})
# Modes whose report is expected under the FULL group's tag (pools without one: not applicable).
FULL_GROUP_MODES = frozenset({
    PerturbMode.REQ_TO_TOKEN, PerturbMode.NEXT_TOKEN_SWAP, PerturbMode.STALE_REUSE,
    PerturbMode.PAGE_SHIFT, PerturbMode.DRAFT_POSITION_SHIFT, PerturbMode.DRAFT_CHUNK_ROTATION,
    PerturbMode.REJECTED_KV_KEPT, PerturbMode.ROLLBACK_FREES_CACHED, PerturbMode.DRAFT_PAGE_LEAK,
})  # fmt: skip
# Speculative decoding's modes: they need the host's spec_fault_site (speculation on) ...
SPEC_MODES = frozenset({
    PerturbMode.DRAFT_POSITION_SHIFT, PerturbMode.DRAFT_CHUNK_ROTATION,
    PerturbMode.REJECTED_KV_KEPT, PerturbMode.ROLLBACK_FREES_CACHED, PerturbMode.DRAFT_PAGE_LEAK,
})  # fmt: skip
# ... and these corrupt the draft model's KV: their perturber attaches to the draft's canary.
DRAFT_POOL_MODES = frozenset({PerturbMode.DRAFT_POSITION_SHIFT, PerturbMode.DRAFT_CHUNK_ROTATION})


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"PerturbConfig.{name}={value!r} is invalid: allowed {allowed}")


@dataclass(frozen=True, kw_only=True)
class PerturbConfig:
    req_to_token_prob: float = 0.0
    real_kv_used_prob: float = 0.0
    real_kv_unused_cache_prob: float = 0.0
    real_kv_post_forward_prob: float = 0.0
    next_token_swap_prob: float = 0.0
    swa_mapping_prob: float = 0.0
    stale_reuse_prob: float = 0.0
    page_shift_prob: float = 0.0
    premature_window_eviction_prob: float = 0.0
    lost_kv_store_prob: float = 0.0
    draft_position_shift_prob: float = 0.0
    draft_chunk_rotation_prob: float = 0.0
    rejected_kv_kept_prob: float = 0.0
    rollback_frees_cached_prob: float = 0.0
    draft_page_leak_prob: float = 0.0
    target_group: str | None = None  # a group kind, lower case (byte-flip modes)
    warmup_steps: int = 50  # forward steps before any injection (SGLang's default)
    seed: int = 0
    max_injections: int = 0  # per mode; 0 = no limit

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.endswith("_prob"):
                v = getattr(self, f.name)
                _check(isinstance(v, int | float) and 0.0 <= v <= 1.0, f.name, v, "a number in [0, 1]")
        _check(self.target_group in (None, *TARGET_GROUPS), "target_group", self.target_group,
               f"None or one of {TARGET_GROUPS}")  # fmt: skip
        for name in ("warmup_steps", "max_injections"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 0, name, v, "an integer >= 0")
        _check(isinstance(self.seed, int), "seed", self.seed, "an integer")

    @classmethod
    def single(cls, mode: str, prob: float = 1.0, **kwargs: Any) -> PerturbConfig:
        """One mode at ``prob``: ``PerturbConfig.single("page_shift", warmup_steps=4)``."""
        _check(mode in PERTURB_MODES, "mode", mode, f"one of {PERTURB_MODES}")
        kwargs[f"{mode}_prob"] = prob
        return cls(**kwargs)

    def prob(self, mode: PerturbMode) -> float:
        return float(getattr(self, f"{mode.value}_prob"))

    @property
    def active_modes(self) -> list[PerturbMode]:
        return [m for m in PerturbMode if self.prob(m) > 0]
