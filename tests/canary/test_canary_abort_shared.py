"""Abort mode when a fault makes requests share KV: every request referencing a violating
slot is aborted, each page is freed once (never one a surviving request or the prefix cache
still holds), and the engine keeps serving.

Faults are written straight into engine state (not through the perturb module), between
steps, once every wave-2 request is decoding and owns a couple of whole pages past its
tree-owned prompt. Each run is compared with a clean run of the same workload: the expected
aborted set comes from the req→token rows at fault time (who references the target), the
survivors must produce the clean run's tokens, memory must stay sound, and a fresh batch
afterwards must be served as in the clean run without a new violation.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from engine_utils import make_prompts, tiny_engine

from kvcanary import Engine, RequestOutput, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.wire.constants import CANARY_FIELD_POSITION, PoolKind
from kvcanary.canary.wire.records import as_int64_records
from kvcanary.engine.request import Req
from kvcanary.memory.allocator import PagedAllocator
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.swa_allocator import SWAAllocator

MODELS = ["builtin:tiny-mha", "builtin:tiny-swa"]
PAGE_SIZES = [1, 4]
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)  # greedy

_rng = random.Random(11)
SHARED = [_rng.randrange(256) for _ in range(48)]
# Wave 1 runs to completion first: its KV stays in the prefix cache, unlocked.
WAVE1 = [SHARED, [_rng.randrange(256) for _ in range(20)]]
# Wave 2: A and B distinct, C matches wave 1's SHARED (C locks that tree node).
WAVE2 = [
    [_rng.randrange(256) for _ in range(41)],
    [_rng.randrange(256) for _ in range(45)],
    SHARED + [_rng.randrange(256) for _ in range(11)],
]
LATE = [_rng.randrange(256) for _ in range(17)]  # D: admitted right after the fault
FRESH = make_prompts(3, 18, 30, seed=21)  # served once everything else finished


@dataclass(frozen=True)
class Workload:
    """An engine and the waves it serves (module doc): wave 1 to completion, wave 2's three
    requests A, B, C decoding ``num_decode_steps`` steps, the fault, then D (``late``), and
    ``fresh`` once everything else finished."""

    model: str
    page_size: int
    wave1: tuple[tuple[int, ...], ...]
    wave2: tuple[tuple[int, ...], ...]
    late: tuple[int, ...]
    fresh: tuple[tuple[int, ...], ...]
    num_decode_steps: int
    max_total_tokens: int = 2048
    swa_full_tokens_ratio: float = 0.25


def workload(model: str, page_size: int) -> Workload:
    """The FULL / SWA pools' workload: A, B and C own 2+ whole pages past their prompts."""
    t = lambda ps: tuple(tuple(p) for p in ps)  # noqa: E731
    return Workload(model, page_size, t(WAVE1), t(WAVE2), tuple(LATE), t(FRESH),
                    2 * page_size + 3)  # fmt: skip


@dataclass
class Target:
    """What a fault corrupts: full-pool slots, SWA-pool slots, and (``rows``) rows of the
    compressed / compress-state groups of a DeepSeek-V4 pool, by kind name (``"C4"``,
    ``"C128_STATE"``, ...)."""

    full: list[int] = field(default_factory=list)
    swa: list[int] = field(default_factory=list)
    holders: int = 1  # running requests that reference them once the fault is complete
    rows: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Run:
    outs: dict[int, RequestOutput]
    fresh: list[list[int]]
    rids: list[int]  # A, B, C, D
    target: Target | None
    expected: set[int]  # aborted set computed from the rows at fault time
    aborted: list[int]
    engine: Engine


# ------------------------------------------------------------------ engine state helpers


def _engine(w: Workload) -> Engine:
    return tiny_engine(model=w.model, page_size=w.page_size, max_total_tokens=w.max_total_tokens,
                       swa_full_tokens_ratio=w.swa_full_tokens_ratio,
                       canary=CanaryConfig(mode="abort", real_data="partial"))  # fmt: skip


def _req(engine: Engine, rid: int) -> Req:
    return next(r for r in engine.scheduler.running if r.rid == rid)


