"""One vLLM engine in vLLM's default multiprocess mode (engine core and workers in their own
processes), run by test_vllm_multiprocess.py as a child process::

    python mp_worker_script.py CKPT OUT --tp N --fault-rank R

1. clean: a shared-prefix workload through ``LLM.generate``, first on an engine without
   the canary, then on the canary's (outputs compared); every rank's canary counters
   (``collective_rpc``) after it;
2. fault: request ``faultsrc`` (100 prompt tokens) decodes; its block ids are read from
   the workers' own block table while it runs; once it finished (its blocks free, in the
   prefix cache), one K byte of its second block is flipped in worker ``R``'s KV cache
   tensor only (its shard of the heads), and a request sharing its first 96 tokens, one
   output token, reads that block exactly once (a prefix hit);
3. every rank's counters again; the engine shuts down.

``OUT/result.json``: whether the outputs matched, the counters, the block and slot flipped. Needs
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (functions
sent to the workers); the ``__main__`` guard is vLLM's multiprocess requirement.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

FAULT_REQUEST = "faultsrc"
FAULT_OFFSET = 5  # the slot's offset in its block
PROMPT_LEN, HIT_LEN = 100, 96  # the hit: three 32-token blocks


def canary_counters(worker: Any) -> dict[str, Any]:
    """(In each worker) its rank and its canary's counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    conn.worker.flush()
    stats = conn.worker.stats()
    return {"worker_rank": int(worker.rank), "rank": conn.rank, "world_size": conn.world_size,
            "summary_path": conn.summary_path, "verify_entries": stats["verify_entries"],
            "violations": stats["violations"], "steps": stats["steps"]}  # fmt: skip


def running_block_ids(worker: Any, prefix: str) -> list[int] | None:
    """(In each worker) the group-0 block ids of the running request ``prefix*``, from the
    worker's block table (vLLM's: what attention reads); None when it is not running."""
    batch = worker.model_runner.input_batch
    rids = [r for r in batch.req_id_to_index if r is not None and r.startswith(prefix)]
    if len(rids) != 1:
        return None
    row = batch.req_id_to_index[rids[0]]
    table = batch.block_table.block_tables[0].block_table.cpu
    return [int(b) for b in table[row, : PROMPT_LEN // 32 + 1]]


def flip_k_byte(worker: Any, rank: int, block: int, offset: int) -> dict[str, Any] | None:
    """(In each worker; acts on worker ``rank`` only) flip byte 1 of element 0 of KV head
    0's K of slot ``block * bs + offset`` in the first layer's KV cache tensor (vLLM's CPU
    layout: per (block, head) K transposed, ``[head_size, block_size]``). Head 0 of this
    worker's tensor is its own shard's first head."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if int(worker.rank) != rank:
        return None
    spec = get_kv_transfer_group().specs[0]
    ctx = worker.model_runner.compilation_config.static_forward_context
    kv = ctx[spec.layer_names[0]].kv_cache
    raw = kv.view(kv.shape[0], -1).view(torch.uint8)
    raw[block, offset * kv.element_size() + 1] ^= 0xFF
    return {"rank": rank, "block": block, "slot": block * spec.block_size + offset,
            "num_kv_heads": int(kv.shape[1]), "layer": spec.layer_names[0]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--fault-rank", type=int, default=0)
    args = parser.parse_args()

    import vllm_harness as H

    summary = args.out / "kv-canary.json"
    # The summaries are written every 50 steps and in a step that reports a violation (the
    # run takes > 100 steps): vLLM's shutdown may kill the workers before their own write.
    options = {"mode": "log", "real_data": "all", "v_half": True, "stats_interval": 50,
               "summary_path": str(summary)}  # fmt: skip
    result: dict[str, Any] = {}
    kw: dict[str, Any] = {"tensor_parallel_size": args.tp}
    if args.tp > 1:
        kw["distributed_executor_backend"] = "mp"
    prompts = H.shared_prefix_prompts(11, 12, prefix_len=70, tail=(40, 120))
    with H.vllm_engine(Path(args.ckpt), **kw) as llm:
        expected = H.generate(llm, prompts, max_tokens=48)
    with H.vllm_engine(Path(args.ckpt), canary=options, **kw) as llm:
        result["outputs_identical"] = H.generate(llm, prompts, max_tokens=48) == expected
        result["clean"] = llm.collective_rpc(canary_counters)

        rng = random.Random(12)
        p = [rng.randrange(1, 300) for _ in range(PROMPT_LEN)]
        H.add_request(llm, FAULT_REQUEST, p, 64)  # running while its blocks are read
        while not any(o.outputs[0].token_ids for o in H.step(llm)):
            pass
        ids = llm.collective_rpc(running_block_ids, args=(FAULT_REQUEST,))
        result["block_ids"] = ids
        H.run_until_done(llm)
        block = ids[0][1]
        flips = llm.collective_rpc(flip_k_byte, args=(args.fault_rank, block, FAULT_OFFSET))
        result["fault"] = next(f for f in flips if f is not None)
        result["before_hit"] = llm.collective_rpc(canary_counters)
        hit = p[:HIT_LEN] + [rng.randrange(1, 300) for _ in range(20)]
        H.add_request(llm, "hit", hit, 1)
        H.run_until_done(llm)
        result["final"] = llm.collective_rpc(canary_counters)
        (args.out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
