"""An independent read oracle for vLLM replays: what every KV slot really holds, against
what each reader expects, step by step. It shares no code with the canary.

It wraps the model runner's ``_update_states`` (the start of ``execute_model``, after which
the persistent batch holds this step's block tables, computed-token counts and token ids),
and for every scheduled request and KV cache group:

* **writes**: positions ``[K, K + n)`` (``K`` computed tokens, ``n`` scheduled) go to the
  slots the worker's block table maps them to; each such slot of each KV tensor the group's
  layers use now holds ``(prefix identity of the writer's tokens [0, p], p)``;
* **reads**: full-attention groups read ``[0, K + n)``, sliding-window groups
  ``[max(0, K - W + 1), K + n)``; a read is bad when the slot does not hold the reader's
  own ``(prefix identity, p)``.

The prefix identity is a running hash of the tokens (and of the request's cache namespace,
``namespace(req_id)``, for the tenant replays). Writes of a step are applied before its
reads (every layer stores before its attention reads), so a slot written twice in one step
holds the later write, the approximation of a per-layer order the oracle does not model.

KV another connector loads (:mod:`vllm_stub_connector`) is told by :meth:`ReadOracle.load`
when it lands (a sync load: when its step is planned, before the forward reads it); a slot
no one wrote holds nothing, so any read of it is bad. A sync load's failed blocks
(:meth:`ReadOracle.load_failed`) are read by their request in that very step, and the
loader reports them: vLLM drops that step's output of the request, so those reads are
``reported``, not ``bad``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BadRead:
    step: int
    req_id: str
    group: int
    position: int
    slot: int
    holds: tuple[int, int] | None  # (prefix identity, position) or never written


@dataclass
class ReadOracle:
    runner: Any
    namespace: Callable[[str], object] = lambda rid: None
    step: int = 0
    reads: int = 0
    bad: list[BadRead] = field(default_factory=list)
    reported: list[BadRead] = field(default_factory=list)
    _failing: set[tuple[str, int]] = field(default_factory=set)  # (request, block) this step
    holds: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    groups: list[tuple[int, int | None, list[tuple[int, int]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        context = self.runner.compilation_config.static_forward_context
        for g in self.runner.kv_cache_config.kv_cache_groups:
            spec = g.kv_cache_spec
            pages = set()  # (base address, page stride) of each layer's cache tensor
            for name in g.layer_names:
                kv = context[name].kv_cache
                kv = kv[0] if isinstance(kv, list) else kv
                pages.add((kv.data_ptr(), kv.stride(0) * kv.element_size()))
            self.groups.append((spec.block_size, getattr(spec, "sliding_window", None),
                                sorted(pages)))  # fmt: skip
        original = self.runner._update_states

        def update_states(scheduler_output: Any) -> Any:
            out = original(scheduler_output)
            self._observe(scheduler_output)
            return out

        self.runner._update_states = update_states

    # ------------------------------------------------------------------ results
    @property
    def first_bad_step(self) -> int | None:
        return self.bad[0].step if self.bad else None

    def bad_slots(self, step: int | None = None) -> set[int]:
        return {b.slot for b in self.bad if step is None or b.step == step}

    def bad_steps(self) -> list[int]:
        return sorted({b.step for b in self.bad})

    # ------------------------------------------------------------------ loads
    def load(self, rid: str, tokens: list[int], positions: list[int],
             block_ids: tuple[list[int], ...]) -> None:  # fmt: skip
        """Request ``rid``'s KV of ``positions`` (its token ids ``tokens``) was written into
        its blocks ``block_ids`` (per group; 0: none) by a loader."""
        ident = self._identity(rid, tokens[: max(positions, default=-1) + 1])
        for (bs, _w, tensors), ids in zip(self.groups, block_ids, strict=True):
            for p in positions:
                block = ids[p // bs] if p // bs < len(ids) else 0
                if block:
                    for base, stride in tensors:
                        self.holds[(base + block * stride, p % bs)] = (ident[p], p)

    def load_failed(self, rid: str, block_ids: list[int]) -> None:
        """The loader reports request ``rid``'s blocks ``block_ids`` failed, in the step
        observed next (the step whose forward reads them)."""
        self._failing.update((rid, b) for b in block_ids)

    def _identity(self, rid: str, tokens: list[int]) -> list[int]:
        ident, running = [], hash(("ns", self.namespace(rid)))
        for t in tokens:
            running = hash((running, int(t)))
            ident.append(running)
        return ident

    # ------------------------------------------------------------------ one step
    def _observe(self, scheduler_output: Any) -> None:
        self.step += 1
        batch = self.runner.input_batch
        todo = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            row = batch.req_id_to_index[rid]
            k = int(batch.num_computed_tokens_cpu[row])
            ident = self._identity(rid, batch.token_ids_cpu[row, : k + n].tolist())
            tables = [t.block_table.np[row] for t in batch.block_table.block_tables]
            todo.append((rid, k, n, ident, tables))
        for _rid, k, n, ident, tables in todo:
            for (bs, _w, tensors), table in zip(self.groups, tables, strict=True):
                for p in range(k, k + n):
                    block = int(table[p // bs])
                    for base, stride in tensors:
                        self.holds[(base + block * stride, p % bs)] = (ident[p], p)
        for rid, k, n, ident, tables in todo:
            for gi, ((bs, window, tensors), table) in enumerate(
                    zip(self.groups, tables, strict=True)):  # fmt: skip
                lo = 0 if window is None else max(0, k - window + 1)
                for p in range(lo, k + n):
                    block = int(table[p // bs])
                    self.reads += 1
                    wrong = [got for base, stride in tensors
                             if (got := self.holds.get((base + block * stride, p % bs)))
                             != (ident[p], p)]  # fmt: skip
                    if wrong:
                        bad = BadRead(self.step, rid, gi, p, block * bs + p % bs, wrong[0])
                        (self.reported if (rid, block) in self._failing else self.bad).append(bad)
        self._failing.clear()
