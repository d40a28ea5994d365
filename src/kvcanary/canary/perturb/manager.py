"""Perturber: the fault injector attached to a canary (``canary.perturber``).

The canary manager calls it at the host's three calls, outside the forward::

    pre_forward(fb)    in before_forward, before HEAD (and before the host's attention reads
                       its slot tables): req_to_token, real_kv_used, real_kv_unused_cache
                       (sweep steps only), swa_mapping, stale_reuse, page_shift,
                       premature_window_eviction, lost_kv_store; the speculative modes
                       (draft_position_shift, draft_chunk_rotation, rejected_kv_kept,
                       rollback_frees_cached on sweep steps, draft_page_leak)
    post_forward(fb)   in after_forward, after TAIL: undo the transient metadata faults;
                       real_kv_post_forward
    end_step()         in end_step, after the step's sampling: the host's repair of a
                       rollback_frees_cached (after the radix sweep read the page);
                       next_token_swap

It needs nothing of the host beyond the canary (its groups, req->token table and pool),
except ``next_token_swap``: the host's running requests and a way to replace a sampled
token, and the speculative modes: the host's :class:`SpecFaultHost` (see
:func:`install_perturbation`).

Each call of a hook draws from one seeded RNG in a fixed order, so a campaign replays
exactly. Every injection is kept in ``injections`` (mode, the first forward step that can
see it, target) for the self-test's detection matrix.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.perturb import faults
from kvcanary.canary.perturb.config import (
    BYTE_FLIP_MODES,
    DRAFT_POOL_MODES,
    PER_POSITION_BYTE_MODES,
    SPEC_MODES,
    PerturbConfig,
    PerturbMode,
)
from kvcanary.canary.perturb.faults import Injection
from kvcanary.canary.perturb.slots import (
    complete_blocks,
    live_ring_rows,
    prefix_entries,
    unlocked_cached_slots,
    write_entries,
)
from kvcanary.canary.wire.constants import KvHalf, LaunchStage, PoolKind, RealKvHashMode, launch_tag

logger = logging.getLogger("kvcanary.canary")


class RunningRequestView(Protocol):
    """A host's snapshot of one running request (our engine: ``RunningRequest``)."""

    @property
    def rid(self) -> int: ...

    @property
    def req_pool_idx(self) -> int: ...  # its req->token row (0: none)

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def kv_len(self) -> int: ...  # positions [0, kv_len) have K/V in the cache


class SpecFaultHost(Protocol):
    """What the speculative-decoding modes need of a host running speculative decoding
    (ours: ``Engine.spec_fault_site``, :class:`kvcanary.engine.spec_faults.SpecFaultSite`)."""

    @property
    def has_draft_pool(self) -> bool: ...  # a draft model with its own pools proposes

    def rejected_drafts(self) -> Sequence[tuple[int, int]]:
        """(req_pool_idx, position) per request whose last verify rejected a draft and
        kept the bonus position's slot (it holds the first rejected draft's KV)."""
        ...

    def free_slot(self) -> int: ...  # a slot of a free page of the target's full pool (0: none)

    def draft_slots(self) -> Sequence[int]: ...  # slots the draft's allocator holds

    def give_cached_page(
        self, row: int, position: int, choose: Callable[[list[int]], int]
    ) -> tuple[dict[int, int], Callable[[], None]] | None:
        """Hand an unlocked cached page (``choose`` picks among page numbers) to ``row``
        as its fresh page at ``position``: ``{old slot: new slot}`` and a repair."""
        ...


RunningRequests = Callable[[], Sequence[RunningRequestView]]
OverrideNextToken = Callable[[int, int], None]  # (rid, token): replace the last sampled token


