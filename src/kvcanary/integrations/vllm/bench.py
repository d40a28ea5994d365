"""vLLM with and without the canary connector, side by side on one workload:
``python -m kvcanary.integrations.vllm.bench [--model DIR] [--json OUT]``.

Spawned processes, one engine each (vLLM keeps one connector per process), all kept
warm; the passes alternate between them for ``--rounds`` rounds, each round starting with
the next engine, so interference from other jobs on a shared machine hits them alike. The
best (minimum) time of each pass counts, and the median over the rounds of each round's
ratio of two engines' times (``paired``). Passes: prefill (``max_tokens=1``) and full
(``max_tokens=--output-len``), each on a reset prefix cache; decode tok/s = generated
tokens after the first / (full - prefill). Outputs of the plain and canary engines must be
identical. With ``--control`` (default) a second plain engine, spawned first, runs the
same passes: its difference from plain is the noise floor of the overhead figures on
this machine (``noise_floor``), and its outputs must equal plain's
(``control_outputs_identical``: greedy decoding is deterministic).
With ``--connector-control`` (default) an engine with a KV connector that does nothing
(:mod:`.noop`) runs them too: its difference from plain is what vLLM's connector interface
costs, the canary's against it what the canary adds (``connector_control``).

Without ``--model`` a tiny random Llama checkpoint (fp32, 4 layers, hidden 64, head_dim 32)
is written to a temporary directory. Needs the vLLM venv (``make test-vllm`` builds it);
set ``VLLM_CPU_KVCACHE_SPACE`` on CPU-only machines.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def write_tiny_llama(root: Path, hidden: int = 64, layers: int = 4) -> Path:
    """A small random Llama checkpoint (no tokenizer: ids in, ids out); head_dim 32 (the
    CPU attention has no kernel for 16), hidden // 32 query heads, half as many KV heads."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(2, hidden // 32),
        num_key_value_heads=max(1, hidden // 64), head_dim=32, max_position_embeddings=1024,
        bos_token_id=318, eos_token_id=319, tie_word_embeddings=True, initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    out = root / f"llama-h{hidden}-l{layers}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def _serve(args: dict[str, Any], conn: Any) -> None:
    """One engine in a spawned process, kept warm: answers ("prefill" | "full") with the
    seconds one generate took (and the outputs), "stats" with the canary's counters."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=args["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        seed=0, max_model_len=args["max_model_len"], block_size=args["block_size"],
        disable_log_stats=True,
    )  # fmt: skip
    if args["canary"] is not None:
        kw["kv_transfer_config"] = {"kv_connector": "KVCanaryConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": args["canary"]}  # fmt: skip
    elif args["noop"]:
        from kvcanary.integrations.vllm import noop

        noop.register()
        kw["kv_transfer_config"] = {"kv_connector": noop.NAME, "kv_role": "kv_both"}
    llm = LLM(**kw)
    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]

    def hook_seconds() -> dict[str, float]:
        """The canary's hook seconds so far (worker and scheduler sides)."""
        if args["canary"] is None:
            return {}
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        return {**get_kv_transfer_group().seconds, **sched.seconds}

    def gen(max_tokens: int) -> tuple[float, list[list[int]], dict[str, float]]:
        """One pass: its seconds, outputs and the canary's hook seconds in it."""
        llm.reset_prefix_cache()  # every pass computes its prompts
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        before = hook_seconds()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        hooks = {k: v - before.get(k, 0.0) for k, v in hook_seconds().items()}
        return seconds, [list(o.outputs[0].token_ids) for o in outs], hooks

    gen(4)  # warm-up (numba loads / compiles its kernels, allocator warm)
    if args["canary"] is not None:  # count the canary's time from here on
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().seconds.clear()
        llm.llm_engine.engine_core.engine_core.scheduler.connector.seconds.clear()
    conn.send("ready")
    engine_steps = [0]
    step = llm.llm_engine.step

    def counting_step() -> Any:
        engine_steps[0] += 1
        return step()

    llm.llm_engine.step = counting_step
    while (cmd := conn.recv()) != "stop":
        if cmd == "stats":
            stats: dict[str, Any] = {}
            if args["canary"] is not None:
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                connector = get_kv_transfer_group()
                worker = connector.worker
                worker.flush()
                s = worker.stats()
                stats = {k: s[k] for k in ("verify_entries", "write_entries", "violations",
                                           "steps")}  # fmt: skip
                sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
                seconds = {**connector.seconds, **sched.seconds}
                stats["ms_per_step"] = {k: round(1e3 * v / max(s["steps"] - 2, 1), 4)
                                        for k, v in sorted(seconds.items())}  # fmt: skip
            stats["engine_steps"] = engine_steps[0]
            from vllm.distributed.kv_transfer.kv_transfer_state import (
                get_kv_transfer_group,
                has_kv_transfer_group,
            )

            stats["kv_connector"] = (type(get_kv_transfer_group()).__name__
                                     if has_kv_transfer_group() else None)  # fmt: skip
            conn.send(stats)
        else:
            conn.send(gen(1 if cmd == "prefill" else args["output_len"]))


def add_bench_vllm_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of ``kvcanary bench vllm`` (importable without vLLM)."""
    d = "(default: %(default)s)"
    ap.add_argument("--model", help="HF checkpoint dir (default: a random tiny Llama)")
    ap.add_argument("--hidden-size", type=int, default=64, help=f"random Llama: hidden size {d}")
    ap.add_argument("--num-layers", type=int, default=4, help=f"random Llama: layers {d}")
    ap.add_argument("--num-prompts", type=int, default=16, help=f"prompts per pass {d}")
    ap.add_argument("--input-len", type=int, default=128, help=f"tokens per prompt {d}")
    ap.add_argument("--output-len", type=int, default=64, help=f"new tokens per prompt {d}")
    ap.add_argument("--block-size", type=int, default=32, help=f"vLLM KV block size {d}")
    ap.add_argument("--rounds", type=int, default=30,
                    help="alternating passes per engine: the best time of each counts, and "
                         f"the median of each round's ratio (paired) {d}")  # fmt: skip
    ap.add_argument("--canary", default='{"mode": "log"}',
                    help=f"kv_connector_extra_config of the canary engine, as JSON {d}")
    ap.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                    help="also run a second plain engine; its difference from the first is "
                         f"the noise floor of the overhead figures {d}")  # fmt: skip
    ap.add_argument("--connector-control", action=argparse.BooleanOptionalAction, default=True,
                    help="also run an engine with a KV connector that does nothing: what "
                         f"vLLM's connector interface costs, told from the canary's {d}")  # fmt: skip
    ap.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT")


def check_bench_vllm_args(a: argparse.Namespace) -> None:
    """Bad values: one line naming the flag, the value and what is allowed."""
    for flag in ("hidden_size", "num_layers", "num_prompts", "input_len", "output_len",
                 "block_size", "rounds"):  # fmt: skip
        value = getattr(a, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={value} is invalid: allowed an integer >= 1")
    if a.output_len < 2:
        raise ValueError(f"--output-len={a.output_len} is invalid: allowed an integer >= 2")
    try:
        canary = json.loads(a.canary)
    except json.JSONDecodeError as e:
        raise ValueError(f"--canary={a.canary!r} is invalid: allowed a JSON object ({e})") from None
    if not isinstance(canary, dict):
        raise ValueError(f"--canary={a.canary!r} is invalid: allowed a JSON object")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_vllm_flags(ap)
    a = ap.parse_args(argv)
    try:
        check_bench_vllm_args(a)
    except ValueError as e:
        ap.error(str(e))
    result = bench_vllm(a)
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0 if result["outputs_identical"] else 1


def bench_vllm(a: argparse.Namespace) -> dict[str, Any]:
    """Run the side-by-side benchmark (see the module doc); the result as a dict."""
    tmp = tempfile.TemporaryDirectory()
    model = a.model or str(write_tiny_llama(Path(tmp.name), a.hidden_size, a.num_layers))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 300) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    base = {"model": model, "prompts": prompts, "output_len": a.output_len,
            "block_size": a.block_size, "max_model_len": a.input_len + a.output_len + 64}  # fmt: skip
    canary = json.loads(a.canary)
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    # The control first: the engine spawned first runs its passes slower than the others
    # (on the 2-core Xeon VM, 2026-12-07: 10-30 % a prefill pass, up to 7 % a decode,
    # whichever engine it is), and the control's difference from plain is where it shows.
    engines: list[tuple[str, dict[str, Any] | None]] = [("plain", None), ("canary", canary)]
    if a.control:
        engines.insert(0, ("control", None))
    if a.connector_control:
        engines.append(("connector", None))
    for name, extra in engines:
        parent, child = ctx.Pipe()
        args = {**base, "canary": extra, "noop": name == "connector"}
        proc = ctx.Process(target=_serve, args=(args, child))
        proc.start()
        procs.append(proc)
        assert parent.recv() == "ready"
        pipes[name] = parent
    times: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "full": []} for n in pipes}
    hooks: dict[str, list[dict[str, float]]] = {"prefill": [], "full": []}  # canary, per pass
    outputs: dict[str, list[list[int]]] = {}
    names = list(pipes)
    for r in range(a.rounds):  # alternate, so interference from other jobs hits both
        # Each round starts with the next engine: the first of a round waited longest
        # (through the others' full passes) and runs slower for it.
        order = names[r % len(names):] + names[: r % len(names)]
        for kind in ("prefill", "full"):
            for name in order:
                pipe = pipes[name]
                pipe.send(kind)
                seconds, outs, pass_hooks = pipe.recv()
                times[name][kind].append(seconds)
                if name == "canary":
                    hooks[kind].append(pass_hooks)
                if kind == "full":
                    outputs.setdefault(name, outs)
                    if outs != outputs[name]:
                        outputs[name] = []  # nondeterministic: never identical
    stats = {}
    for name, pipe in pipes.items():
        pipe.send("stats")
        stats[name] = pipe.recv()
        pipe.send("stop")
    for proc in procs:
        proc.join(timeout=60)
    n_in = sum(len(p) for p in prompts)
    n_out = len(prompts) * (a.output_len - 1)
    result: dict[str, Any] = {
        "workload": {k: getattr(a, k) for k in ("num_prompts", "input_len", "output_len",
                                                "block_size", "rounds", "hidden_size",
                                                "num_layers")},  # fmt: skip
        "model": a.model or "random Llama (write_tiny_llama)",
        "canary_options": canary,
        "outputs_identical": bool(outputs["plain"]) and outputs["plain"] == outputs["canary"],
        "canary_stats": stats["canary"],
        "plain_engine_steps": stats["plain"]["engine_steps"],
        "method": "best of --rounds alternating passes (min seconds); decode = "
                  "(output tokens - 1 per prompt) / (full pass - prefill pass)",
    }
    result.update(tok_s_figures(times, n_in, n_out))
    if a.control:
        # Greedy decoding of one checkpoint: two plain engines agree, or the canary's
        # outputs_identical means little on this machine.
        result["control_outputs_identical"] = bool(outputs["plain"]) and (
            outputs["plain"] == outputs["control"])  # fmt: skip
    if a.connector_control:
        result["connector_outputs_identical"] = bool(outputs["plain"]) and (
            outputs["plain"] == outputs["connector"])  # fmt: skip
        result["connector_stats"] = stats["connector"]
    result["per_step"] = hook_shares(times, hooks, a.output_len)
    result["seconds"] = {n: {k: [round(x, 4) for x in v] for k, v in t.items()}
                         for n, t in times.items()}  # fmt: skip
    tmp.cleanup()
    return result


def tok_s_figures(times: dict[str, dict[str, list[float]]], n_in: int,
                  n_out: int) -> dict[str, Any]:  # fmt: skip
    """Prefill and decode tok/s of each engine's best passes (``times[engine][pass]``:
    seconds; decode = ``n_out`` tokens / (full - prefill)): the canary's overhead against
    plain; with a ``control`` engine the two plain engines' difference (``noise_floor``);
    with a ``connector`` engine (a KV connector that does nothing) its cost against plain
    and the canary's against it (``connector_control``)."""
    out: dict[str, Any] = {}
    noise: dict[str, Any] = {}
    connector: dict[str, Any] = {}
    for key, rate in (
        ("prefill_tok_s", lambda t: n_in / min(t["prefill"])),
        ("decode_tok_s", lambda t: n_out / max(min(t["full"]) - min(t["prefill"]), 1e-9)),
    ):
        plain, with_canary = rate(times["plain"]), rate(times["canary"])
        out[key] = {"plain": round(plain, 1), "canary": round(with_canary, 1),
                    "overhead_pct": round(100 * (plain / with_canary - 1), 1)}  # fmt: skip
        if "control" in times:  # the same formula between two plain engines
            control = rate(times["control"])
            noise[key] = {"plain": round(plain, 1), "control": round(control, 1),
                          "difference_pct": round(100 * (plain / control - 1), 1)}  # fmt: skip
        if "connector" in times:
            bare = rate(times["connector"])
            connector[key] = {"plain": round(plain, 1), "connector": round(bare, 1),
                              "interface_pct": round(100 * (plain / bare - 1), 1),
                              "canary_beyond_interface_pct": round(100 * (bare / with_canary - 1), 1)}  # fmt: skip
    if noise:
        out["noise_floor"] = noise
    if connector:
        out["connector_control"] = connector
    out["paired"] = paired_overheads(times)
    return out


