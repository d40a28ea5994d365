"""Upstream prefix-cache / retraction KV bugs replayed in our engine (issue 53).

Each replay puts a fixed upstream bug back at the site of our engine that mirrors the
upstream fix (:func:`source_patch.revert_fix`: the exact lines of our code replaced by the
bug's form) and runs a workload that triggers it, on ``builtin:tiny-mha``:

1. unpatched, canary on (log, real_data partial): no violation, and the read oracle
   (:mod:`replay_oracle`) sees no bad read;
2. patched, no canary: outputs differ from the clean run, exactly for the requests the
   oracle saw read bad KV (it also gives the first forward that did);
3. patched, canary on (log; real_data none, then partial): the outputs and bad reads of
   run 2 (log mode changes nothing); violations first reported in the forward of the
   oracle's first bad read, with real_data none too (a forward that stores over a slot it
   reads at another position fails HEAD's alias check: HEAD writes before it verifies),
   with the expected launch tags and fail reasons, naming every slot the oracle found
   foreign there (and the slot after each, whose chain no longer follows), and
   :func:`kvcanary.canary.explain.explain` naming a cause that fits the bug.

The replays (upstream links in each ``Replay``):

* **stale-protected-len**: SGLang #23392 (shared-prefix cancel + retry corrupts other
  requests; open), the mechanism found for it in PR #24193 (closed, a partial fix by its
  own account): a request's protected (tree-owned) prefix length is not refreshed when its
  prefix is matched, so releasing the request frees the tree's pages. Ours:
  ``KVManager.admit``.
* **unfinished-insert-freed-on-retract**: SGLang #38319 / PR #38355 (pages that
  ``cache_unfinished_req`` gave the tree mid-prefill are freed when the request is retracted,
  the tree keeps serving them), in place of SGLang #28254, which we could not read (see
  ``REPLACED``). Ours: ``KVManager.cache`` no longer advances ``cache_protected_len``.
* **duplicate-prefix-not-remapped**: sgl-project/mini-sglang PR #142 (a running request's
  duplicate prefix pages are freed by the cache insert, its page table still points at
  them), in place of SGLang #22819, which has no mirror here (see ``REPLACED``). Ours:
  ``KVManager.cache`` no longer re-points ``req_to_token`` to the tree's slots.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from replay_oracle import ReadOracle, canary_log
from source_patch import revert_fix

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.explain import explain
from kvcanary.engine.kv_manager import KVManager
from kvcanary.memory.errors import IntegrityError

# Upstream bugs asked for that are not replayed as such, and why.
REPLACED = {
    "sglang#28254": "could not be read: not in the stored issue corpus (searched by number "
    "and by retract / re-prefill wording) and sgl-project/sglang's snapshot (1.2 GB) is over "
    "the fetch limit; replaced by SGLang #38319 (the retracted request's re-prefill reads "
    "pages the radix tree still serves but no longer owns)",
    "sglang#22819": "no mirror: reported (open) under --enable-deterministic-inference for "
    "requests whose prefix_len equals the 64-token block; PR #22841 (no finished-request "
    "insert) did not fix it and the only root cause proposed (PR #25479, closed) is FA3's "
    "paged-KV extend numerics after a radix hit, not slot bookkeeping. Our engine has no FA3 "
    "and no deterministic split alignment, and K/V that is the right token at the right "
    "position with other rounding is nothing the canary checks; replaced by mini-sglang "
    "PR #142 (a radix prefix bug whose logic our KVManager.cache mirrors)",
}

MODEL = dict(model="builtin:tiny-mha", page_size=4, max_context_len=512, graph_batch_sizes=())


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _drain(engine: Engine, outs: dict[int, list[int]]) -> dict[int, list[int]]:
    while engine.has_unfinished():
        outs.update({o.rid: o.output_ids for o in engine.step()})
    return outs


# ------------------------------------------------------------------ workloads

_rng = random.Random(7)
_SHARED = [_rng.randrange(256) for _ in range(32)]  # 8 whole pages
_PROMPT = _SHARED + [_rng.randrange(256)]  # shared prefix + 1: decode-ready on a hit
_SHARER = _SHARED + [_rng.randrange(256) for _ in range(9)]
_OTHER = [_rng.randrange(256) for _ in range(40)]


def cancel_and_retry(engine: Engine) -> dict[int, list[int]]:
    """#23392's shape: a prompt cached by an earlier request; it is sent again (a full
    prefix hit: it decodes at once) with a request sharing the prefix and an unrelated one,
    cancelled mid-flight and retried at once."""
    engine.generate([_PROMPT], _params(4))  # caches the prefix
    first = engine.add_request(_PROMPT, _params(24))
    for prompt in (_SHARER, _OTHER):
        engine.add_request(prompt, _params(24))
    for _ in range(4):
        assert engine.step() == []
    assert engine.abort_request(first) is not None
    engine.add_request(_PROMPT, _params(24))  # the retry
    return _drain(engine, {})


def _two_prompts(seed: int, shared: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(2)]


_RETRACTED = _two_prompts(0, 0, 32, 64)
_TWINS = _two_prompts(0, 32, 12, 12)  # one 32-token prefix, prefilled in the same forward


def generate(prompts: list[list[int]], max_new_tokens: int) -> Callable[[Engine], dict[int, list[int]]]:
    def run(engine: Engine) -> dict[int, list[int]]:
        return {o.rid: o.output_ids for o in engine.generate(prompts, _params(max_new_tokens))}

    return run


# ------------------------------------------------------------------ replays


@dataclass
class Run:
    outputs: dict[int, list[int]]
    oracle: ReadOracle
    engine: Engine
    log: list[str]


@dataclass(frozen=True)
class Replay:
    upstream: str  # issue / fix links
    mechanism: str
    site: Any  # the function of ours holding the fix
    fixed: str
    buggy: str
    config: dict[str, Any]
    workload: Callable[[Engine], dict[int, list[int]]]
    check_trigger: Callable[[Run, Run], None]  # (clean, bugged): the workload hit the path
    # real_data -> the (launch tag, fail reasons) the rows reported in the forward of
    # detection may have (HEAD_MOVED, the alias check's, always among them)
    detected: dict[str, frozenset[tuple[str, tuple[str, ...]]]]
    # Whether the engine's own check_integrity() fails after the patched run (the prefix
    # cache left holding slots it no longer owns), or the damage left no structural trace.
    breaks_integrity: bool


HEAD_CHAIN = ("HEAD_K_FULL", ("verify_chain_hash",))
HEAD_MOVED = ("HEAD_K_FULL", ("verify_chain_hash", "verify_position"))
TAIL_CHAIN = ("TAIL_K_FULL", ("verify_chain_hash",))
TAIL_MOVED = ("TAIL_K_FULL", ("verify_chain_hash", "verify_position"))
TAIL_BYTES = ("TAIL_K_FULL", ("verify_real_kv_hash",))
TAIL_CHAIN_BYTES = ("TAIL_K_FULL", ("verify_chain_hash", "verify_real_kv_hash"))
HEAD_SHIFTED = ("HEAD_K_FULL", ("verify_position",))
TAIL_SHIFTED = ("TAIL_K_FULL", ("verify_position",))
RECORDS = frozenset({HEAD_CHAIN, HEAD_MOVED, HEAD_SHIFTED, TAIL_CHAIN, TAIL_MOVED, TAIL_SHIFTED})
WITH_BYTES = RECORDS | {TAIL_BYTES, TAIL_CHAIN_BYTES}
# Another request's run of slots under the reader's table: the slot holds another position
# (wrong_slot / position_shift) or the slot after it no longer chains (req_to_token_remap);
# with real data, a slot stored over within the forward that reads it shows as bytes only.
REUSED = frozenset({"wrong_slot", "position_shift", "req_to_token_remap"})
CAUSES = {"none": REUSED, "partial": REUSED | {"kv_byte_corruption"}}  # all explain() may name
TOP_CAUSES = frozenset({"wrong_slot", "position_shift"})  # the most frequent one


def _prefix_hits(clean: Run, bugged: Run) -> None:
    """The cancelled request, the sharer and the retry each matched the 32 cached tokens."""
    for run in (clean, bugged):
        assert run.engine.scheduler.stats.num_cached_prompt_tokens == 3 * len(_SHARED)


def _retracted_then_misread(clean: Run, bugged: Run) -> None:
    """Both runs retract; the bug's first bad read is the retracted request's re-prefill."""
    assert clean.oracle.retracted and bugged.oracle.retracted
    o = bugged.oracle
    first = o.bad[0]
    retracted_at = [forwards for forwards, rid in o.retracted if rid == first.rid]
    assert retracted_at and min(retracted_at) < first.forward
    assert not o.batches[first.forward - 1][0]  # an extend: the re-prefill


def _twins_prefilled_together(clean: Run, bugged: Run) -> None:
    """Neither twin hit the cache: both prefilled the shared prefix in the first forward."""
    for run in (clean, bugged):
        assert run.engine.scheduler.stats.num_cached_prompt_tokens == 0
        decode, rids = run.oracle.batches[0]
        assert not decode and len(rids) == len(_TWINS)


REPLAYS: dict[str, Replay] = {
    "stale-protected-len": Replay(
        upstream="https://github.com/sgl-project/sglang/issues/23392 (open); mechanism: "
        "https://github.com/sgl-project/sglang/pull/24193 (closed)",
        mechanism="the prefix match leaves the request's protected (tree-owned) length stale, "
        "so releasing the cancelled request frees the tree's prefix pages; decodes reuse them "
        "while the tree still serves them to the concurrent sharer and the retry",
        site=KVManager.admit,
        fixed="req.kv_len = req.cache_protected_len = prefix_len",
        buggy="req.kv_len = prefix_len",
        config=dict(max_total_tokens=128),
        workload=cancel_and_retry,
        check_trigger=_prefix_hits,
        breaks_integrity=True,
        detected={"none": RECORDS, "partial": WITH_BYTES},
    ),
    "unfinished-insert-freed-on-retract": Replay(
        upstream="https://github.com/sgl-project/sglang/issues/38319, fix "
        "https://github.com/sgl-project/sglang/pull/38355 (open); replaces "
        "https://github.com/sgl-project/sglang/issues/28254",
        mechanism="cache() gives the tree each prefilled chunk but leaves the protected length "
        "behind, so retraction frees the pages the tree now owns; the retracted request's "
        "re-prefill matches its own cached prefix over pages the allocator handed out again",
        site=KVManager.cache,
        fixed="req.cache_protected_len = match.num_tokens",
        buggy="pass",
        config=dict(max_total_tokens=128, chunked_prefill_size=16),
        workload=generate(_RETRACTED, 24),
        check_trigger=_retracted_then_misread,
        breaks_integrity=True,
        detected={"none": RECORDS, "partial": WITH_BYTES},
    ),
    "duplicate-prefix-not-remapped": Replay(
        upstream="https://github.com/sgl-project/mini-sglang/pull/142 (open); replaces "
        "https://github.com/sgl-project/sglang/issues/22819",
        mechanism="two requests prefill the same prefix in one forward; caching the second "
        "frees its duplicate pages but its req->token row is not re-pointed at the tree's, "
        "so it goes on reading pages the allocator hands out again",
        site=KVManager.cache,
        fixed="self.req_to_token[req.req_pool_idx, : match.num_tokens] = "
        "match.device_indices.to(torch.int32)",
        buggy="pass",
        config=dict(max_total_tokens=128),
        workload=generate(_TWINS, 40),
        check_trigger=_twins_prefilled_together,
        breaks_integrity=False,
        detected={"none": RECORDS, "partial": WITH_BYTES},
    ),
}

# Module-level record of every replay's measurements; test_replay asserts on its entry.
RESULTS: dict[str, dict[str, Any]] = {}


@contextlib.contextmanager
def _patched(replay: Replay, bug: bool) -> Iterator[None]:
    if not bug:
        yield
        return
    with revert_fix(replay.site, fixed=replay.fixed, buggy=replay.buggy):
        yield


def _run(replay: Replay, *, bug: bool, real_data: str | None) -> Run:
    canary = {} if real_data is None else {"canary": CanaryConfig(mode="log", real_data=real_data)}
    engine = Engine(EngineConfig(**MODEL, **replay.config, **canary))
    oracle = ReadOracle(engine).attach()
    with _patched(replay, bug), canary_log() as log:
        outputs = replay.workload(engine)
        if engine.canary is not None:
            engine.canary.flush()
    return Run(outputs, oracle, engine, log)


def _summary(run: Run) -> dict[str, Any]:
    """What a run measured (kept in RESULTS)."""
    o = run.oracle
    rows = run.engine.canary.violations if run.engine.canary is not None else []
    first = min((row.step for row in rows), default=None)
    at_first = [row for row in rows if row.step == first]
    return {
        "outputs": run.outputs,
        "forwards": o.forwards,
        "reads": o.reads,
        "bad_reads": len(o.bad),
        "foreign_reads": len(o.foreign()),
        "first_bad_forward": o.first_bad_forward,
        "first_bad_in": None if not o.bad else "decode" if o.batches[o.bad[0].forward - 1][0] else "extend",
        "first_bad_rids": sorted({b.rid for b in o.bad if b.forward == o.first_bad_forward}),
        "foreign_slots_first": sorted(o.foreign_slots(o.first_bad_forward)) if o.bad else [],
        "bad_rids": sorted(o.bad_rids()),
        "retracted": o.retracted,
        "violations": len(rows),
        "first_violation_step": first,
        "detected": sorted({(row.launch_tag, row.fail_reasons) for row in at_first}),
        "slots_first": sorted({row.slot_idx for row in at_first}),
        "slots_all": sorted({row.slot_idx for row in rows}),
        "foreign_slots_all": sorted(o.foreign_slots()),
        "causes": [c["cause"] for c in explain("\n".join(run.log))["causes"]] if rows else [],
    }


def _detection(run: Run) -> tuple[int, list[Any]]:
    """The forward whose rows the canary reported first, and those rows."""
    rows = run.engine.canary.violations if run.engine.canary is not None else []
    assert rows, "the canary reported nothing"
    first = min(row.step for row in rows)
    return first, [row for row in rows if row.step == first]


@pytest.mark.parametrize("name", list(REPLAYS))
def test_replay(name: str) -> None:
    replay = REPLAYS[name]
    clean = _run(replay, bug=False, real_data="partial")
    bugged = _run(replay, bug=True, real_data=None)
    detected = {rd: _run(replay, bug=True, real_data=rd) for rd in ("none", "partial")}
    r = RESULTS[name] = {"clean": _summary(clean), "bugged": _summary(bugged)}
    for rd, run in detected.items():
        r[f"canary-{rd}"] = _summary(run)
    replay.check_trigger(clean, bugged)

    # 1. unpatched: the canary is silent and nothing read bad KV.
    assert r["clean"]["violations"] == 0 and r["clean"]["bad_reads"] == 0
    assert clean.engine.canary is not None and clean.engine.canary.stats()["verify_overflow_steps"] == 0
    clean.engine.check_integrity()

    # 2. patched, no canary: the bug fires; the outputs that changed are exactly those of
    # the requests the oracle saw read KV that was not theirs.
    b = r["bugged"]
    assert b["foreign_reads"] > 0 and b["first_bad_forward"] is not None
    assert b["outputs"].keys() == r["clean"]["outputs"].keys()
    changed = {rid for rid, out in b["outputs"].items() if out != r["clean"]["outputs"][rid]}
    assert changed and changed == set(b["bad_rids"])
    if replay.breaks_integrity:
        with pytest.raises(IntegrityError, match="RadixCache: a slot is held by two nodes"):
            bugged.engine.check_integrity()
    else:
        bugged.engine.check_integrity()

    # 3. patched, canary on: nothing changes but the log; detection in the forward the
    # oracle says, naming its foreign slots (and the slot after each, whose chain no longer
    # follows), with the expected tags / reasons and a fitting cause.
    for rd, run in detected.items():
        d, o = r[f"canary-{rd}"], run.oracle
        assert d["outputs"] == b["outputs"] and o.bad == bugged.oracle.bad
        step, rows = _detection(run)
        assert step == o.first_bad_forward
        d["lag"] = step - o.first_bad_forward
        at = o.foreign(step)
        named = {row.slot_idx for row in rows}
        assert {x.slot for x in at} <= named <= {x.slot for x in at} | {
            x.next_slot for x in at
        }
        seen = {(row.launch_tag, row.fail_reasons) for row in rows}
        assert HEAD_MOVED in seen and seen <= replay.detected[rd], seen
        assert set(d["slots_all"]) >= set(d["foreign_slots_all"])
        causes = d["causes"]
        assert causes[0] in TOP_CAUSES and set(causes) <= CAUSES[rd]
