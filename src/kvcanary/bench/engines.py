"""Shared by the engine benchmarks: pools sized to a workload, one decoder shared by the
engines of one process, the shapes of an engine's forwards, exact-length prompts."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from kvcanary.bench.traffic import StepShape
from kvcanary.config import EngineConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.kv_manager import pool_need
from kvcanary.utils import ceil_page, floor_page


def fit_pools(
    config: EngineConfig, window: int | None, batches: Iterable[tuple[Sequence[int], int]]
) -> EngineConfig:
    """``config`` with the smallest pools (and ``max_running_requests``) in which every
    batch ``(prompt lengths, new tokens per request)`` runs as one batch.

    Each request needs :func:`~kvcanary.engine.kv_manager.pool_need` full slots and at most
    that many SWA slots (fewer once its context passes the window), plus a page of slack;
    a batch needs the sum, and the SWA pool at least what the scheduler asks of any
    request alone (its SWA need). Sized to the workload because a KV pool is
    resident memory (zero-filled): the default 16384-token pools of a 0.6B model take
    1.6 GB per engine.
    """
    page = config.page_size
    num_full = num_swa = num_running = 0
    for prompt_lens, output_len in batches:
        needs = [pool_need(n, output_len, config.chunked_prefill_size, page, window,
                           prefix_cache=config.enable_prefix_cache) for n in prompt_lens]  # fmt: skip
        num_full = max(num_full, sum(n.num_full_tokens + page for n in needs))
        num_swa = max(num_swa, sum(min(n.num_full_tokens, n.num_swa_tokens) + page for n in needs),
                      *(n.num_swa_tokens for n in needs))  # fmt: skip
        num_running = max(num_running, len(needs))
    num_full = ceil_page(max(num_full, num_swa, 2 * page), page)
    ratio = 1.0
    if window is not None:
        ratio = min(1.0, num_swa / num_full)
        while ratio < 1.0 and floor_page(int(num_full * ratio), page) < num_swa:
            ratio = min(1.0, ratio + 1e-3)  # float products round down: make it enough
    return replace(config, max_total_tokens=num_full, swa_full_tokens_ratio=ratio,
                   max_running_requests=max(config.max_running_requests, num_running))  # fmt: skip


def random_prompt(num_tokens: int, seed: int) -> list[int]:
    """A prompt of exactly ``num_tokens`` byte ids (``make_prompts`` varies the lengths)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(num_tokens)]


@contextlib.contextmanager
def shared_decoder() -> Iterator[None]:
    """Engines built inside share one decoder per ``(model, device, dtype, seed)``.

    The decoder holds weights only (attention state comes with each forward's batch), so
    engines that would load identical weights can share them: four engines of a 0.6B preset
    then take 3 GB, not 12, and build in one weight draw, not four."""
    from kvcanary.engine import model_runner

    load = model_runner.load_model  # type: ignore[attr-defined]
    loaded: dict[tuple[str, str, Any, int], Any] = {}

    def load_once(model: str, device: Any = "cpu", dtype: Any = None, seed: int = 0) -> Any:
        key = (model, str(device), dtype, seed)
        if key not in loaded:
            loaded[key] = load(model, device=device, dtype=dtype, seed=seed)
        return loaded[key]

    model_runner.load_model = load_once  # type: ignore[attr-defined]
    try:
        yield
    finally:
        model_runner.load_model = load  # type: ignore[attr-defined]


def record_forward_shapes(engine: Engine) -> list[StepShape]:
    """The shapes of ``engine``'s forwards from now on, appended as they run (graph padding
    rows left out). Costs every forward the same few microseconds, so engines that all
    record stay comparable. A decode the graph runner replays is recorded there: a replayed
    CUDA graph never calls ``runner.forward`` (an eager replay does, padded: not twice)."""
    shapes: list[StepShape] = []
    forward = engine.runner.forward
    replaying = False

    def record(fb: Any) -> None:
        n = fb.batch_size - fb.num_padding
        shapes.append(StepShape(tuple(fb.prefix_lens_cpu[:n]), tuple(fb.extend_seq_lens_cpu[:n])))

    def recording_forward(fb: Any, *args: Any, **kwargs: Any) -> Any:
        if not replaying:
            record(fb)
        return forward(fb, *args, **kwargs)

    engine.runner.forward = recording_forward  # type: ignore[method-assign]
    graphs = engine.scheduler.graph_runner
    if graphs is not None:
        replay = graphs.replay

        def recording_replay(fb: Any) -> Any:
            nonlocal replaying
            record(fb)
            replaying = True
            try:
                return replay(fb)
            finally:
                replaying = False

        graphs.replay = recording_replay  # type: ignore[method-assign]
    return shapes
