"""Replays of vLLM bugs that share KV across cache namespaces (LoRA adapters, cache_salt),
caught by the canary's tenant isolation (``tenant_isolation``, integrations/vllm/namespace.py).

Each bug is put back into the installed vLLM with ``revert_fix`` (the exact lines of the
upstream fix replaced by the pre-fix lines; a version drift fails loudly). Workload: tenant
A's request runs to completion (its blocks stay in the prefix cache), then tenant B's request
with the same prompt. Runs: unpatched with the canary (silent, no hit across tenants);
patched without the canary (B's output differs from the clean run: B attended to KV computed
with A's adapter); patched with the canary (every slot of the false hit named in the step of
the first bad read, per the read oracle; ``kvcanary explain`` says ``cross_namespace_hit``);
patched with the canary but tenant isolation off (silent: records agree with each other, the
bug is invisible by design without the namespace).

    bug                                     fix site (0.32)                          form
    #27211 lineage (#30931, #42125): LoRA   kv_cache_utils._gen_lora_extra_hash_keys exact
      keyed by name only; same name, new
      adapter path reuses the old adapter's
      KV (fixed in 0.31)
    LoRA left out of the block hash (V0     kv_cache_utils._gen_lora_extra_hash_keys closest V1 form
      #3263 / #8240)
    #44701: a LoRA name equal to a          kv_cache_utils.generate_block_hash_extra_ exact
      cache_salt collides (untagged keys)     keys + _gen_lora_extra_hash_keys
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_harness as H
import vllm_replay as R
from safetensors.torch import save_file
from source_patch import revert_fix

PROMPT = [(7 * i + 3) % 290 + 1 for i in range(100)]  # 3 full blocks of 32, 4 tokens more
CANARY = {"mode": "log", "real_data": "partial", "tenant_isolation": True}
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
TABLE: dict[str, dict[str, Any]] = {}


def _adapter(root: Path, ckpt: Path, seed: int) -> str:
    """A PEFT LoRA adapter (rank 8 on q/k/v) with random weights for the tiny Llama."""
    cfg = json.loads((ckpt / "config.json").read_text())
    hs, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim", hs // cfg["num_attention_heads"])
    outs = {"q_proj": cfg["num_attention_heads"] * hd, "k_proj": cfg["num_key_value_heads"] * hd,
            "v_proj": cfg["num_key_value_heads"] * hd}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(layers):
        for name, out in outs.items():
            p = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{p}.lora_A.weight"] = torch.randn(8, hs, generator=g) * 0.5
            weights[f"{p}.lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.5
    root.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(root / "adapter_model.safetensors"))
    (root / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none",
        "target_modules": list(outs), "base_model_name_or_path": str(ckpt),
        "task_type": "CAUSAL_LM"}))  # fmt: skip
    return str(root)


@pytest.fixture(scope="module")
def adapters(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {n: _adapter(root / n, checkpoints["llama"], seed) for n, seed in (("A", 1), ("B", 2))}


def _kv_identity(llm: Any) -> Callable[[str], object]:
    """The oracle's namespace: what a request's KV is computed with, its adapter's weights
    (path); a cache_salt changes nothing in the KV."""
    sched = H.scheduler(llm)

    def of(rid: str) -> object:
        lora = sched.requests[rid].lora_request
        return None if lora is None else lora.lora_path

    return of


def _tenants(first: dict[str, Any], second: dict[str, Any]) -> R.Workload:
    """``first`` runs to completion, then ``second`` (same prompt): each a dict of
    ``lora`` (name, id, adapter path) and/or ``salt``."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    def workload(llm: Any, tick: Callable[[], list[Any]]) -> dict[str, list[int]]:
        outs: dict[str, list[int]] = {}
        for rid, who in (("first", first), ("second", second)):
            prompt: dict[str, Any] = {"prompt_token_ids": PROMPT}
            if who.get("salt"):
                prompt["cache_salt"] = who["salt"]
            lora = LoRARequest(*who["lora"]) if who.get("lora") else None
            sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            llm.llm_engine.add_request(rid, prompt, sp, lora_request=lora)
            outs |= R.run_to_end(llm, tick)
        return outs

    return workload


@contextlib.contextmanager
def _reverted(*fixes: tuple[str, str, str]) -> Iterator[None]:
    import vllm.v1.core.kv_cache_utils as U

    with contextlib.ExitStack() as stack:
        for qualname, fixed, buggy in fixes:
            stack.enter_context(revert_fix(getattr(U, qualname), fixed=fixed, buggy=buggy))
        yield


LORA_PATH_KEY = ("_gen_lora_extra_hash_keys",
                 '    return [("lora", lora_request.lora_name, lora_request.lora_path)]\n',
                 "    return [lora_request.lora_name]\n")  # fmt: skip
LORA_MISSING = ("_gen_lora_extra_hash_keys",
                "    lora_request = request.lora_request\n    if not lora_request:\n"
                "        return []\n",
                "    return []\n")  # fmt: skip
SALT_TAG = ("generate_block_hash_extra_keys", '        [("cache_salt", request.cache_salt)]\n',
            "        [request.cache_salt]\n")  # fmt: skip

CASES = {
    "lora_name_only_key": ((LORA_PATH_KEY,), {"lora": ("tenant", 1, "A")},
                           {"lora": ("tenant", 2, "B")}),  # fmt: skip
    "lora_missing_from_hash": ((LORA_MISSING,), {"lora": ("A", 1, "A")}, {}),
    "salt_equals_lora_name": ((LORA_PATH_KEY, SALT_TAG), {"lora": ("SALT", 1, "A")},
                              {"salt": "SALT"}),  # fmt: skip
}