class Perturber:
    def __init__(
        self,
        config: PerturbConfig,
        canary: Any,
        *,
        running_requests: RunningRequests | None = None,
        override_next_token: OverrideNextToken | None = None,
        pool: Any = None,
        spec: SpecFaultHost | None = None,
    ):
        """``canary``: the CanaryManager; ``running_requests`` / ``override_next_token``:
        the host's running requests and its sampled-token override (``next_token_swap``
        only); ``pool``: the host's KV pool, whose stores ``lost_kv_store`` breaks;
        ``spec``: the host's speculative-decoding side (the speculative modes)."""
        self.config = config
        self.pool = pool
        self.spec = spec
        self._pending_repair: list[Callable[[], None]] = []
        self.canary = canary
        self.running_requests = running_requests
        self.override_next_token = override_next_token
        self.rng = random.Random(config.seed)
        self.groups: dict[PoolKind, CanaryBufferGroup] = {g.kind: g for g in canary.groups}
        self.target = self._resolve_target()
        self._check_requirements()
        self.req_to_token = canary.runtime.req_to_token_pool.req_to_token
        self.injections: list[Injection] = []
        self.counts: Counter[str] = Counter()
        self._pending_undo: list[Callable[[], None]] = []
        self._warmup_logged = self._enabled_logged = False
        self._last_swap_step = -1

    # ------------------------------------------------------------------ validation
    def _resolve_target(self) -> PoolKind | None:
        modes = set(self.config.active_modes)
        if not modes & BYTE_FLIP_MODES:
            return None
        kinds = set(self.groups)
        if self.config.target_group is None:
            if len(kinds) != 1:
                raise ValueError(
                    "PerturbConfig.target_group=None is invalid: allowed one of "
                    f"{', '.join(sorted(k.name.lower() for k in kinds))} (the pool has several "
                    "groups; byte-flip modes need one)"
                )
            kind = next(iter(kinds))
        else:
            kind = PoolKind[self.config.target_group.upper()]
        if kind not in kinds:
            raise ValueError(
                f"PerturbConfig.target_group={self.config.target_group!r} is invalid: allowed "
                f"{sorted(k.name.lower() for k in kinds)} (the pool's groups)"
            )
        group = self.groups[kind]
        per_position_modes = sorted(m.value for m in modes & PER_POSITION_BYTE_MODES)
        if per_position_modes and not group.per_position:
            raise ValueError(
                f"PerturbConfig.target_group={kind.name.lower()!r} is invalid for "
                f"{per_position_modes}: allowed a per-position group (full, swa); the radix sweep "
                "and the store check cover only those"
            )
        if not group.real_kv_sources_k and self.canary.config.real_kv_hash_mode != RealKvHashMode.NONE:
            raise ValueError(
                f"PerturbConfig.target_group={kind.name.lower()!r} is invalid: the group holds "
                "no fingerprinted KV bytes (records only); allowed a group with KV layers"
            )
        return kind

    def _check_requirements(self) -> None:
        modes, cfg = set(self.config.active_modes), self.canary.config
        if modes & BYTE_FLIP_MODES and cfg.real_kv_hash_mode == RealKvHashMode.NONE:
            raise ValueError(
                f"perturbation {sorted(m.value for m in modes & BYTE_FLIP_MODES)} flips real KV bytes: "
                "--kv-canary-real-data=none cannot see that; allowed partial or all"
            )
        if PerturbMode.REAL_KV_UNUSED_CACHE in modes and cfg.sweep_interval == 0:
            raise ValueError(
                "perturbation real_kv_unused_cache targets cached slots only the radix sweep "
                "reads: --kv-canary-sweep-interval=0 is invalid; allowed an integer >= 1"
            )
        if PerturbMode.REAL_KV_UNUSED_CACHE in modes and self.canary.sweep.cache is None:
            raise ValueError("perturbation real_kv_unused_cache needs a prefix cache (none attached)")
        if PerturbMode.LOST_KV_STORE in modes and self.target is not None:
            checker = self.canary.runtime.store_checker
            tag = int(launch_tag(self.target, LaunchStage.TAIL, KvHalf.K))
            if checker is None or checker.watch_for(tag) is None:
                raise ValueError(
                    f"perturbation lost_kv_store on group {self.target.name.lower()!r} needs the "
                    "canary's store check on that group (real-KV fingerprints and a pool whose "
                    "set_kv_buffer writes its layers; a DeepSeek-V4 pool has none)"
                )
        if PerturbMode.SWA_MAPPING in modes and PoolKind.SWA not in self.groups:
            raise ValueError("perturbation swa_mapping needs a pool with an SWA group")
        if PerturbMode.NEXT_TOKEN_SWAP in modes and (
            self.running_requests is None or self.override_next_token is None
        ):
            raise ValueError(
                "perturbation next_token_swap needs the host's running_requests() and "
                "override_next_token(rid, token)"
            )
        if PerturbMode.NEXT_TOKEN_SWAP in modes and self.canary.runtime.expected_inputs is None:
            raise ValueError(
                "perturbation next_token_swap needs the host's expected inputs (ours: the "
                "engine's token oracle, token_oracle=True): only then is a swapped token "
                "detectable"
            )

        self._check_spec_requirements(modes & SPEC_MODES)

    def _check_spec_requirements(self, modes: set[PerturbMode]) -> None:
        if not modes:
            return
        names = sorted(m.value for m in modes)
        if self.spec is None:
            raise ValueError(f"perturbation {names} needs speculative decoding (the host's "
                             "spec_fault_site; --speculative-method ngram or draft)")  # fmt: skip
        if PoolKind.FULL not in self.groups:
            raise ValueError(f"perturbation {names} needs a pool with a FULL group")
        needs_draft = modes & {PerturbMode.DRAFT_PAGE_LEAK, *DRAFT_POOL_MODES}
        if needs_draft and not self.spec.has_draft_pool:
            raise ValueError(
                f"perturbation {sorted(m.value for m in needs_draft)} needs a draft model with "
                "its own pools: --speculative-method=ngram is invalid; allowed draft"
            )
        tokens = modes & {PerturbMode.DRAFT_CHUNK_ROTATION, PerturbMode.REJECTED_KV_KEPT}
        if tokens and not self.canary.config.verify_tokens:
            raise ValueError(
                f"perturbation {sorted(m.value for m in tokens)} changes only which token a "
                "slot's KV holds: --kv-canary-verify-tokens=false cannot see that; allowed true"
            )
        if PerturbMode.ROLLBACK_FREES_CACHED in modes:
            if PoolKind.SWA in self.groups:
                raise ValueError("perturbation rollback_frees_cached needs a pool without an "
                                 "SWA group (the page handed over has no SWA part to move)")  # fmt: skip
            if self.canary.sweep.cache is None or self.canary.config.sweep_interval == 0:
                raise ValueError(
                    "perturbation rollback_frees_cached overwrites a cached page the radix sweep "
                    "reads: it needs a prefix cache and --kv-canary-sweep-interval >= 1"
                )

    # ------------------------------------------------------------------ gate
    def _fire(self, mode: PerturbMode) -> bool:
        prob = self.config.prob(mode)
        if prob <= 0:
            return False
        limit = self.config.max_injections
        if limit and self.counts[mode.value] >= limit:
            return False
        step = self.canary.step
        if step < self.config.warmup_steps:
            if not self._warmup_logged:
                self._warmup_logged = True
                logger.info(
                    "kv_canary perturb: disabled during warmup window (first %d forward steps)",
                    self.config.warmup_steps,
                )
            return False
        if not self._enabled_logged:
            self._enabled_logged = True
            logger.info("kv_canary perturb: enabled after warmup window at step=%d", step)
        return self.rng.random() < prob

    def _record(self, injection: Injection | None) -> None:
        if injection is None:
            return
        self.injections.append(injection)
        self.counts[injection.mode] += 1
        if injection.undo is not None:
            self._pending_undo.append(injection.undo)

    def _target_group_name(self) -> str | None:
        return None if self.target is None else self.target.name.lower()

    # ------------------------------------------------------------------ hooks
    def pre_forward(self, fb: Any) -> None:
        if fb is None:
            return
        step, r2t, rng = self.canary.step, self.req_to_token, self.rng
        if self._fire(PerturbMode.REQ_TO_TOKEN):
            self._record(faults.req_to_token(fb, r2t, rng, step))
        if self._fire(PerturbMode.REAL_KV_USED):
            self._record(self._flip_running(fb, step))
        if self.canary.sweep.is_sweep_step(step) and self._fire(PerturbMode.REAL_KV_UNUSED_CACHE):
            self._record(self._flip_cached(step))
        if self._fire(PerturbMode.SWA_MAPPING):
            self._record(faults.swa_mapping(fb, r2t, self.groups[PoolKind.SWA], rng, step))
        if self._fire(PerturbMode.STALE_REUSE):
            self._record(faults.stale_reuse(fb, r2t, rng, step))
        if self._fire(PerturbMode.PAGE_SHIFT):
            full = self.groups.get(PoolKind.FULL) or next(iter(self.groups.values()))
            self._record(faults.page_shift(fb, r2t, full.page_size, full.num_slots, rng, step))
        if self._fire(PerturbMode.PREMATURE_WINDOW_EVICTION):
            self._record(faults.premature_window_eviction(fb, r2t, self.groups[PoolKind.SWA], rng, step))
        if self.pool is not None and self.target is not None and self._fire(PerturbMode.LOST_KV_STORE):
            self._record(faults.lost_kv_store(fb, self.groups[self.target], self.pool, rng, step,
                                              self.target.name.lower()))  # fmt: skip
        if self.spec is not None:
            self._pre_forward_spec(fb, self.spec, step, r2t, rng)

    def _pre_forward_spec(self, fb: Any, spec: SpecFaultHost, step: int, r2t: Any, rng: random.Random) -> None:
        if self._fire(PerturbMode.DRAFT_POSITION_SHIFT):
            self._record(faults.draft_position_shift(fb, rng, step))
        if self._fire(PerturbMode.DRAFT_CHUNK_ROTATION):
            mirror = self.canary.runtime.req_to_token_pool
            self._record(faults.draft_chunk_rotation(fb, mirror.token_ids, mirror.token_lens, rng, step))
        if self._fire(PerturbMode.REJECTED_KV_KEPT):
            self._record(faults.rejected_kv_kept(fb, spec.rejected_drafts(), spec.free_slot(), rng, step))
        if self.canary.sweep.is_sweep_step(step) and self._fire(PerturbMode.ROLLBACK_FREES_CACHED):
            full = self.groups[PoolKind.FULL]
            done = faults.rollback_frees_cached(fb, spec.give_cached_page, full.page_size, rng, step)
            if done is not None:
                self._record(done[0])
                self._pending_repair.append(done[1])
        if self._fire(PerturbMode.DRAFT_PAGE_LEAK):
            full = self.groups[PoolKind.FULL]
            self._record(faults.draft_page_leak(fb, r2t, spec.draft_slots(), full.num_slots, rng, step))

    def post_forward(self, fb: Any) -> None:
        undo, self._pending_undo = self._pending_undo, []
        for fn in reversed(undo):
            fn()
        if fb is not None and self._fire(PerturbMode.REAL_KV_POST_FORWARD):
            self._record(self._flip_written(fb, self.canary.step))

    def end_step(self) -> None:
        repair, self._pending_repair = self._pending_repair, []
        for fn in repair:  # after the forward's radix sweep read the damage
            fn()
        step = self.canary.step
        if step == self._last_swap_step:  # no forward (so nothing sampled) since last time
            return
        self._last_swap_step = step
        if (self.running_requests is not None and self.override_next_token is not None
                and self._fire(PerturbMode.NEXT_TOKEN_SWAP)):  # fmt: skip
            self._record(faults.next_token_swap(self.running_requests(), self.override_next_token,
                                                self.rng, step))  # fmt: skip

    # ------------------------------------------------------------------ byte flips
    def _flip(self, mode: PerturbMode, group_slots: list[int], step: int) -> Injection | None:
        """Flip a byte of one of ``group_slots`` (in the target group's index space)."""
        assert self.target is not None
        group = self.groups[self.target]
        slots = [s for s in group_slots if s > 0]
        if not slots:
            return None
        detail = faults.flip_byte(group, self.rng.choice(slots), self.rng, mode.value)
        return None if detail is None else Injection(mode.value, step, self._target_group_name(), detail)

    def _group_slots(self, entries: list[Any]) -> list[int]:
        """The target group's slots of per-position ``entries`` (``.slot``: full slots,
        ``.position``); a compressed group keeps the entries that close a block."""
        assert self.target is not None
        group = self.groups[self.target]
        if group.compression_ratio > 1:
            entries = complete_blocks(entries, group.compression_ratio)
        return [faults.group_slot(group, e.slot) for e in entries]

    def _flip_running(self, fb: Any, step: int) -> Injection | None:
        """A running request's committed slot (SWA: in its window; compressed: a complete
        entry; compress-state ring: a live tail row this forward keeps)."""
        assert self.target is not None
        group = self.groups[self.target]
        if group.state_ring is not None:
            rows = live_ring_rows(fb, self.req_to_token, group.state_ring, group.swa_index_lut)
            return self._flip(PerturbMode.REAL_KV_USED, rows, step)
        entries = prefix_entries(fb, self.req_to_token, group.window)
        return self._flip(PerturbMode.REAL_KV_USED, self._group_slots(entries), step)

    def _flip_cached(self, step: int) -> Injection | None:
        """A cached slot no running request holds (SWA: resident)."""
        assert self.target is not None
        group = self.groups[self.target]
        lut = group.swa_index_lut
        slots = unlocked_cached_slots(self.canary.sweep.cache, lut)
        return self._flip(PerturbMode.REAL_KV_UNUSED_CACHE, [faults.group_slot(group, s) for s in slots], step)

    def _flip_written(self, fb: Any, step: int) -> Injection | None:
        """A slot this forward wrote: first read by the next forward (whose index is step + 1)
        (compressed: an entry this forward completed; ring: a row of the new live tail)."""
        assert self.target is not None
        group = self.groups[self.target]
        if group.state_ring is not None:
            rows = live_ring_rows(fb, self.req_to_token, group.state_ring, group.swa_index_lut,
                                  after_forward=True)  # fmt: skip
            return self._flip(PerturbMode.REAL_KV_POST_FORWARD, rows, step + 1)
        slots = self._group_slots(write_entries(fb))
        return self._flip(PerturbMode.REAL_KV_POST_FORWARD, slots, step + 1)


