"""Compile the connector's kernels at worker start-up, not in the first forward.

:func:`warm_worker` runs when the KV caches register (``register_kv_caches``, before vLLM's
own warm-up forwards): a throwaway :class:`.worker.VllmCanaryWorker` over the same layer
tensors (so every kernel sees the same array types: dtypes, layouts) and the same canary
options takes a few synthetic steps as vLLM's scheduler and attention metadata would hand
them in (the dtypes of vLLM's CPU and GPU attention metadata): a prompt prefilled in two
chunks, a second request on the first one's prefix blocks, the two decoding together across
a block boundary (and as async scheduling plans them: tokens not known yet, then
arriving), then one finishing and a third taking its row, and a fourth starting on
tokens another connector loaded (its slots cleared, then sealed). Numba compiles (or loads
from its on-disk cache) every kernel those steps call, the serial and threaded variants
both; the real worker then starts with nothing left to compile.

The throwaway reads the layer tensors and writes nothing to them (its records are its own:
buffers as large as the real worker's, dropped when it returns).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvcanary.canary.config import CanaryConfig
from kvcanary.integrations.vllm.meta import GroupSpec, StepMeta

if TYPE_CHECKING:
    from kvcanary.integrations.vllm.worker import VllmCanaryWorker

logger = logging.getLogger("kvcanary.canary")


class WorkerWarmup(NamedTuple):
    wall_s: float
    num_compiled: int  # kernels numba compiled (0: all loaded from the cache)
    compile_s: float
    skipped: str | None  # why no step ran (too few blocks)


class _Synthetic:
    """Requests' blocks and token ids, as vLLM's scheduler keeps them, and each step's
    connector metadata and per-group attention metadata (:meth:`step`)."""

    def __init__(self, specs: Sequence[GroupSpec], device: torch.device) -> None:
        self.specs, self.device = specs, device
        self.key = next((s for s in specs if s.sliding_window is None), specs[0])
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}  # block ids, the same in every group
        self.next_block = 1  # block 0: vLLM's null block
        self.loaded: dict[str, int] = {}  # requests whose first tokens were loaded

    def add(self, rid: str, prompt: list[int], share: str | None = None, shared: int = 0) -> None:
        """A request; ``share``: it starts on the first ``shared`` tokens (whole blocks)
        of request ``share`` (a prefix hit: those tokens are already computed)."""
        self.tokens[rid], self.sent[rid] = list(prompt), 0
        self.blocks[rid] = (
            [] if share is None else self.blocks[share][: shared // self.key.block_size]
        )
        self.computed[rid] = shared

    def load(self, rid: str, prompt: list[int], loaded: int) -> None:
        """A request whose first ``loaded`` tokens another connector loaded (a sync load:
        sealed in the next step, their slots cleared before it)."""
        self.add(rid, prompt)
        self.loaded[rid] = self.computed[rid] = loaded

    def step(self, work: dict[str, int], finished: Sequence[str] = (), pending: Sequence[str] = ()
             ) -> tuple[StepMeta, list[SimpleNamespace], list[int]]:  # fmt: skip
        """The metadata of one step computing ``work[rid]`` tokens of each request, and
        the input ids its forward takes; ``pending``: requests whose last token is sent as
        not known yet (-1, async scheduling), and again, known, in their next step."""
        meta = StepMeta(finished=list(finished))
        qsl, seq = [0], []
        forward: list[int] = []
        slots: list[list[int]] = [[] for _ in self.specs]
        bs_key = self.key.block_size
        for rid, n in work.items():
            k, toks = self.computed[rid], self.tokens[rid]
            while len(self.blocks[rid]) * bs_key < k + n:
                self.blocks[rid].append(self.next_block)
                self.next_block += 1
            first = self.blocks[rid][k // bs_key] * bs_key + k % bs_key
            send = toks[self.sent[rid] :]
            if rid in pending:
                send = send[:-1] + [-1]
            meta.add(rid, k, n, self.sent[rid], send, first)
            forward += toks[k : k + n]
            if rid in self.loaded:
                loaded = self.loaded.pop(rid)
                held = [[self.blocks[rid][p // s.block_size] * s.block_size + p % s.block_size
                         for p in range(loaded)] for s in self.specs]  # fmt: skip
                meta.seal(rid, 0, loaded, held)
                meta.invalid_slots = [list(h) for h in held]
            self.sent[rid] = len(toks) - (rid in pending)
            qsl.append(qsl[-1] + n)
            seq.append(k + n)
            for g, spec in enumerate(self.specs):
                bs = spec.block_size
                slots[g] += [self.blocks[rid][p // bs] * bs + p % bs for p in range(k, k + n)]
        mds = []
        width = max(len(self.blocks[rid]) for rid in work)
        for g, _spec in enumerate(self.specs):
            table = torch.zeros(len(work), width, dtype=torch.int32)
            for r, rid in enumerate(work):
                table[r, : len(self.blocks[rid])] = torch.tensor(
                    self.blocks[rid], dtype=torch.int32
                )
            mds.append(SimpleNamespace(
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
                seq_lens=torch.tensor(seq, dtype=torch.int32, device=self.device),
                block_table=table.to(self.device),
                slot_mapping=torch.tensor(slots[g], dtype=torch.int64, device=self.device)))  # fmt: skip
        for rid, n in work.items():
            self.computed[rid] += n
            if self.computed[rid] == len(self.tokens[rid]):  # sampled a token
                self.tokens[rid].append(1 + len(self.tokens[rid]) % 97)
        return meta, mds, forward


def warm_worker(config: CanaryConfig, specs: Sequence[GroupSpec], layers: dict[str, torch.Tensor],
                forward_ids: torch.Tensor | None = None) -> WorkerWarmup:  # fmt: skip
    """Compile (or load from the cache) every kernel a :class:`.worker.VllmCanaryWorker`
    with ``config`` over ``layers`` calls (module doc); ``forward_ids``: the model runner's
    input-id buffer the real worker will read (the throwaway gets one of its dtype and
    device, which its synthetic forwards fill)."""
    from kvcanary.engine.warmup import eager_canary, watch_compiles
    from kvcanary.integrations.vllm.worker import VllmCanaryWorker
    from kvcanary.jit import parallel as numba_parallel

    t0 = time.perf_counter()
    # No abort handler to reach vLLM and nothing to raise at: the throwaway only logs.
    warm_config = dataclasses.replace(eager_canary(config), mode="log")
    with watch_compiles() as compiles, numba_parallel.compiling_both():
        worker = VllmCanaryWorker(warm_config, specs, layers)
        if forward_ids is not None:
            worker.forward_input_ids = torch.zeros_like(forward_ids)
        bs = max(s.block_size for s in specs)
        window = max((s.sliding_window or 0 for s in specs), default=0)
        prompt_len = max(window + 2 * bs + 3, 3 * bs + 1)
        # Blocks the steps take: two prompts, a few decode tokens each, the third request.
        need = 3 * (prompt_len // min(s.block_size for s in specs) + 3) + 1
        if need > worker.num_blocks:
            return WorkerWarmup(time.perf_counter() - t0, compiles.num_compiled,
                                compiles.compile_s, f"{worker.num_blocks} blocks < {need}")  # fmt: skip
        fake = _Synthetic(worker.specs, worker.device)
        prompt = [1 + i % 89 for i in range(prompt_len)]
        fake.add("a", prompt)
        _run(worker, fake.step({"a": prompt_len // 2}))
        _run(worker, fake.step({"a": prompt_len - prompt_len // 2}))  # the second chunk
        shared = (prompt_len // fake.key.block_size) * fake.key.block_size
        fake.add("b", prompt[:shared] + [7, 8, 9], share="a", shared=shared)
        _run(worker, fake.step({"b": 3, "a": 1}))  # a prefix hit beside a decode
        for _ in range(bs + 1):  # batched decode, across a block boundary
            _run(worker, fake.step({"a": 1, "b": 1}))
        for _ in range(2):  # async scheduling: tokens planned unknown, known a step later
            _run(worker, fake.step({"a": 1, "b": 1}, pending=("a", "b")))
        fake.add("c", [5] * (bs + 2))
        _run(worker, fake.step({"c": bs + 2, "b": 1}, finished=("a",)))  # a's row reused
        fake.load("d", [3] * (bs + 2), bs + 1)
        _run(worker, fake.step({"d": 1, "c": 1}))  # tokens another connector loaded
        worker.flush()
        num_violations = worker.stats()["violations"]
    if num_violations:  # a warm-up that finds a fault is a canary bug: say so, run anyway
        logger.warning("kv-canary (vLLM): the connector's warm-up steps reported %d violations",
                       num_violations)  # fmt: skip
    return WorkerWarmup(time.perf_counter() - t0, compiles.num_compiled, compiles.compile_s, None)


def _run(worker: VllmCanaryWorker,
         step: tuple[StepMeta, list[SimpleNamespace], list[int]]) -> None:  # fmt: skip
    meta, metadata, forward = step
    ids = worker.forward_input_ids
    if ids is not None:  # what vLLM's input path puts there before the step binds
        ids[: len(forward)] = torch.tensor(forward, dtype=ids.dtype)
    worker.on_meta(meta)
    worker.before_forward(metadata)
    worker.after_forward()
