"""Start-up check: can the KV pools hold each of the workload's requests running alone?

The scheduler only finds out mid-run (a :class:`KVPoolTooSmallError` after other requests
have finished); this says it before the first forward, naming the pool that binds and the
flags that fix it. The need is :func:`~kvcanary.engine.kv_manager.pool_need`, the rule
admission applies: the exact smallest pools in which the request runs to completion alone
(tests/engine/test_admission.py runs it alone on both sides of that size)::

    full pool   ceil_page(prompt + new tokens - 1)   (the last token never gets KV)
    SWA pool    the peak over the request's forwards, replayed chunk by chunk (the last
                chunk short) and decode step by decode step: the window (and a page of
                eviction slack) the forward attends to, the pages it allocates, and, with
                the prefix cache, the window the tree keeps locked
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvcanary.config import EngineConfig
from kvcanary.engine.kv_manager import PoolNeed, pool_need
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.model.loader import load_model_config
from kvcanary.utils import ceil_page, floor_page

if TYPE_CHECKING:
    from kvcanary.engine.engine import Engine
    from kvcanary.workload import WorkloadSpec


def check_pools(
    *, num_full_tokens: int, num_swa_tokens: int, prompt_len: int, max_new_tokens: int,
    chunked_prefill_size: int, page_size: int, window: int | None, max_total_tokens: int,
    swa_full_tokens_ratio: float, prefix_cache: bool,
) -> None:  # fmt: skip
    """Raise ``ValueError`` naming the binding pool, its flags, and values that would fit."""

    def need_with(chunk: int, page: int) -> PoolNeed:
        return pool_need(prompt_len, max_new_tokens, chunk, page, window, prefix_cache=prefix_cache)

    need, unpaged = need_with(chunked_prefill_size, page_size), need_with(chunked_prefill_size, 1)
    request = (f"a request of {prompt_len} prompt + {max_new_tokens} new tokens "
               f"(--page-size {page_size})")  # fmt: skip
    if num_full_tokens < need.num_full_tokens:
        raise ValueError(
            f"KV pool too small: the full pool (--max-total-tokens {max_total_tokens}) holds "
            f"{num_full_tokens} tokens, {request} needs {need.num_full_tokens}: raise "
            f"--max-total-tokens to {need.num_full_tokens} or more, or lower --input-len / "
            "--output-len" + (" / --page-size" if unpaged.num_full_tokens <= num_full_tokens else "")
        )
    if window is None or num_swa_tokens >= need.num_swa_tokens:
        return
    min_total = ceil_page(math.ceil(need.num_swa_tokens / swa_full_tokens_ratio), page_size)
    while floor_page(int(min_total * swa_full_tokens_ratio), page_size) < need.num_swa_tokens:
        min_total += page_size  # the SWA pool is floored to whole pages: the value must be enough
    fixes = [f"--max-total-tokens to {min_total} or more"]
    min_ratio = math.ceil(need.num_swa_tokens / num_full_tokens * 1000) / 1000  # shown rounded up
    while floor_page(int(num_full_tokens * min_ratio), page_size) < need.num_swa_tokens:
        min_ratio += 0.001  # float products round down: the value shown must be enough
    if min_ratio <= 1.0:
        fixes.insert(0, f"--swa-full-tokens-ratio to {min_ratio:.3f} or more")
    # The need is not monotone in the chunk size (where the chunks end moves the window):
    # name the largest whole-page chunk below the current one that fits.
    chunk = prompt_len if chunked_prefill_size <= 0 else min(chunked_prefill_size, prompt_len)
    fits = (c for c in range(floor_page(chunk - 1, page_size), 0, -page_size)
            if need_with(c, page_size).num_swa_tokens <= num_swa_tokens)  # fmt: skip
    max_chunk = next(fits, None)
    lowers = [] if max_chunk is None else [f"--chunked-prefill-size to {max_chunk}"]
    if unpaged.num_swa_tokens <= num_swa_tokens:
        lowers.append("--page-size")
    lower = f", or lower {' or '.join(lowers)}" if lowers else ""
    raise ValueError(
        f"KV pool too small: the SWA pool (--max-total-tokens {max_total_tokens} x "
        f"--swa-full-tokens-ratio {swa_full_tokens_ratio}) holds {num_swa_tokens} tokens, "
        f"{request}, its prefill chunks (--chunked-prefill-size {chunked_prefill_size}) and "
        f"sliding window ({window}) need {need.num_swa_tokens}: raise {' or '.join(fixes)}{lower}"
    )


def check_workload(config: EngineConfig, spec: WorkloadSpec) -> None:
    """Workload limits the model sets, checked before the engine starts (``ValueError``
    naming the flag): prompt + output must fit the context length."""
    limit = config.max_context_len or load_model_config(config.model).max_position_embeddings
    if spec.input_len + spec.output_len > limit:
        raise ValueError(
            f"--input-len={spec.input_len} is invalid with --output-len={spec.output_len}: "
            f"allowed --input-len + --output-len <= {limit} (the context length of {config.model})"
        )


def check_engine_pools(engine: Engine, prompt_lens: Iterable[int], max_new_tokens: int) -> None:
    """The engine's pools against the workload's requests (see
    :mod:`kvcanary.engine.pool_check`): the longest one for the full pool, the one that
    needs the most SWA (not always the longest: where its chunks end moves the window) for
    the SWA pool; ``ValueError`` naming the binding pool and flags."""
    alloc, c = engine.runner.allocator, engine.config
    window = engine.runner.sliding_window
    lens = sorted(set(prompt_lens))

    def swa_need(prompt_len: int) -> int:
        return pool_need(prompt_len, max_new_tokens, c.chunked_prefill_size, c.page_size, window,
                         prefix_cache=c.enable_prefix_cache).num_swa_tokens  # fmt: skip

    for prompt_len in dict.fromkeys((lens[-1], max(reversed(lens), key=swa_need))):
        check_pools(
            num_full_tokens=alloc.size_full if isinstance(alloc, SWAAllocator) else alloc.size,
            num_swa_tokens=alloc.size_swa if isinstance(alloc, SWAAllocator) else 0,
            prompt_len=prompt_len, max_new_tokens=max_new_tokens,
            chunked_prefill_size=c.chunked_prefill_size, page_size=c.page_size, window=window,
            max_total_tokens=c.max_total_tokens, swa_full_tokens_ratio=c.swa_full_tokens_ratio,
            prefix_cache=c.enable_prefix_cache,
        )  # fmt: skip