def install_perturbation(host: Any, config: PerturbConfig) -> Perturber:
    """Attach fault injection to a host's canary (``host.canary``; our engine is one; the
    draft-pool modes: ``host.draft_canary``, the speculative draft model's); returns it. The
    speculative modes use the host's ``spec_fault_site`` (:class:`SpecFaultHost`). ``next_token_swap`` also uses the host's ``running_requests()`` (snapshots:
    :class:`RunningRequestView`) and ``override_next_token(rid, token)`` when it has them."""
    modes = set(config.active_modes)
    draft = modes & DRAFT_POOL_MODES
    if draft and modes - DRAFT_POOL_MODES:
        raise ValueError(
            f"PerturbConfig mixes draft-pool modes {sorted(m.value for m in draft)} with "
            f"{sorted(m.value for m in modes - DRAFT_POOL_MODES)}: allowed one side per "
            "perturber (install one on each canary)"
        )
    canary = getattr(host, "draft_canary" if draft else "canary", None)
    if canary is None and draft:
        raise ValueError(
            f"perturbation {sorted(m.value for m in draft)} corrupts the draft model's KV: it "
            "needs speculative decoding with a draft model (--speculative-method=draft) and "
            "the KV canary on"
        )
    if canary is None:
        raise ValueError("fault injection needs the KV canary: --kv-canary is \"none\"; allowed log, raise or abort")
    if canary.perturber is not None:
        raise RuntimeError("kv-canary: a perturber is already attached to this canary")
    perturber = Perturber(
        config, canary,
        running_requests=getattr(host, "running_requests", None),
        override_next_token=getattr(host, "override_next_token", None),
        pool=canary.pool, spec=getattr(host, "spec_fault_site", None),
    )  # fmt: skip
    canary.perturber = perturber
    return perturber
