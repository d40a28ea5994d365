"""kvcanary's own engine as a canary host: :func:`install_on_engine`.

What crosses the boundary (:mod:`kvcanary.canary.host` names the protocols)::

    engine side                                  canary side
    engine.runner (ModelRunner)           ───►   CanaryHost: token_to_kv_pool (MHA / SWA
                                                 pool), req_to_token_pool (+ token mirror),
                                                 device, sliding_window, is_draft_worker
    ForwardBatch                          ───►   ForwardBatchView
    ModelRunner.forward                   ───►   runner.canary.before_forward(fb), then
                                                 init_forward_metadata + model, then
                                                 runner.canary.after_forward(fb)
    Engine.step                           ───►   engine.canary.end_step()
    Scheduler.abort_requests_referencing  ───►   AbortHandler (abort mode)
    Engine.kv.prefix_cache (RadixCache)   ───►   PrefixCacheView (radix sweep)
    DraftProposer.runner (speculative     ───►   a second canary (install_on_draft): the
      decoding's draft model)                    draft's pools, lines with ` pool=draft`
    token oracle (EngineConfig.token_oracle) ─►  ExpectedInputs (TokenOracleExpectations)

The engine imports this module lazily, only when a canary is enabled.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.host import CanaryHost, PrefixCacheView
from kvcanary.canary.install import install_canary
from kvcanary.canary.manager import CanaryManager
from kvcanary.config import EngineConfig
from kvcanary.integrations.native import pools as _pools  # noqa: F401  (registers our pools' attachers)


class EngineRunner(CanaryHost, Protocol):
    """The engine's model runner: a canary host (its forward calls the hooks the engine
    sets as ``runner.canary``)."""

    @property
    def vocab_size(self) -> int: ...


class NativeEngine(Protocol):
    """What this host reads of :class:`kvcanary.engine.engine.Engine` (structurally: the
    engine imports this module, never the other way round)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def runner(self) -> EngineRunner: ...

    @property
    def prefix_cache(self) -> PrefixCacheView | None: ...

    def abort_requests_referencing(
        self, full_slots: torch.Tensor, swa_slots: torch.Tensor | None = None,
        req_rows: torch.Tensor | None = None,
    ) -> list[int]: ...  # fmt: skip

    def prompt_lens(self, rids: list[int]) -> list[int]: ...


def install_on_engine(engine: NativeEngine, config: CanaryConfig) -> CanaryManager | None:
    """Install the canary on ``engine``'s runner and wire it into the engine: the abort
    handler (abort mode), the prefix cache (radix sweep), the token oracle's expected
    inputs. Returns the manager (the engine sets it as ``runner.canary``, whose forward
    calls its hooks), or None for mode ``none``."""
    runner = engine.runner
    host: CanaryHost = runner
    canary = install_canary(host, config)
    if canary is None:
        return None
    if config.mode == "abort":
        canary.set_abort_handler(engine.abort_requests_referencing)
    canary.attach_radix_cache(engine.prefix_cache)  # the radix sweep walks it
    if engine.config.token_oracle:  # every fed token is known: arm the write-input assert
        from kvcanary.canary.observe.token_oracle import TokenOracleExpectations

        canary.set_expected_inputs(TokenOracleExpectations(runner.vocab_size, engine.prompt_lens))
    canary.mark_init_finished()  # no warm-up or graph capture to wait for
    return canary


class DraftWorker(Protocol):
    """What this host reads of a speculative draft proposer
    (:class:`kvcanary.engine.speculative.DraftProposer`)."""

    @property
    def runner(self) -> CanaryHost: ...

    def abort_referencing(self, full_slots: torch.Tensor, swa_slots: torch.Tensor,
                          req_rows: torch.Tensor) -> list[int]: ...  # fmt: skip


def install_on_draft(draft: DraftWorker, config: CanaryConfig) -> CanaryManager | None:
    """A canary of its own on a speculative draft model's runner (its own pools, rows and
    records: a canary group set apart from the target's, as SGLang gives each draft worker
    its own). Its report lines end with `` pool=draft``; abort mode drops the implicated
    draft requests' KV (they prefill again), never a target request. The draft feeds its
    own tokens (no token oracle) and has no prefix cache (no radix sweep)."""
    canary = install_canary(draft.runner, config)
    if canary is None:
        return None
    canary.reporter.context = " pool=draft"
    if config.mode == "abort":
        canary.set_abort_handler(draft.abort_referencing)
    canary.mark_init_finished()
    return canary
