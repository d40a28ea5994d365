"""Perturber: the fault injector attached to a canary (``canary.perturber``).

The canary manager calls it at three host-side points of every step, outside the forward::

    pre_forward(fb)    before the forward (and before attention reads its slot tables):
                       req_to_token, real_kv_used, real_kv_unused_cache (sweep steps only),
                       swa_mapping, stale_reuse, page_shift
    post_forward(fb)   after TAIL: undo the transient metadata faults; real_kv_post_forward
    end_step()         after the step's sampling: next_token_swap

Each call of a hook draws from one seeded RNG in a fixed order, so a campaign replays
exactly. Every injection is kept in ``injections`` (mode, the first forward step that can
see it, target) for the self-test's detection matrix.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvcanary.canary.constants import PoolKind, RealKvHashMode
from kvcanary.canary.perturb import faults
from kvcanary.canary.perturb.config import BYTE_FLIP_MODES, PerturbConfig, PerturbMode
from kvcanary.canary.perturb.faults import Injection
from kvcanary.canary.perturb.slots import prefix_entries, unlocked_cached_slots, write_entries

logger = logging.getLogger("kvcanary.canary")


class Perturber:
    def __init__(
        self,
        config: PerturbConfig,
        canary: Any,
        *,
        running_requests: Callable[[], list[Any]] | None = None,
        token_ids: Any = None,
        pool: Any = None,
    ):
        """``canary``: the CanaryManager; ``running_requests`` / ``token_ids``: the engine's
        running requests and req->token token mirror (``next_token_swap`` only); ``pool``:
        the engine's KV pool, whose stores ``lost_kv_store`` breaks."""
        self.config = config
        self.pool = pool
        self.canary = canary
        self.running_requests = running_requests
        self.token_ids = token_ids
        self.rng = random.Random(config.seed)
        self.groups = {g.kind: g for g in canary.groups}
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
        kinds = {k for k in self.groups if k in (PoolKind.FULL, PoolKind.SWA)}
        if not any(m in BYTE_FLIP_MODES for m in self.config.active_modes):
            return None
        if self.config.target_group is None:
            if len(kinds) != 1:
                raise ValueError(
                    "PerturbConfig.target_group=None is invalid: allowed 'full' or 'swa' (the "
                    "pool has both groups; byte-flip modes need one)"
                )
            return next(iter(kinds))
        kind = PoolKind[self.config.target_group.upper()]
        if kind not in kinds:
            raise ValueError(
                f"PerturbConfig.target_group={self.config.target_group!r} is invalid: allowed "
                f"{sorted(k.name.lower() for k in kinds)} (the pool's groups)"
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
        if PerturbMode.SWA_MAPPING in modes and PoolKind.SWA not in self.groups:
            raise ValueError("perturbation swa_mapping needs a pool with an SWA group")
        if PerturbMode.NEXT_TOKEN_SWAP in modes and (
            self.running_requests is None or self.canary.runtime.expected_inputs is None
        ):
            raise ValueError(
                "perturbation next_token_swap needs the engine's token oracle "
                "(EngineConfig(token_oracle=True)): only then is a swapped token detectable"
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

    def post_forward(self, fb: Any) -> None:
        undo, self._pending_undo = self._pending_undo, []
        for fn in reversed(undo):
            fn()
        if fb is not None and self._fire(PerturbMode.REAL_KV_POST_FORWARD):
            self._record(self._flip_written(fb, self.canary.step))

    def end_step(self) -> None:
        step = self.canary.step
        if step == self._last_swap_step:  # no forward (so nothing sampled) since last time
            return
        self._last_swap_step = step
        if self.running_requests is not None and self._fire(PerturbMode.NEXT_TOKEN_SWAP):
            self._record(faults.next_token_swap(self.running_requests(), self.token_ids, self.rng, step))

    # ------------------------------------------------------------------ byte flips
    def _flip(self, mode: PerturbMode, full_slots: list[int], step: int) -> Injection | None:
        assert self.target is not None
        group = self.groups[self.target]
        slots = [s for s in (faults.group_slot(group, f) for f in full_slots) if s > 0]
        if not slots:
            return None
        detail = faults.flip_byte(group, self.rng.choice(slots), self.rng, mode.value)
        return None if detail is None else Injection(mode.value, step, self._target_group_name(), detail)

    def _flip_running(self, fb: Any, step: int) -> Injection | None:
        """A running request's committed slot (SWA: in its window)."""
        assert self.target is not None
        window = self.groups[self.target].window
        slots = [e.slot for e in prefix_entries(fb, self.req_to_token, window)]
        return self._flip(PerturbMode.REAL_KV_USED, slots, step)

    def _flip_cached(self, step: int) -> Injection | None:
        """A cached slot no running request holds (SWA: resident)."""
        assert self.target is not None
        lut = self.groups[self.target].swa_index_lut
        slots = unlocked_cached_slots(self.canary.sweep.cache, lut)
        return self._flip(PerturbMode.REAL_KV_UNUSED_CACHE, slots, step)

    def _flip_written(self, fb: Any, step: int) -> Injection | None:
        """A slot this forward wrote: first read by the next forward (whose index is step + 1)."""
        slots = [w.slot for w in write_entries(fb)]
        return self._flip(PerturbMode.REAL_KV_POST_FORWARD, slots, step + 1)


def install_perturbation(engine: Any, config: PerturbConfig) -> Perturber:
    """Attach fault injection to an engine's canary (``engine.canary``); returns it."""
    canary = getattr(engine, "canary", None)
    if canary is None:
        raise ValueError("fault injection needs the KV canary: --kv-canary is 'none'; allowed log, raise or abort")
    if canary.perturber is not None:
        raise RuntimeError("kv-canary: a perturber is already attached to this canary")
    perturber = Perturber(
        config, canary,
        running_requests=lambda: engine.scheduler.running,
        token_ids=engine.runner.req_to_token_pool.token_ids,
        pool=engine.runner.token_to_kv_pool,
    )  # fmt: skip
    canary.perturber = perturber
    return perturber
