"""``kvcanary bench spec``: speculative decoding side by side in one run.

Variants, one engine each (built once, the same seeded weights)::

    plain            no speculation (the reference outputs and tok/s)
    ngram            prompt lookup, K drafts a step
    draft:<model>    a draft model (--draft-models, comma-separated), K drafts a step

each also with the canary in ``log`` mode (``+canary``: both canaries, the draft model's
too), unless ``--no-canary``. Two workloads: ``repetitive`` (prompts of a short pattern
repeated, the case prompt lookup is made for) and ``random`` (random prompts: what a
proposer earns when nothing repeats). Each repeat draws new prompts and runs every
variant on them, in an order rotated every repeat; figures are medians over repeats:
decode tok/s = new tokens / generate seconds, speed-up = variant tok/s / plain tok/s in
the same repeat, acceptance = drafts accepted / proposed, accepted per verify = accepted
drafts / request-steps that drafted, forward reduction = the target's decode (and verify)
forwards of plain decoding / the variant's (what speculation saves where a forward costs
the same for 1 and K + 1 tokens a request: a GPU's memory-bound decode), drafting % = the
share of the time spent proposing, and the canary's cost with speculation = variant +
canary seconds / variant seconds - 1. Greedy outputs must equal plain decoding's
(``outputs_identical``), and the canaries must stay silent (``violations``).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from kvcanary.bench.engines import shared_decoder
from kvcanary.config import CanaryConfig, EngineConfig, SamplingParams, SpeculativeConfig
from kvcanary.engine.engine import Engine
from kvcanary.utils import show

WORKLOADS = ("repetitive", "random")


@dataclass(frozen=True)
class SpecBenchSpec:
    model: str = "builtin:tiny-swa"
    draft_models: tuple[str, ...] = ("builtin:tiny-swa", "builtin:tiny-mha")
    num_speculative_tokens: int = 4
    batch: int = 8
    input_len: int = 96
    output_len: int = 96
    repeats: int = 3
    workloads: tuple[str, ...] = WORKLOADS
    canary: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "batch", "input_len", "output_len", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}={show(value)} is invalid: allowed an integer >= 1")
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            raise ValueError(f"--workloads={show(','.join(self.workloads))} is invalid: allowed "
                             f"a comma-separated subset of {', '.join(WORKLOADS)}")  # fmt: skip


def make_workload(kind: str, batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``input_len`` tokens: ``repetitive`` ones repeat a pattern of 4-8
    random tokens (with one random token every 16, so they are not periodic throughout);
    ``random`` ones are random."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        if kind == "repetitive":
            pat = [rng.randrange(vocab) for _ in range(rng.randint(4, 8))]
            ids = [pat[i % len(pat)] if i % 16 else rng.randrange(vocab) for i in range(input_len)]
        else:
            ids = [rng.randrange(vocab) for _ in range(input_len)]
        prompts.append(ids)
    return prompts


def _variants(spec: SpecBenchSpec) -> dict[str, SpeculativeConfig]:
    k = spec.num_speculative_tokens
    out = {"plain": SpeculativeConfig(),
           "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=k)}  # fmt: skip
    for m in spec.draft_models:
        out[f"draft:{m}"] = SpeculativeConfig(method="draft", num_speculative_tokens=k,
                                              draft_model=m)  # fmt: skip
    return out


def bench_spec(base: EngineConfig, spec: SpecBenchSpec, progress: bool = True) -> dict[str, Any]:
    """Run every variant on every workload (module doc); the summary with ``rows`` (one per
    workload x variant)."""
    variants = _variants(spec)
    sp = SamplingParams(max_new_tokens=spec.output_len, ignore_eos=True)
    engines: dict[str, Engine] = {}
    with shared_decoder():  # one set of weights per model, every engine on it
        for name, sc in variants.items():
            cfg = replace(base, model=spec.model, speculative=sc, canary=CanaryConfig())
            engines[name] = Engine(cfg)
            if spec.canary and name != "plain":
                engines[name + "+canary"] = Engine(replace(cfg, canary=CanaryConfig(mode="log")))
    vocab = engines["plain"].runner.vocab_size
    names = list(engines)
    # Warm every engine once (compiles, first-touch), outside the timed repeats.
    warm = make_workload("repetitive", 2, min(spec.input_len, 32), vocab, seed=spec.seed - 1)
    for e in engines.values():
        e.generate(warm, SamplingParams(max_new_tokens=8, ignore_eos=True))
    seconds: dict[tuple[str, str], list[float]] = {}
    counts: dict[tuple[str, str], list[tuple[int, int, int, int, float]]] = {}
    identical: dict[tuple[str, str], bool] = {}
    total = len(spec.workloads) * spec.repeats * len(names)
    bar = tqdm(total=total, desc="bench spec", unit="run", disable=not progress)
    for w in spec.workloads:
        for rep in range(spec.repeats):
            prompts = make_workload(w, spec.batch, spec.input_len, vocab,
                                    seed=spec.seed + 1000 * rep + WORKLOADS.index(w))  # fmt: skip
            order = names[rep % len(names):] + names[: rep % len(names)]
            outs: dict[str, list[list[int]]] = {}
            for name in order:
                e = engines[name]
                st0 = e.stats
                before = (st0.spec_num_proposed, st0.spec_num_accepted, st0.spec_num_drafted_reqs,
                          st0.num_decode_forwards, st0.spec_draft_time_s)  # fmt: skip
                bar.set_postfix_str(f"{w} {name}")
                t0 = time.perf_counter()
                res = e.generate(prompts, sp)
                seconds.setdefault((w, name), []).append(time.perf_counter() - t0)
                st = e.stats
                counts.setdefault((w, name), []).append((
                    st.spec_num_proposed - before[0], st.spec_num_accepted - before[1],
                    st.spec_num_drafted_reqs - before[2], st.num_decode_forwards - before[3],
                    st.spec_draft_time_s - before[4]))  # fmt: skip
                outs[name] = [o.output_ids for o in res]
                bar.update(1)
            for name in names:
                same = outs[name] == outs["plain"]
                identical[(w, name)] = identical.get((w, name), True) and same
    bar.close()
    new_tokens = spec.batch * spec.output_len
    rows = []
    for w in spec.workloads:
        plain = seconds[(w, "plain")]
        plain_forwards = sum(c[3] for c in counts[(w, "plain")])
        for name in names:
            secs = seconds[(w, name)]
            proposed, accepted, drafted, forwards = (sum(c[i] for c in counts[(w, name)])
                                                     for i in range(4))  # fmt: skip
            drafting = sum(c[4] for c in counts[(w, name)])
            row: dict[str, Any] = {
                "workload": w, "variant": name,
                "decode_tok_s": round(new_tokens / statistics.median(secs), 1),
                "speedup_vs_plain": round(statistics.median(
                    p / s for p, s in zip(plain, secs, strict=True)), 3),
                "acceptance": round(accepted / proposed, 3) if proposed else None,
                "accepted_per_verify": round(accepted / drafted, 2) if drafted else None,
                "decode_forwards": forwards,
                "forward_reduction": round(plain_forwards / forwards, 2) if forwards else None,
                "drafting_pct": round(100 * drafting / sum(secs), 1),
                "outputs_identical": identical[(w, name)],
            }  # fmt: skip
            row["canary_overhead_pct"] = None  # (every row: the table's columns)
            if name.endswith("+canary"):
                off = seconds[(w, name.removesuffix("+canary"))]
                row["canary_overhead_pct"] = round(100 * (statistics.median(
                    s / o for s, o in zip(secs, off, strict=True)) - 1), 1)  # fmt: skip
            rows.append(row)
    violations = {name: sum(len(c.violations) for c in e.canaries)
                  for name, e in engines.items() if e.canaries}  # fmt: skip
    integrity = all(e.check_integrity() for e in engines.values())
    return {
        "bench": "spec", "model": spec.model, "draft_models": list(spec.draft_models),
        "num_speculative_tokens": spec.num_speculative_tokens, "batch": spec.batch,
        "input_len": spec.input_len, "output_len": spec.output_len, "repeats": spec.repeats,
        "method": "median over repeats; speed-up and canary cost paired within a repeat",
        "outputs_identical": all(r["outputs_identical"] for r in rows),
        "violations": violations, "integrity_ok": integrity, "rows": rows,
    }  # fmt: skip
