"""What the canary must report for each injected fault (the perturbation table).

    mode                  pools      expected tag (first report)  fail reason (any of)
    req_to_token          MHA, SWA   HEAD_K_FULL                  verify_chain_hash
    real_kv_used          MHA, SWA   TAIL_K_<group>               verify_real_kv_hash
    real_kv_unused_cache  MHA, SWA   SWEEP_K_<group>              verify_real_kv_hash
    real_kv_post_forward  MHA, SWA   TAIL_K_<group>               verify_real_kv_hash
    next_token_swap       MHA, SWA   HEAD_K_FULL                  write_token
    swa_mapping           SWA        HEAD_K_SWA                   verify_position, verify_chain_hash
    stale_reuse           MHA, SWA   HEAD_K_FULL                  verify_position, verify_chain_hash
    page_shift            MHA, SWA   HEAD_K_FULL                  verify_position
    premature_window_eviction SWA    HEAD_K_SWA                   verify_not_resident
    lost_kv_store         MHA, SWA   TAIL_K_<group>               write_kv_store
    draft_position_shift  draft      HEAD_K_FULL pool=draft       write_position, verify_position
    draft_chunk_rotation  draft      HEAD_K_FULL pool=draft       verify_token
    rejected_kv_kept      spec       HEAD_K_FULL                  verify_token
    rollback_frees_cached spec, MHA  SWEEP_K_FULL, HEAD_K_FULL    verify_position, verify_chain_hash
    draft_page_leak       draft      HEAD_K_FULL                  verify_position, verify_chain_hash

``<group>`` is the target group (FULL, SWA, or a DeepSeek-V4 group: C4, C128, INDEXER,
C4_STATE, C128_STATE, INDEXER_STATE; ``real_kv_unused_cache`` and ``lost_kv_store`` only FULL
or SWA). The modes expected under HEAD_K_FULL apply only to pools with a FULL group (a
DeepSeek-V4 pool has none: its metadata faults are ``swa_mapping`` and
``premature_window_eviction``, the byte flips one class per group). What each mode needs besides the canary:
real-KV fingerprints (``--kv-canary-real-data partial|all``) for the byte flips, a radix
sweep and a prefix cache for ``real_kv_unused_cache``, the token oracle for
``next_token_swap``, an SWA pool for ``swa_mapping`` and ``premature_window_eviction``. The speculative modes
need speculative decoding (``spec``: ngram or a draft model; ``draft``: a draft model, whose
own canary reports the first two, lines ending `` pool=draft``), the token check
(``--kv-canary-verify-tokens``) for the ``verify_token`` ones, and a prefix cache, the radix
sweep and a pool without SWA layers for ``rollback_frees_cached`` (a prefix hit may read the
overwritten page first: HEAD_K_FULL).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import NamedTuple

from kvcanary.canary.perturb.config import (
    BYTE_FLIP_MODES,
    FULL_GROUP_MODES,
    PER_POSITION_BYTE_MODES,
    TARGET_GROUPS,
    PerturbMode,
)


class ExpectedDetection(NamedTuple):
    tags: tuple[str, ...]  # fnmatch patterns of the launch tag
    reasons: tuple[str, ...]  # a matching row carries at least one of them

    def matches(self, launch_tag: str, fail_reasons: tuple[str, ...] | list[str]) -> bool:
        return any(fnmatchcase(launch_tag, p) for p in self.tags) and any(
            r in self.reasons for r in fail_reasons
        )


_POSITION_OR_CHAIN = ("verify_position", "verify_chain_hash")
_TABLE: dict[PerturbMode, ExpectedDetection] = {
    PerturbMode.REQ_TO_TOKEN: ExpectedDetection(("HEAD_K_FULL",), ("verify_chain_hash",)),
    PerturbMode.REAL_KV_USED: ExpectedDetection(("TAIL_K_{G}",), ("verify_real_kv_hash",)),
    PerturbMode.REAL_KV_UNUSED_CACHE: ExpectedDetection(("SWEEP_K_{G}",), ("verify_real_kv_hash",)),
    PerturbMode.REAL_KV_POST_FORWARD: ExpectedDetection(("TAIL_K_{G}",), ("verify_real_kv_hash",)),
    PerturbMode.NEXT_TOKEN_SWAP: ExpectedDetection(("HEAD_K_FULL",), ("write_token",)),
    PerturbMode.SWA_MAPPING: ExpectedDetection(("HEAD_K_SWA",), _POSITION_OR_CHAIN),
    PerturbMode.STALE_REUSE: ExpectedDetection(("HEAD_K_FULL",), _POSITION_OR_CHAIN),
    PerturbMode.PAGE_SHIFT: ExpectedDetection(("HEAD_K_FULL",), ("verify_position",)),
    PerturbMode.PREMATURE_WINDOW_EVICTION: ExpectedDetection(("HEAD_K_SWA",), ("verify_not_resident",)),
    PerturbMode.LOST_KV_STORE: ExpectedDetection(("TAIL_K_{G}",), ("write_kv_store",)),
    # The draft's own write check sees the chain break at once (its seed holds position p - 1).
    PerturbMode.DRAFT_POSITION_SHIFT: ExpectedDetection(("HEAD_K_FULL",), ("write_position", "verify_position")),
    PerturbMode.DRAFT_CHUNK_ROTATION: ExpectedDetection(("HEAD_K_FULL",), ("verify_token",)),
    PerturbMode.REJECTED_KV_KEPT: ExpectedDetection(("HEAD_K_FULL",), ("verify_token",)),
    PerturbMode.ROLLBACK_FREES_CACHED: ExpectedDetection(("SWEEP_K_FULL", "HEAD_K_FULL"), _POSITION_OR_CHAIN),
    PerturbMode.DRAFT_PAGE_LEAK: ExpectedDetection(("HEAD_K_FULL",), _POSITION_OR_CHAIN),
}


def expected_detection(mode: str, target_group: str | None = None) -> ExpectedDetection:
    """The expected report of ``mode``; byte-flip modes need ``target_group`` (a group kind,
    lower case; ``full`` or ``swa`` for the modes only per-position groups serve)."""
    mode = PerturbMode(mode)
    exp = _TABLE[mode]
    if mode in BYTE_FLIP_MODES:
        allowed = ("full", "swa") if mode in PER_POSITION_BYTE_MODES else TARGET_GROUPS
        if target_group not in allowed:
            raise ValueError(f"{mode.value}: target_group={target_group!r}; allowed one of "
                             f"{', '.join(allowed)}")  # fmt: skip
        exp = exp._replace(tags=tuple(t.format(G=target_group.upper()) for t in exp.tags))
    return exp


def applies_to(mode: str, has_swa_group: bool, has_full_group: bool = True) -> bool:
    """Whether ``mode`` is meaningful on a pool: the SWA-mapping faults need an SWA group, the
    modes expected under HEAD_K_FULL a FULL group, ``rollback_frees_cached`` a pool without
    an SWA group (the target's pool; the draft-pool modes are judged on the target's too:
    they need its FULL group only through the draft's, which has one on every model but
    DeepSeek-V4's, which speculative decoding refuses)."""
    m = PerturbMode(mode)
    swa_only = (PerturbMode.SWA_MAPPING, PerturbMode.PREMATURE_WINDOW_EVICTION)
    if m == PerturbMode.ROLLBACK_FREES_CACHED and has_swa_group:  # no SWA part to hand over
        return False
    return (m not in swa_only or has_swa_group) and (m not in FULL_GROUP_MODES or has_full_group)