def _who(spec: dict[str, Any], adapters: dict[str, str]) -> dict[str, Any]:
    out = dict(spec)
    if "lora" in out:
        name, lid, which = out["lora"]
        out["lora"] = (name, lid, adapters[which])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_cross_tenant_prefix_hit(case: str, checkpoints: dict[str, Path], adapters: dict[str, str]) -> None:
    fixes, first, second = CASES[case]
    workload = _tenants(_who(first, adapters), _who(second, adapters))
    ckpt = checkpoints["llama"]

    def run(canary: dict[str, Any] | None, patched: bool) -> R.Run:
        return R.replay(ckpt, workload, canary=canary,
                        patch=(lambda: _reverted(*fixes)) if patched else None,
                        namespace_of=_kv_identity, **LORA)  # fmt: skip

    clean = run(CANARY, patched=False)
    assert not clean.rows and not clean.oracle.bad and clean.oracle.reads > 0, clean.rows
    buggy = run(None, patched=True)
    assert buggy.outputs["second"] != clean.outputs["second"]  # the bug fires
    assert buggy.outputs["first"] == clean.outputs["first"]
    first_bad = buggy.oracle.first_bad_step
    assert first_bad is not None
    blind = run({**CANARY, "tenant_isolation": False}, patched=True)
    assert not blind.rows  # consistent records: invisible without the namespace
    caught = run(CANARY, patched=True)
    assert caught.oracle.first_bad_step == first_bad
    assert caught.first_detection == first_bad  # in the step of the first bad read
    bad = caught.oracle.bad_slots(first_bad)
    named = caught.named_slots(first_bad)
    assert bad <= named, sorted(bad - named)  # every bad read's slot named in its own step
    rows = caught.rows[first_bad]
    assert {r.launch_tag for r in rows} >= {"HEAD_K_FULL"}
    assert all("verify_token" in r.fail_reasons for r in rows if r.slot_idx in bad)
    # (later steps also name the reader's own slots written after the hit: KV made by
    # attending to the other tenant's; explain counts those as remaps)
    assert "cross_namespace_hit" in caught.causes()
    TABLE[case] = {"fix": [f[0] for f in fixes], "first_bad_step": first_bad,
                   "detected_step": caught.first_detection, "bad_reads": len(buggy.oracle.bad),
                   "bad_slots": len(bad), "named": len(named & bad), "extra_named": len(named - bad),
                   "tags": sorted({r.launch_tag for r in rows}),
                   "reasons": sorted({x for r in rows for x in r.fail_reasons}),
                   "causes": caught.causes()}  # fmt: skip
    print(f"\n{case}: {TABLE[case]}")


@contextlib.contextmanager
def _last_token_collides() -> Iterator[None]:
    """An injected block-hash collision: blocks that differ only in their last token hash
    alike (vLLM's ``hash_block_tokens`` sees the block without it), the false prefix hit of
    a weak block hash."""
    import vllm.v1.core.kv_cache_utils as U

    original = U.hash_block_tokens

    def colliding(hash_function: Any, parent: Any, tokens: Any, extra_keys: Any = None) -> Any:
        return original(hash_function, parent, tuple(tokens)[:-1], extra_keys)

    U.hash_block_tokens = colliding
    try:
        yield
    finally:
        U.hash_block_tokens = original


def test_false_prefix_hit_names_every_slot_it_poisons(checkpoints: dict[str, Path]) -> None:
    """B's prompt is A's with block 0's last token changed: the colliding hash gives B a hit
    on A's three blocks, whose records agree with each other. The canary names position 31
    (``verify_token``) and every slot after it that B reads in that step (``verify_chain_hash``
    against B's own chain): all the slots the oracle saw read wrongly, none other."""
    other = list(PROMPT)
    other[31] = PROMPT[31] % 290 + 1
    from vllm import SamplingParams

    def workload(llm: Any, tick: Callable[[], list[Any]]) -> dict[str, list[int]]:
        outs: dict[str, list[int]] = {}
        for rid, prompt in (("first", PROMPT), ("second", other)):
            sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            outs |= R.run_to_end(llm, tick)
        return outs

    ckpt = checkpoints["llama"]
    canary = {"mode": "log", "real_data": "none"}
    clean = R.replay(ckpt, workload, canary=canary)
    assert not clean.rows and not clean.oracle.bad
    caught = R.replay(ckpt, workload, canary=canary, patch=_last_token_collides)
    assert caught.outputs["second"] != clean.outputs["second"]  # the false hit fired
    first_bad = caught.oracle.first_bad_step
    assert first_bad is not None and caught.first_detection == first_bad
    bad, named = caught.oracle.bad_slots(first_bad), caught.named_slots(first_bad)
    assert len(bad) == len(PROMPT) // H.BLOCK_SIZE * H.BLOCK_SIZE - 31  # positions 31..95
    assert named == bad, (sorted(bad - named), sorted(named - bad))
    rows = caught.rows[first_bad]
    token_rows = {r.position for r in rows if "verify_token" in r.fail_reasons}
    assert token_rows == {31}
    assert {r.fail_reasons for r in rows if r.position > 31} == {("verify_chain_hash",)}
    TABLE["block_hash_collision"] = {"first_bad_step": first_bad,
                                     "detected_step": caught.first_detection,
                                     "bad_slots": len(bad), "named": len(named & bad),
                                     "extra_named": len(named - bad)}  # fmt: skip
    print(f"\nblock_hash_collision: {TABLE['block_hash_collision']}")