def _slots(engine: Engine, req: Req) -> torch.Tensor:
    return engine.kv.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)


def _own(engine: Engine, rid: int, offset: int) -> tuple[Req, int]:
    """(request, position) ``offset`` past the start of its own (not tree-owned) slots."""
    req = _req(engine, rid)
    pos = req.cache_protected_len + offset
    assert pos < req.kv_len - 1, "the request owns too few slots: decode longer before the fault"
    return req, pos


# A DSV4 group kind -> (compression ratio, whether it is a compress-state ring).
DSV4_KINDS = {"C4": (4, False), "INDEXER": (4, False), "C128": (128, False),
              "C4_STATE": (4, True), "INDEXER_STATE": (4, True), "C128_STATE": (128, True)}  # fmt: skip


def _rows_of(engine: Engine, kind: str, slots: torch.Tensor) -> torch.Tensor:
    """The rows of DSV4 group ``kind`` that full slots ``slots`` reference, by the pool's own
    addressing (compressed: ``compressed_loc``; rings: ``state_loc`` of the mapped SWA slot,
    -1 where the SWA slot is gone)."""
    pool = engine.runner.token_to_kv_pool
    assert isinstance(pool, DSV4KVPool)
    ratio, ring = DSV4_KINDS[kind]
    layer = next(i for i, entry in enumerate(pool.layer_mapping) if entry.ratio == ratio)
    if not ring:
        return pool.compressed_loc(layer, slots)
    swa = engine.runner.allocator.full_to_swa_index_mapping[slots]
    return torch.where(swa > 0, pool.state_loc(layer, swa), -1)


def _holders(engine: Engine, target: Target) -> set[int]:
    """Running requests whose KV ([0, kv_len) of their row) references a target slot or
    (``target.rows``) a target row of a DSV4 group."""
    full = torch.tensor(target.full, dtype=torch.int64)
    swa = torch.tensor(target.swa, dtype=torch.int64)
    out = set()
    for req in engine.scheduler.running:
        slots = _slots(engine, req)
        hit = bool(torch.isin(slots, full).any())
        if swa.numel():
            mapping = engine.runner.allocator.full_to_swa_index_mapping
            hit = hit or bool(torch.isin(mapping[slots], swa).any())
        for kind, rows in target.rows.items():
            hit = hit or bool(torch.isin(_rows_of(engine, kind, slots), torch.tensor(rows)).any())
        if hit:
            out.add(req.rid)
    return out


def _full_allocator(engine: Engine) -> PagedAllocator:
    alloc = engine.runner.allocator
    return alloc.full_attn_allocator if isinstance(alloc, SWAAllocator) else alloc


def _remap(engine: Engine, rid: int, slot: int) -> None:
    """Point one of request ``rid``'s own committed req→token entries at ``slot``."""
    req, pos = _own(engine, rid, 1)
    assert int(engine.kv.req_to_token[req.req_pool_idx, pos]) != slot
    engine.kv.req_to_token[req.req_pool_idx, pos] = slot


# ------------------------------------------------------------------ faults (A, B, C: wave 2)


def remap_running(engine: Engine, a: int, b: int, c: int) -> Target:
    """A's entry -> a slot B owns (B's own decode range: freed by B's release)."""
    req_b, pos = _own(engine, b, 2)
    slot = int(engine.kv.req_to_token[req_b.req_pool_idx, pos])
    _remap(engine, a, slot)
    assert _holders(engine, Target([slot])) == {a, b}
    return Target([slot], holders=2)


def remap_tree_locked(engine: Engine, a: int, b: int, c: int) -> Target:
    """A's entry -> a prefix-cache slot C's matched prefix locks (tree-owned)."""
    slot = int(_slots(engine, _req(engine, c))[5])
    assert slot in engine.kv.prefix_cache.all_values().tolist()
    _remap(engine, a, slot)
    assert _holders(engine, Target([slot])) == {a, c}
    return Target([slot], holders=2)


