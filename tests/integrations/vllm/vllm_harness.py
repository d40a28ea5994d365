"""Helpers of the vLLM tests: tiny checkpoints, engines with and without the canary
connector, and handles on vLLM's own state (scheduler, block pool, worker) for faults.

Everything runs in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by ``make
test-vllm`` and by conftest.py), so the scheduler, the worker and the connector are plain
objects here.
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_fixtures import make_tiny_hf_checkpoint

BLOCK_SIZE = 32  # the CPU attention backend's block size (16 is raised to 32)
HEAD_DIM = 32  # vLLM's CPU attention has no kernel for head_dim 16 (hf_fixtures' default)
WINDOW = 8  # gemma3 fixture: layers S S F S, window 8


def make_checkpoint(root: Path, family: str) -> Path:
    """``llama``: every layer full attention (one KV cache group); ``gemma3``: layers
    S S F S, window 8 (vLLM's hybrid allocator: one group per layer, three sliding)."""
    return make_tiny_hf_checkpoint(root, family, head_dim=HEAD_DIM)


def add_tokenizer(ckpt: Path) -> None:
    """Write a word-level tokenizer into the checkpoint ``ckpt`` (vLLM's server needs one;
    the offline engines skip it): token id ``i`` is the word ``t{i}``, id 0 ``<unk>`` (any
    other word), BOS / EOS the fixture's; a chat template of ``role: content`` lines."""
    from hf_fixtures import BOS_ID, EOS_ID, VOCAB_SIZE
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(1, VOCAB_SIZE)}
    vocab.update({"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID})
    del vocab[f"t{BOS_ID}"], vocab[f"t{EOS_ID}"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", chat_template=template).save_pretrained(ckpt)  # fmt: skip


def flip_k_byte(conn: Any, group: int, block: int, offset: int, element: int = 0) -> None:
    """Flip byte 1 of element ``element`` of KV head 0's K of slot ``block * bs + offset``
    in the group's first layer (vLLM's CPU layout stores a block's K of a head transposed,
    ``[head_size, block_size]``: the element sits at ``element * bs + offset``; -1: the
    last element). The tensor is vLLM's own KV cache (the one the connector registered)."""
    import torch

    pool = conn.worker.pools[group]
    kv = pool.layers[0]
    spec = pool.spec
    es, bs = kv.element_size(), spec.block_size
    raw = kv.view(kv.shape[0], -1).view(torch.uint8)
    raw[block, (element % spec.head_size * bs + offset) * es + 1] ^= 0xFF


def canary_transfer_config(*, policy: str | None = None, **options: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` naming the canary (its options in the extra config;
    ``policy``: vLLM's ``kv_load_failure_policy``, what abort mode leads to)."""
    config: dict[str, Any] = {
        "kv_connector": "KVCanaryConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"stats_interval": 0, **options},
    }
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return config


def multi_transfer_config(connectors: list[dict[str, Any]], canary: dict[str, Any] | None, *,
                          policy: str | None = None) -> dict[str, Any]:  # fmt: skip
    """vLLM's ``MultiConnector`` over ``connectors`` (child configs) and, last, the canary
    (its options) when given."""
    children = list(connectors)
    if canary is not None:
        children.append(canary_transfer_config(**canary))
    config: dict[str, Any] = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"connectors": children}}  # fmt: skip
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return config


@contextlib.contextmanager
def vllm_engine(ckpt: Path, *, canary: dict[str, Any] | None = None,
                num_blocks: int | None = None, max_model_len: int = 512,
                max_num_seqs: int = 32, policy: str | None = None,
                connectors: list[dict[str, Any]] | None = None,
                **kwargs: Any) -> Iterator[Any]:  # fmt: skip
    """An offline ``vllm.LLM`` on the tiny checkpoint (fp32, eager, prefix caching on), with
    the canary connector when ``canary`` is given (its extra config), beside ``connectors``
    (child configs) through vLLM's MultiConnector when given. Shut down on exit, so the next
    engine starts without the previous one's connector."""
    from vllm import LLM
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    kw: dict[str, Any] = dict(
        model=str(ckpt), skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len,
        enforce_eager=True, seed=0, block_size=BLOCK_SIZE, enable_prefix_caching=True,
        max_num_seqs=max_num_seqs, disable_log_stats=True, **kwargs,
    )  # fmt: skip
    if num_blocks is not None:
        kw["num_gpu_blocks_override"] = num_blocks
    if connectors:
        kw["kv_transfer_config"] = multi_transfer_config(connectors, canary, policy=policy)
    elif canary is not None:
        kw["kv_transfer_config"] = canary_transfer_config(policy=policy, **canary)
    llm = LLM(**kw)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        ensure_kv_transfer_shutdown()
        del llm
        gc.collect()


# ------------------------------------------------------------------------ vLLM internals


def error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes / contexts, outermost first (vLLM wraps a worker's or an
    engine's error in its own)."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def engine_core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def scheduler(llm: Any) -> Any:
    return engine_core(llm).scheduler


def block_pool(llm: Any) -> Any:
    return scheduler(llm).kv_cache_manager.block_pool


def worker(llm: Any) -> Any:
    return engine_core(llm).model_executor.driver_worker.worker


def connector(llm: Any, name: str = "KVCanaryConnector") -> Any:
    """The worker-side canary connector (the scheduler has its own instance); under a
    MultiConnector, its child of class ``name``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    group = get_kv_transfer_group()
    children = getattr(group, "sub_connectors", None)
    if children is None:
        return group
    return next(c for c in children if type(c).__name__ == name)


@dataclass
class SchedulerTally:
    """Preemptions and prefix-cache hits the scheduler made (wrapping its own methods)."""

    preemptions: int = 0
    hit_tokens: list[int] = field(default_factory=list)


def tally_scheduler(llm: Any) -> SchedulerTally:
    sched = scheduler(llm)
    tally = SchedulerTally()
    preempt = sched._preempt_request

    def counting_preempt(*args: Any, **kwargs: Any) -> Any:
        tally.preemptions += 1
        return preempt(*args, **kwargs)

    sched._preempt_request = counting_preempt
    manager = sched.kv_cache_manager
    get_computed = manager.get_computed_blocks

    def counting_hits(request: Any, *args: Any, **kwargs: Any) -> Any:
        out = get_computed(request, *args, **kwargs)
        tally.hit_tokens.append(int(out[1]))
        return out

    manager.get_computed_blocks = counting_hits
    return tally


# ------------------------------------------------------------------------ workloads


def shared_prefix_prompts(seed: int, n: int, prefix_len: int, tail: tuple[int, int],
                          vocab: int = 300) -> list[list[int]]:  # fmt: skip
    """``n`` prompts: one shared prefix of ``prefix_len`` tokens (prefix-cache hits), then
    a random tail of ``tail[0]..tail[1]`` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(rng.randrange(*tail))]
            for _ in range(n)]  # fmt: skip


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def add_request(llm: Any, rid: str, prompt: list[int], max_tokens: int) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, sp)


def step(llm: Any) -> list[Any]:
    return llm.llm_engine.step()


def run_until_done(llm: Any, limit: int = 10_000) -> int:
    steps = 0
    while llm.llm_engine.has_unfinished_requests() and steps < limit:
        step(llm)
        steps += 1
    return steps


def internal_id(llm: Any, rid: str) -> str:
    """vLLM's request id for the user id ``rid`` (the engine appends a suffix)."""
    ids = [r for r in scheduler(llm).requests if r == rid or r.startswith(f"{rid}-")]
    assert len(ids) == 1, (rid, list(scheduler(llm).requests))
    return ids[0]
