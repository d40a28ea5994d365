"""ForwardHooks: what ``ModelRunner.forward`` calls around each forward.

A guest that must see every forward (the KV canary: ``kvcanary.canary.manager.CanaryManager``
satisfies this structurally) is set as ``runner.canary``; the engine never imports it::

    runner.begin_forward(fb)
    hooks.before_forward(fb)                  # before attention gathers its slot tables
    attn_backend.init_forward_metadata(fb); model forward
    hooks.after_forward(fb)

``before_forward`` runs before ``init_forward_metadata`` on purpose: whatever the hooks do
to the req->token table or the SWA mapping (fault injection) is what attention reads.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from kvcanary.engine.forward_batch import ForwardBatch

# The engine's canary host, ``module:function`` (``function(engine, canary_config)`` installs
# the canary and returns its manager): loaded by name when a configuration turns the canary
# on, as vLLM's KVConnectorFactory loads a connector, so the engine imports no host (the host
# imports the engine's types; kvcanary.integrations.native).
CANARY_HOST = "kvcanary.integrations.native.host:install_on_engine"
# ``function(draft_proposer, canary_config)``: the canary of a speculative draft model's
# runner (its own pools), likewise.
DRAFT_CANARY_HOST = "kvcanary.integrations.native.host:install_on_draft"


def load_by_name(spec: str) -> Callable[..., Any]:
    """The function ``spec`` (``module:function``) names, its module imported."""
    module, _, name = spec.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


@runtime_checkable
class ForwardHooks(Protocol):
    def before_forward(self, batch: ForwardBatch, forward_index: int = 0) -> None:
        """Before the forward of ``batch`` (``forward_index``: which forward of the step)."""
        ...

    def after_forward(self, batch: ForwardBatch) -> None:
        """After the forward of ``batch`` (the one ``before_forward`` saw)."""
        ...


@runtime_checkable
class GraphForwardHooks(ForwardHooks, Protocol):
    """Hooks whose per-forward work can be recorded into a captured decode graph: each call
    split into a host part (around every replay) and a device part (in the graph)::

        begin_forward(fb); [head(fb); model; tail(fb)]; end_forward(fb)

    ``before_forward`` = ``begin_forward`` + ``head``; ``after_forward`` = ``tail`` +
    ``end_forward``."""

    @property
    def graph_capturable(self) -> bool:
        """Whether ``head`` / ``tail`` may be recorded into a CUDA graph now."""
        ...

    def begin_forward(self, batch: ForwardBatch, forward_index: int = 0) -> None: ...

    def head(self, batch: ForwardBatch) -> object: ...

    def tail(self, batch: ForwardBatch) -> None: ...

    def end_forward(self, batch: ForwardBatch) -> None: ...