def remap_tree_unlocked(engine: Engine, a: int, b: int, c: int) -> Target:
    """A's entry -> a prefix-cache slot no running request references (wave 1's KV)."""
    used = torch.cat([_slots(engine, r) for r in engine.scheduler.running])
    tree = engine.kv.prefix_cache.all_values()
    free_standing = sorted(set(tree.tolist()) - set(used.tolist()))
    assert free_standing, "wave 1 left nothing unreferenced in the prefix cache"
    slot = free_standing[len(free_standing) // 2]
    _remap(engine, a, slot)
    assert _holders(engine, Target([slot])) == {a}
    return Target([slot])


def kv_flip(engine: Engine, a: int, b: int, c: int) -> Target:
    """XOR byte 0 of layer-0 K of a tree-owned slot C's prefix locks (real_data partial
    fingerprints it)."""
    slot = int(_slots(engine, _req(engine, c))[7])
    pool = engine.runner.token_to_kv_pool
    buf = getattr(pool, "full_kv_pool", pool).k_buffer[0]
    buf[slot].view(-1).view(torch.uint8)[0] ^= 0xFF
    return Target([slot])


def record_tamper(engine: Engine, a: int, b: int, c: int) -> Target:
    """Change the position field of B's own slot's HEAD record (FULL group, K half)."""
    req_b, pos = _own(engine, b, 1)
    slot = int(engine.kv.req_to_token[req_b.req_pool_idx, pos])
    group = next(g for g in engine.canary.groups if g.kind == PoolKind.FULL)
    as_int64_records(group.k_head)[slot, CANARY_FIELD_POSITION] += 1
    return Target([slot])


def use_after_free(engine: Engine, a: int, b: int, c: int) -> Target:
    """Free one of A's own whole pages through the allocator while A still runs, and put
    it first on the free list: D's prefill (the next step) takes it."""
    req_a, pos = _own(engine, a, 0)  # page aligned: its page holds A's own slots only
    p = engine.config.page_size
    slot = int(engine.kv.req_to_token[req_a.req_pool_idx, pos])
    assert pos % p == 0 and slot % p == 0
    page = slot // p
    page_slots = torch.arange(page * p, (page + 1) * p)
    engine.runner.allocator.free(page_slots)
    full = _full_allocator(engine)
    full.free_pages = torch.cat([full.free_pages[full.free_pages == page],
                                 full.free_pages[full.free_pages != page]])  # fmt: skip
    return Target(page_slots.tolist(), holders=2)  # A and D


def swa_mapping(engine: Engine, a: int, b: int, c: int) -> Target:
    """A's in-window full slot's SWA mapping -> the SWA slot of one of B's (SWA pools)."""
    r2t, mapping = engine.kv.req_to_token, engine.runner.allocator.full_to_swa_index_mapping
    req_a, pos_a = _own(engine, a, 1)
    req_b, pos_b = _own(engine, b, 2)
    f_a, f_b = int(r2t[req_a.req_pool_idx, pos_a]), int(r2t[req_b.req_pool_idx, pos_b])
    assert int(mapping[f_a]) > 0 and int(mapping[f_b]) > 0  # both in their windows
    mapping[f_a] = mapping[f_b]
    target = Target(swa=[int(mapping[f_b])], holders=2)
    assert _holders(engine, target) == {a, b}
    return target


Fault = Callable[[Engine, int, int, int], Target]
REMAPS: dict[str, Fault] = {f.__name__: f for f in (remap_running, remap_tree_locked,
                                                      remap_tree_unlocked)}  # fmt: skip
CAMPAIGN: dict[str, Fault] = {f.__name__: f for f in (kv_flip, record_tamper, use_after_free,
                                                        swa_mapping)}  # fmt: skip


# ------------------------------------------------------------------ the run


def _start(w: Workload) -> tuple[Engine, list[int]]:
    """An engine with wave 1 served and wave 2 (A, B, C: their ids) ready for the fault."""
    engine = _engine(w)
    engine.generate([list(p) for p in w.wave1], SamplingParams(max_new_tokens=1, ignore_eos=True))
    rids = [engine.add_request(list(p), PARAMS) for p in w.wave2]
    while not (len(engine.scheduler.running) == 3
               and all(r.decode_ready for r in engine.scheduler.running)):  # fmt: skip
        assert engine.step() == []
    for _ in range(w.num_decode_steps):
        assert engine.step() == []
    return engine, rids


def _run(w: Workload, fault: Fault | None) -> Run:
    engine, rids = _start(w)
    target = fault(engine, *rids) if fault is not None else None
    rids.append(engine.add_request(list(w.late), PARAMS))  # D
    assert engine.step() == []  # D's prefill: A, B, C are not in this batch
    assert engine.canary.aborted_request_ids == [] and engine.canary.violations == []
    expected = _holders(engine, target) if target is not None else set()
    outs: dict[int, RequestOutput] = {}
    while engine.has_unfinished():
        outs.update((o.rid, o) for o in engine.step())
    aborted = list(engine.canary.aborted_request_ids)
    engine.check_integrity()
    num_violations = len(engine.canary.violations)
    fresh = [o.output_ids for o in engine.generate([list(p) for p in w.fresh], PARAMS)]
    assert len(engine.canary.violations) == num_violations  # nothing new
    assert engine.canary.aborted_request_ids == aborted
    return Run(outs, fresh, rids, target, expected, aborted, engine)


@functools.cache
def _clean(w: Workload) -> Run:
    return _run(w, None)


def _assert_nothing_leaked(engine: Engine) -> None:
    """Once the prefix cache lets go, every page is free or quarantined (parked)."""
    engine.kv.prefix_cache.free_all()
    engine.check_integrity()
    assert _full_allocator(engine).num_used_pages() == 0
    alloc = engine.runner.allocator
    if isinstance(alloc, SWAAllocator):
        assert alloc.swa_attn_allocator.num_used_pages() == 0
    pool = engine.runner.req_to_token_pool
    assert pool.available_size() == pool.size


def _check(w: Workload, fault: Fault) -> None:
    clean, hit = _clean(w), _run(w, fault)
    assert clean.aborted == [] and clean.engine.canary.violations == []
    assert clean.rids == hit.rids
    # The injected fault is what the canary reported (kind: the launch tag's suffix)...
    assert hit.target is not None
    wanted = {("FULL", s) for s in hit.target.full} | {("SWA", s) for s in hit.target.swa}
    wanted |= {(kind, r) for kind, rows in hit.target.rows.items() for r in rows}
    reported = {(r.launch_tag.split("_", 2)[2], r.slot_idx) for r in hit.engine.canary.violations}
    assert wanted & reported
    # Exactly the requests referencing the corrupt slots at fault time were aborted...
    assert len(hit.expected) == hit.target.holders and set(hit.aborted) == hit.expected
    assert len(hit.aborted) == len(set(hit.aborted))
    for rid in hit.rids:
        out = hit.outs[rid]
        if rid in hit.expected:
            assert out.finish_reason == "abort"
        else:  # ... and everyone else produced the clean run's tokens.
            assert out.finish_reason == "length"
            assert out.output_ids == clean.outs[rid].output_ids
    assert hit.fresh == clean.fresh  # served normally afterwards
    alloc = hit.engine.runner.allocator
    swa = alloc.swa_attn_allocator if isinstance(alloc, SWAAllocator) else None
    quarantined = _full_allocator(hit.engine).num_quarantined_pages()
    assert quarantined + (swa.num_quarantined_pages() if swa is not None else 0) > 0
    _assert_nothing_leaked(hit.engine)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fault", REMAPS)
def test_abort_after_a_remap_onto_a_shared_slot_frees_each_page_once(
    fault: str, model: str, page_size: int
) -> None:
    """The issue's crash: both holders of the shared slot are released; the shared page
    (another request's, or the prefix cache's) must be freed once, by its owner."""
    _check(workload(model, page_size), REMAPS[fault])


@pytest.mark.parametrize(
    ("fault", "model", "page_size"),
    [(f, m, p) for f in CAMPAIGN for m in MODELS for p in PAGE_SIZES
     if f != "swa_mapping" or m == "builtin:tiny-swa"],  # an SWA mapping needs SWA layers
)  # fmt: skip
def test_abort_campaign_aborts_exactly_the_referencing_requests(
    fault: str, model: str, page_size: int
) -> None:
    _check(workload(model, page_size), CAMPAIGN[fault])