def paired_overheads(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Each engine's time against another's in the same round, the median over the rounds
    (``times[engine][pass]``: seconds, one a round; decode = full - prefill of the round):
    prefill and decode, the canary, the control and the connector control against plain,
    and the canary against the connector control. The passes of one round run back to
    back, so a slow spell of the machine that lasts longer than a round slows both sides
    of each ratio, where the best passes (:func:`tok_s_figures`) may come from different
    spells. They settle with ~30 rounds; the control's then shows the machine's noise and
    how much slower the engine spawned first runs (:func:`bench_vllm`)."""
    def seconds(engine: str, kind: str) -> list[float]:
        t = times[engine]
        return t["prefill"] if kind == "prefill" else _round_decode_seconds(t)

    pairs = [(name, "plain") for name in ("canary", "control", "connector") if name in times]
    if "connector" in times:
        pairs.append(("canary", "connector"))
    out: dict[str, Any] = {}
    for kind in ("prefill", "decode"):
        out[f"{kind}_pct"] = {
            f"{a}_vs_{b}": round(100 * (statistics.median(
                x / y for x, y in zip(seconds(a, kind), seconds(b, kind), strict=True)) - 1), 1)
            for a, b in pairs
        }  # fmt: skip
    out["rounds"] = len(times["plain"]["full"])
    return out


def _round_decode_seconds(t: dict[str, list[float]]) -> list[float]:
    """An engine's decode seconds in each round: its full pass less its prefill pass."""
    return [max(f - p, 1e-9) for f, p in zip(t["full"], t["prefill"], strict=True)]


def _hook_decode_seconds(full: dict[str, float], prefill: dict[str, float]) -> dict[str, float]:
    """Each hook's decode seconds: its full-pass seconds less its prefill-pass seconds,
    floored at 0."""
    return {k: max(v - prefill.get(k, 0.0), 0.0) for k, v in full.items()}


def hook_shares(times: dict[str, dict[str, list[float]]],
                hooks: dict[str, list[dict[str, float]]], output_len: int) -> dict[str, Any]:  # fmt: skip
    """Where the time goes, measured inside the canary engine's own passes: each hook's
    best (minimum over the passes: interference only adds) seconds in a prefill pass and
    in a full pass; a decode step's share = (full - prefill) / decode steps, against the
    plain engine's best milliseconds per decode step; the prefill pass's share against the
    plain engine's best prefill pass. The ``paired_*`` shares: each round's hook seconds
    against the plain engine's passes of the same round, the median over the rounds."""
    steps = max(output_len - 1, 1)
    plain_step_ms = 1e3 * (min(times["plain"]["full"]) - min(times["plain"]["prefill"])) / steps
    best = {kind: {k: min(p.get(k, 0.0) for p in passes) for k in passes[0]} if passes else {}
            for kind, passes in hooks.items()}  # fmt: skip
    decode = {k: v * 1e3 / steps
              for k, v in _hook_decode_seconds(best["full"], best["prefill"]).items()}  # fmt: skip
    prefill_ms = 1e3 * sum(best["prefill"].values())
    decode_ms = sum(decode.values())
    plain_prefill_ms = 1e3 * min(times["plain"]["prefill"])
    # Paired: each round's hook seconds against the plain engine's passes of that round
    # (the best passes above may come from different spells of a shared machine).
    plain, pre_hooks, full_hooks = times["plain"], hooks["prefill"], hooks["full"]
    paired_decode = statistics.median(
        sum(_hook_decode_seconds(f, p).values()) / plain_decode
        for f, p, plain_decode in zip(full_hooks, pre_hooks, _round_decode_seconds(plain),
                                      strict=True)
    ) if full_hooks else 0.0  # fmt: skip
    paired_prefill = statistics.median(
        sum(p.values()) / max(pp, 1e-9) for p, pp in zip(pre_hooks, plain["prefill"], strict=True)
    ) if pre_hooks else 0.0  # fmt: skip
    return {"plain_decode_step_ms": round(plain_step_ms, 3),
            "canary_decode_ms": {k: round(v, 4) for k, v in sorted(decode.items())},
            "canary_decode_total_ms": round(decode_ms, 3),
            "canary_vs_plain_decode_step_pct": round(100 * decode_ms / plain_step_ms, 1),
            "paired_canary_vs_plain_decode_step_pct": round(100 * paired_decode, 1),
            "plain_prefill_pass_ms": round(plain_prefill_ms, 3),
            "canary_prefill_pass_ms": round(prefill_ms, 3),
            "canary_vs_plain_prefill_pct": round(100 * prefill_ms / plain_prefill_ms, 1),
            "paired_canary_vs_plain_prefill_pct": round(100 * paired_prefill, 1)}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
