"""Real, fixed SGLang KV bugs put back into SGLang 0.5.23's own pools and allocators, and
caught by kvcanary (issue 53: real bugs, real engines).

Each replay runs one workload through :mod:`sglang_pool_harness` (SGLang's ``SWAKVPool``,
``SWATokenToKVPoolAllocator``, ``ReqToTokenPool``, ``ForwardBatch`` and ``set_kv_buffer``)
with the sliding-window eviction done by SGLang's *own* scheduler path: before each forward's
allocation (where ``alloc_for_extend`` / ``alloc_for_decode`` call it) the harness calls
``ScheduleBatch.maybe_evict_swa`` -> ``ScheduleBatch._evict_swa`` ->
``BasePrefixCache.evict_sliding_windows`` -> ``mem_cache.common.free_swa_out_of_window_slots``
-> the allocator's ``free_swa_segment``, all as installed, on stand-in batch / cache objects
that carry the harness's real pool, allocator and req->token table (:class:`_Batch`,
:class:`_Cache`); requests carry SGLang's own ``ReqKvInfo``. Finished requests are released
with SGLang's ``BasePrefixCache.free_kv_row``.

The bug is put back with :func:`source_patch.revert_fix` at the exact lines of its upstream
fix in the installed function (the lines must be found, or the test fails). Three runs:

* the release (fix in place) with the canary: no violation, no bad read;
* the bug without the canary: an independent *read oracle* (:class:`ReplaySWAServing`)
  tracks every store (slot -> the token chain and position it holds, per sub-pool) and, for
  every forward and request, the slots attention reads (full layers: ``[0, K)``; sliding
  layers: ``[K - W, K)``, SGLang's window: a query at ``q`` sees keys ``q - W .. q``) against
  what the reader expects; it counts bad reads and the first bad forward, and the K bytes
  those reads return differ from the release's;
* the bug with the canary: detected, with launch tag, fail reason, the forward of detection
  against the oracle's first bad read, and ``kvcanary.canary.explain.explain`` on the log.

:data:`REPLAYS` holds the per-bug table (tag, reason, steps from the first corrupted read,
slots named by the canary against the oracle's bad slots, and the bad reads it did not name);
``test_replay_table`` asserts and prints it; every bad read is named, those at the window's
first position ``K - W`` included (``_assert_every_bad_read_named``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from log_lines import LogLines, log_lines
from sglang.srt.managers.schedule_batch import ReqKvInfo, ScheduleBatch
from sglang.srt.mem_cache import common as sglang_common
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_pool_harness import Req, SWAServing
from source_patch import revert_fix

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.explain import explain

CONFIG = CanaryConfig(mode="log", real_data="all", v_half=True)

# ---------------------------------------------------------------------- SGLang's scheduler path


class _Cache:
    """The prefix-cache face SGLang's scheduler evicts and releases through: its methods are
    SGLang's own ``BasePrefixCache`` functions; the state is the harness's pool objects.
    ``prefix_sharing``: a radix cache (the frontier keeps a page-rounded window so inserted
    leaves stay live) or ``--disable-radix-cache`` (evict up to the window)."""

    evict_sliding_windows = BasePrefixCache.evict_sliding_windows
    swa_retain_window = BasePrefixCache.swa_retain_window
    swa_retain_floor = BasePrefixCache.swa_retain_floor
    free_kv_row = BasePrefixCache.free_kv_row

    def __init__(self, serving: SWAServing, *, prefix_sharing: bool) -> None:
        self.req_to_token_pool = serving.r2t
        self.token_to_kv_pool_allocator = serving.allocator
        self.page_size = serving.page_size
        self.sliding_window_size = serving.window
        self.draft_swa_window = 0
        self.prefix_sharing = prefix_sharing

    def supports_swa(self) -> bool:
        return True

    def supports_auxiliary_swa(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return self.prefix_sharing


class _Batch:
    """What ``ScheduleBatch.maybe_evict_swa`` reads of its batch (its methods are SGLang's;
    no overlap scheduler)."""

    maybe_evict_swa = ScheduleBatch.maybe_evict_swa
    _swa_eviction_trigger = ScheduleBatch._swa_eviction_trigger
    _evict_swa = ScheduleBatch._evict_swa

    def __init__(self, cache: _Cache, reqs: list[Any], decode: bool, prefix_lens: list[int]):
        self.tree_cache = cache
        self.token_to_kv_pool_allocator = cache.token_to_kv_pool_allocator
        self.reqs = reqs
        self.forward_mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        self.prefix_lens = prefix_lens
        self.enable_overlap = False
        self.forward_iter = 0


@dataclass
class _SchedReq:
    """What the scheduler's eviction reads of a ``Req``: SGLang's own ``ReqKvInfo``, the
    sequence length (KV + the token about to be decoded) and the batch counters."""

    kv: ReqKvInfo
    seqlen: int = 0
    decode_batch_idx: int = 0
    extend_batch_idx: int = 0


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ---------------------------------------------------------------------- the read oracle

Content = tuple[tuple[int, ...], int]  # (the token chain 0..p, position p)


@dataclass(frozen=True)
class BadRead:
    forward: int
    rid: int
    kind: str  # FULL | SWA
    prefix: int  # the reader's K: the positions before it are read
    position: int
    full_slot: int
    read_slot: int  # the slot attention read (SWA: the translated slot)


class ReplaySWAServing(SWAServing):
    """``SWAServing`` driven by SGLang's own eviction path, with a read oracle.

    Eviction: SGLang's ``ScheduleBatch.maybe_evict_swa`` before each forward's allocation
    (SGLang evicts there, not after a forward), with ``SGLANG_SWA_EVICTION_INTERVAL`` =
    ``interval``; the decode-batch counter advances after the allocation, as in
    ``prepare_for_decode``. Oracle: after SGLang's ``set_kv_buffer`` stored a forward, every
    store is recorded per sub-pool (slot -> token chain and position), then every slot each
    request's attention reads is compared with what it expects (module doc)."""

    def configure(self, *, prefix_sharing: bool, interval: int) -> None:
        self.cache = _Cache(self, prefix_sharing=prefix_sharing)
        self.interval = interval
        self.sched: dict[int, _SchedReq] = {}
        self.by_row: dict[int, Req] = {}
        self.full_holds: dict[int, Content] = {}
        self.swa_holds: dict[int, Content] = {}
        self.bad_reads: list[BadRead] = []
        self.read_bytes: list[dict[tuple[int, str, int], torch.Tensor]] = []
        self.detections: list[tuple[int, Any]] = []  # (forward, canary row)
        self.max_evicted = 0  # the furthest SWA eviction cursor any request reached

    # ------------------------------------------------------------------ requests
    def new_request(self, length: int) -> Req:
        req = super().new_request(length)
        self.sched[req.rid] = _SchedReq(ReqKvInfo(req_pool_idx=req.row))
        self.by_row[req.row] = req
        return req

    def adopt_prefix(self, req: Req, slots: torch.Tensor) -> None:
        """``req`` starts from a prefix-cache hit: its row names the cached slots, and the
        tree owns them (``cache_protected_len``)."""
        n = int(slots.numel())
        self.r2t.req_to_token[req.row, :n] = slots.to(torch.int32)
        req.slots, req.kv_len = slots.tolist(), n
        self.sched[req.rid].kv.cache_protected_len = n

    def finish(self, req: Req) -> None:
        """SGLang's release of a finished request without a tree insert: ``free_kv_row``
        over ``[cache_protected_len, kv_len)`` (full-only below the SWA eviction cursor)."""
        kv = self.sched.pop(req.rid).kv
        self.cache.free_kv_row(kv, [(kv.cache_protected_len, req.kv_len)])
        self.release_row(req)

    def release_row(self, req: Req) -> None:
        self.r2t.free_rows([req.row])
        self.r2t.req_to_token[req.row].zero_()
        self.by_row.pop(req.row)
        req.slots = []

    # ------------------------------------------------------------------ one forward
    def _alloc(self, work: list[tuple[Req, int]], decode: bool) -> torch.Tensor:
        reqs = [self.sched[r.rid] for r, _ in work]
        for (r, _), sg in zip(work, reqs, strict=True):
            sg.seqlen = r.kv_len + 1
        batch = _Batch(self.cache, reqs, decode, [r.kv_len for r, _ in work])
        with _env("SGLANG_SWA_EVICTION_INTERVAL", str(self.interval)):
            batch.maybe_evict_swa()
        self.max_evicted = max([self.max_evicted] + [
            sg.kv.get_evicted_seqlen(ComponentType.SWA) for sg in reqs])  # fmt: skip
        out = super()._alloc(work, decode)
        if decode:
            for sg in reqs:
                sg.decode_batch_idx += 1
        return out

    def evict(self, work: list[tuple[Req, int]]) -> None:
        pass  # SGLang's own eviction ran before the allocation (_alloc)

    def forward(self, work: list[tuple[Req, int]], *, store: bool = True) -> Any:
        index = self.forwards
        fb = super().forward(work, store=store)
        if self.canary is not None:
            self.canary.flush()
            self.detections += [(index, row) for row in self.canary.violations[
                len(self.detections):]]  # fmt: skip
        return fb

    def store(self, fb: Any) -> None:
        super().store(fb)  # SGLang's set_kv_buffer, every layer
        rows = fb.req_pool_indices.tolist()
        seq = fb.seq_lens.tolist()
        ext = self.extend_lens(fb)
        loc = fb.out_cache_loc.tolist()
        swa_loc = self.pool.translate_loc_from_full_to_swa(fb.out_cache_loc).tolist()
        i = 0
        for row, s, e in zip(rows, seq, ext, strict=True):
            tokens = self.by_row[row].tokens
            for p in range(s - e, s):
                content = (tuple(tokens[: p + 1]), p)
                self.full_holds[loc[i]] = content
                self.swa_holds[swa_loc[i]] = content
                i += 1
        self.check_reads(rows, seq, ext)

    @staticmethod
    def extend_lens(fb: Any) -> list[int]:
        if fb.extend_seq_lens is not None:
            return fb.extend_seq_lens.tolist()
        return [1] * int(fb.req_pool_indices.shape[0])

    def check_reads(self, rows: list[int], seq: list[int], ext: list[int]) -> None:
        assert self.window is not None
        mapping = self.pool.full_to_swa_index_mapping
        full_k = self.pool.full_kv_pool.k_buffer[0]
        swa_k = self.pool.swa_kv_pool.k_buffer[0]
        got: dict[tuple[int, str, int], torch.Tensor] = {}
        for row, s, e in zip(rows, seq, ext, strict=True):
            req, prefix = self.by_row[row], s - e
            for kind, start in (("FULL", 0), ("SWA", max(0, prefix - self.window))):
                holds = self.full_holds if kind == "FULL" else self.swa_holds
                for p in range(start, prefix):
                    full_slot = int(self.r2t.req_to_token[row, p])
                    slot = full_slot if kind == "FULL" else int(mapping[full_slot])
                    if holds.get(slot) != (tuple(req.tokens[: p + 1]), p):
                        self.bad_reads.append(BadRead(self.forwards, req.rid, kind, prefix, p,
                                                      full_slot, slot))  # fmt: skip
                    got[(req.rid, kind, p)] = (full_k if kind == "FULL" else swa_k)[slot].clone()
        self.read_bytes.append(got)

    # ------------------------------------------------------------------ results
    def first_bad_forward(self) -> int | None:
        return min((b.forward for b in self.bad_reads), default=None)


def first_read_difference(run: ReplaySWAServing, clean: ReplaySWAServing) -> int | None:
    """The first forward whose read K bytes differ from the release's for the same request,
    sub-pool and position (the model-free stand-in for "the outputs differ")."""
    for f, (mine, theirs) in enumerate(zip(run.read_bytes, clean.read_bytes, strict=False)):
        for key, value in mine.items():
            if key in theirs and not torch.equal(value, theirs[key]):
                return f
    return None


def canary_log() -> contextlib.AbstractContextManager[LogLines]:
    """The canary's violation log lines (what ``kvcanary explain`` reads)."""
    return log_lines("kvcanary.canary")


# ---------------------------------------------------------------------- results table


@dataclass
class Replay:
    """One bug's three runs (and the release without the canary, the bytes baseline)."""

    bug: str
    release: ReplaySWAServing  # fix in place, canary on
    baseline: ReplaySWAServing  # fix in place, canary off
    buggy: ReplaySWAServing  # bug put back, canary off
    detected: ReplaySWAServing  # bug put back, canary on
    log_text: str
    release_error: BaseException | None = None
    buggy_error: BaseException | None = None
    detected_error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # table-only facts
    controls: dict[str, Any] = field(default_factory=dict)  # further runs

    def row(self) -> dict[str, Any]:
        first_bad = self.buggy.first_bad_forward()
        hits = self.detected.detections
        first_hit = min((f for f, _ in hits), default=None)
        summary = explain(self.log_text)
        named = {(f, r.slot_idx, r.position) for f, r in hits if _side(r) == "verify"}
        return {
            "bug": self.bug,
            "launch_tag": sorted({r.launch_tag for _, r in hits}),
            "fail_reason": sorted({x for _, r in hits for x in r.fail_reasons}),
            "first_bad_read_forward": first_bad,
            "detected_forward": first_hit,
            "steps_from_first_bad_read": None if first_hit is None or first_bad is None
            else first_hit - first_bad,
            # read side: verify rows (a not-resident row names the full slot, others the
            # slot their group read); write side: rows of this forward's writes
            "canary_slots": sorted({(r.slot_idx, r.position) for _, r in hits
                                    if _side(r) == "verify"}),
            "canary_write_rows": sorted({(r.slot_idx, r.position) for _, r in hits
                                         if _side(r) == "write"}),
            "oracle_bad_slots": sorted({(b.full_slot, b.position) for b in self.buggy.bad_reads}),
            # (forward, full slot, position) of the bad reads the canary did not name in that
            # forward, neither by full slot nor by the slot read
            "canary_missed": sorted({(b.forward, b.full_slot, b.position)
                                     for b in self.buggy.bad_reads
                                     if not {(b.forward, b.full_slot, b.position),
                                             (b.forward, b.read_slot, b.position)} & named}),
            "oracle_bad_reads": len(self.buggy.bad_reads),
            "oracle_bad_forwards": sorted({b.forward for b in self.buggy.bad_reads}),
            "canary_forwards": sorted({f for f, _ in hits}),
            "first_read_difference_forward": first_read_difference(self.buggy, self.baseline),
            "explain_causes": [c["cause"] for c in summary["causes"]],
            **self.extra,
        }  # fmt: skip


def _side(row: Any) -> str:
    sides = {reason.split("_", 1)[0] for reason in row.fail_reasons}
    assert len(sides) == 1, row
    return sides.pop()


REPLAYS: dict[str, dict[str, Any]] = {}


def _run(make: Callable[[bool], ReplaySWAServing], workload: Callable[[ReplaySWAServing], None],
         *, canary: bool) -> tuple[ReplaySWAServing, BaseException | None]:  # fmt: skip
    s = make(canary)
    try:
        workload(s)
    except AssertionError as e:  # an SGLang guard tripping mid-run ends the run
        return s, e
    return s, None


def _replay(bug: str, make_release: Callable[[bool], ReplaySWAServing],
            make_bug: Callable[[bool], ReplaySWAServing],
            workload: Callable[[ReplaySWAServing], None],
            bug_in: Callable[[], contextlib.AbstractContextManager[Any]]) -> Replay:  # fmt: skip
    release, release_error = _run(make_release, workload, canary=True)
    baseline, _ = _run(make_release, workload, canary=False)
    with bug_in():
        buggy, buggy_error = _run(make_bug, workload, canary=False)
    with canary_log() as log, bug_in():
        detected, detected_error = _run(make_bug, workload, canary=True)
    return Replay(bug, release, baseline, buggy, detected, "\n".join(log.lines), release_error,
                  buggy_error, detected_error)  # fmt: skip


def _assert_replay(r: Replay, *, tag: str, reason: str, cause: str) -> dict[str, Any]:
    """The three runs' contract (module doc); returns the table row."""
    # the release, canary on: silent, and the oracle agrees nothing was misread
    assert r.release_error is None, r.release_error
    assert r.release.canary is not None and r.release.detections == []
    verified = r.release.canary.stats()["verify_entries_by_tag"]
    assert verified["HEAD_K_SWA"] > 0 and verified["HEAD_K_FULL"] > 0  # it did look
    assert r.release.bad_reads == [] and r.baseline.bad_reads == []
    assert len(r.release.read_bytes) == len(r.baseline.read_bytes) > 0
    assert r.release.max_evicted > 0  # SGLang's eviction freed window tails in the release too
    # the bug, canary off: the oracle sees bad reads, and what was read differs from the release
    first_bad = r.buggy.first_bad_forward()
    assert first_bad is not None, "the replayed bug never produced a bad read"
    assert first_read_difference(r.buggy, r.baseline) == first_bad
    # every bad read returned other K bytes than the release read for it
    for b in r.buggy.bad_reads:
        key = (b.rid, b.kind, b.position)
        assert not torch.equal(r.buggy.read_bytes[b.forward][key],
                               r.baseline.read_bytes[b.forward][key]), b  # fmt: skip
    # the bug, canary on: the same workload, detected in the forward of the first bad read
    assert r.detected.bad_reads == r.buggy.bad_reads  # the canary does not change the run
    assert r.detected.forwards == r.buggy.forwards
    row = r.row()
    assert row["detected_forward"] == first_bad, row
    assert tag in row["launch_tag"] and reason in row["fail_reason"], row
    # every slot the canary names on the read side is one the oracle saw misread (by its
    # full slot, or by the slot the sub-pool read); every write-side row is a write chained
    # from a misread predecessor
    bad = r.buggy.bad_reads
    misread = {(b.full_slot, b.position) for b in bad} | {(b.read_slot, b.position) for b in bad}
    assert row["canary_slots"] and set(row["canary_slots"]) <= misread, row
    assert {p - 1 for _, p in row["canary_write_rows"]} <= {b.position for b in bad}, row
    assert cause in row["explain_causes"], row
    REPLAYS[r.bug] = row
    return row


def _assert_every_bad_read_named(row: dict[str, Any]) -> None:
    """Every bad read of the forward of detection is named, the window's first position
    ``K - W`` too: SGLang's sliding layers read ``[K - W, K)`` (``window_left = W``), and
    its SWA groups list a hole (mapping 0) from ``K - W`` on
    (``CanaryBufferGroup.reads_window_start``)."""
    assert not row["canary_missed"], row


# ---------------------------------------------------------------------- bug 1: #16507


def _frontier_page_floor() -> contextlib.AbstractContextManager[Any]:
    return revert_fix(
        sglang_common.free_swa_out_of_window_slots,
        fixed="    if page_size > 1:\n"
        "        new_evicted_seqlen = (new_evicted_seqlen // page_size) * page_size\n",
        buggy="",
    )


def _make_16507(canary: bool) -> ReplaySWAServing:
    s = ReplaySWAServing.make(page_size=4, config=CONFIG, window=3, seed=11, install=canary)
    s.configure(prefix_sharing=False, interval=4)
    return s


def _workload_16507(s: ReplaySWAServing) -> None:
    """A (8-token prompt) decodes past two SWA pages beside a short B; then B finishes and
    C reuses its slots. Page 4, window 3, eviction every 4 tokens (chunk cache)."""
    a, b = s.new_request(8 + 14), s.new_request(2 + 12)
    s.forward([(a, 8), (b, 2)])
    for _ in range(10):
        s.forward([(a, 1), (b, 1)])
    s.finish(b)
    c = s.new_request(6 + 3)
    s.forward([(c, 6), (a, 1)])
    for _ in range(2):
        s.forward([(c, 1), (a, 1)])


@functools.cache
def replay_16507() -> Replay:
    return _replay("#16507 unaligned SWA eviction frontier", _make_16507, _make_16507,
                   _workload_16507, _frontier_page_floor)  # fmt: skip


def test_replay_16507_unaligned_swa_eviction_frontier() -> None:
    """SGLang #16507 (https://github.com/sgl-project/sglang/pull/16507, "Fix evict swa for
    overlap scheduler and page size > 1", merged 2026-01; "make evicted len aligned with page
    size"): the SWA eviction frontier was not page-aligned, so with ``page_size > 1`` an
    eviction handed the allocator part of a page whose other slots were still in the
    window, and the paged allocator gave the page back whole.

    Replayed *exactly* (the release carries the fix): 0.5.23 keeps it as the page floor of
    ``mem_cache.common.free_swa_out_of_window_slots`` (what ``_evict_swa`` became); the test
    removes those two lines and runs SGLang's own scheduler eviction (chunk cache, eviction
    interval 4). Page 4, window 3: before A's decode at K = 9 the frontier is 6, not 4;
    0.5.23 frees the SWA peers of whole pages (``free_swa_segment``: one representative per
    page, the whole page's mapping cleared), so the page of positions 4..7 goes while 6 and
    7 are in the window, and forwards 2 and 3 read the padding slot for them. SGLang's own
    later guard (``free_swa_segment``'s page-aligned ``start_pos`` assert, #38159) trips only
    at A's next eviction, before forward 6; the canary names the slot in forward 2."""
    r = replay_16507()
    for err in (r.buggy_error, r.detected_error):  # the release's guard, after the bad reads
        assert err is not None and "is not page-aligned" in str(err)
    assert r.buggy.forwards == r.detected.forwards  # the forward whose eviction asserted
    r.extra["sglang_guard"] = f"forward {r.buggy.forwards}'s eviction: {r.buggy_error}"
    row = _assert_replay(r, tag="HEAD_K_SWA", reason="verify_not_resident",
                         cause="premature_window_eviction")  # fmt: skip
    assert row["canary_slots"]
    assert {b.kind for b in r.buggy.bad_reads} == {"SWA"}
    assert {b.read_slot for b in r.buggy.bad_reads} == {0}  # the cleared mapping's padding slot
    # the victim is A (rid 0): B's reads stay good
    assert {b.rid for b in r.buggy.bad_reads} == {0}
    _assert_every_bad_read_named(row)


# ---------------------------------------------------------------------- bug 2: #22470


class LegacySWARadixCache:
    """Closest faithful form of SGLang's ``SWARadixCache`` (``swa_radix_cache.py``, before
    the unified tree) for one cached path: ``cache_finished_req`` (page-aligned insert of
    the request's KV, tail freed) with ``_insert_helper``'s SWA cases, and
    ``_match_prefix_helper``'s window rule (a match ends where at least ``window`` live SWA
    tokens follow the last tombstone, or no tombstone was met).

    ``_insert_helper`` cases for a new key ``[0, L)`` with SWA evicted up to ``e``: ``e == 0``
    all live; ``0 < e < L`` tombstone ``[0, e)`` + live ``[e, L)``; ``e == L`` (case 3):
    before #22470 it fell through to a *live* node, the fix frees the value and inserts
    nothing (``defensive``). Differs from SGLang: a flat list of paths (no node splits,
    children, LRU, locks or tree eviction), keys are raw tokens (no bigram / extra key)."""

    def __init__(self, serving: ReplaySWAServing, *, defensive: bool) -> None:
        self.s = serving
        self.defensive = defensive
        self.paths: list[tuple[tuple[int, ...], torch.Tensor, int]] = []  # key, value, tombstone

    def cache_finished_req(self, req: Req) -> None:
        s = self.s
        kv = s.sched.pop(req.rid).kv
        kv_indices = s.r2t.req_to_token[req.row, : req.kv_len].to(torch.int64)
        aligned = req.kv_len // s.page_size * s.page_size
        s.allocator.free(kv_indices[aligned:])
        key, value = tuple(req.tokens[:aligned]), kv_indices[:aligned].clone()
        evicted = kv.get_evicted_seqlen(ComponentType.SWA)
        if evicted >= len(key) and self.defensive:  # #22470's insert-side half
            s.allocator.free(value)
        else:
            tombstone = evicted if 0 < evicted < len(key) else 0  # case 3: a live node
            self.paths.append((key, value, tombstone))
        s.release_row(req)

    def match_prefix(self, tokens: list[int]) -> torch.Tensor:
        best = torch.empty(0, dtype=torch.int64)
        for key, value, tombstone in self.paths:
            n = 0
            while n < min(len(key), len(tokens)) and key[n] == tokens[n]:
                n += 1
            n = n // self.s.page_size * self.s.page_size
            assert self.s.window is not None
            ok = n if tombstone == 0 or n - tombstone >= self.s.window else 0
            if ok > best.numel():
                best = value[:ok]
        return best


def _frontier_without_page_margin() -> contextlib.AbstractContextManager[Any]:
    return revert_fix(
        sglang_common.free_swa_out_of_window_slots,
        fixed="        evict_threshold = pre_len - ceil_align(\n"
        "            max(sliding_window_size, page_size), page_size\n"
        "        )\n",
        buggy="        evict_threshold = pre_len - sliding_window_size\n",
    )


def _make_22470(canary: bool, *, defensive: bool) -> ReplaySWAServing:
    s = ReplaySWAServing.make(page_size=4, config=CONFIG, window=2, seed=5, install=canary)
    s.configure(prefix_sharing=True, interval=1)
    s.tree = LegacySWARadixCache(s, defensive=defensive)  # type: ignore[attr-defined]
    return s


def _workload_22470(s: ReplaySWAServing) -> None:
    """A (5-token prompt) decodes two tokens beside a bystander D and finishes into the radix
    cache; B shares A's first page of prompt, matches it, prefills the rest and decodes
    beside D (whose window the release evicts too)."""
    a, d = s.new_request(5 + 2), s.new_request(3 + 9)
    s.forward([(a, 5), (d, 3)])
    for _ in range(2):
        s.forward([(a, 1), (d, 1)])
    s.tree.cache_finished_req(a)  # type: ignore[attr-defined]
    b = s.new_request(4 + 3 + 5)
    b.tokens[:4] = a.tokens[:4]
    hit = s.tree.match_prefix(b.tokens)  # type: ignore[attr-defined]
    s.prefix_hit = int(hit.numel())  # type: ignore[attr-defined]
    s.adopt_prefix(b, hit)
    s.forward([(b, 7 - b.kv_len), (d, 1)])
    for _ in range(4):
        s.forward([(b, 1), (d, 1)])


@functools.cache
def replay_22470() -> Replay:
    r = _replay("#22470 SWA eviction frontier reaches the radix insert boundary",
                functools.partial(_make_22470, defensive=True),
                functools.partial(_make_22470, defensive=False), _workload_22470,
                _frontier_without_page_margin)  # fmt: skip
    # a control: the insert-side half of the fix alone, with the frontier still reverted
    with _frontier_without_page_margin():
        guarded, guarded_error = _run(functools.partial(_make_22470, defensive=True),
                                      _workload_22470, canary=False)  # fmt: skip
    r.controls["insert_half_only"] = (guarded, guarded_error)
    return r


def test_replay_22470_swa_frontier_reaches_radix_insert_boundary() -> None:
    """SGLang #22470 (https://github.com/sgl-project/sglang/pull/22470, "Fix SWA eviction
    boundary and page-align chunked prefill", merged 2026-04; #29860 and #34870 later fixed
    the same invariant on other paths): with ``page_size > sliding_window_size`` the
    radix-cache eviction frontier ``page_floor(pre_len - W)`` reached the insert boundary
    ``page_floor(seq_len)``, so ``cache_finished_req`` inserted a key whose SWA KV was all
    freed; ``_insert_helper`` had no case for that and added a *live* node, and the next
    request matching it read its window through a cleared full->SWA mapping.

    Replayed in *closest faithful form*: the frontier is reverted at its exact 0.5.23 site
    (``free_swa_out_of_window_slots``' prefix-sharing threshold, now
    ``pre_len - ceil_align(max(W, page), page)``, back to ``pre_len - W``) and runs through
    SGLang's own scheduler eviction; the radix tree is :class:`LegacySWARadixCache`, a
    mirror of the pre-unified ``SWARadixCache`` insert/match, where the bug misled a reader
    (0.5.23's unified tree tombstones an all-evicted leaf and refuses it at match; #29860
    describes the assert / SWA leak that follows there, which no KV read shows).
    The insert-side half of the fix is the mirror's ``defensive`` switch; the release runs
    0.5.23's frontier with it on, the bug runs both halves reverted. Page 4, window 2: A's
    5-token prompt plus two decodes evicts positions 0..3 (release: nothing), A's first page
    is inserted live, B matches it and its first forward reads SWA positions 2 and 3 through
    mapping 0."""
    r = replay_22470()
    assert r.buggy_error is None and r.detected_error is None
    for run in (r.release, r.baseline, r.buggy, r.detected):  # B hit A's cached page each time
        assert run.prefix_hit == 4  # type: ignore[attr-defined]
    row = _assert_replay(r, tag="HEAD_K_SWA", reason="verify_not_resident",
                         cause="premature_window_eviction")  # fmt: skip
    assert {b.kind for b in r.buggy.bad_reads} == {"SWA"}
    assert {b.rid for b in r.buggy.bad_reads} == {2}  # B, reading A's cached page
    assert {b.position for b in r.buggy.bad_reads} == {2, 3}
    # the insert-side half alone prevents the bad read: no live node, B matches nothing
    guarded, guarded_error = r.controls["insert_half_only"]
    assert guarded_error is None and guarded.prefix_hit == 0 and guarded.bad_reads == []
    _assert_every_bad_read_named(row)


# ---------------------------------------------------------------------- the table

TABLE_COLUMNS = ("bug", "launch_tag", "fail_reason", "first_bad_read_forward",
                 "detected_forward", "steps_from_first_bad_read", "canary_slots",
                 "canary_write_rows", "oracle_bad_slots", "canary_missed",
                 "explain_causes")  # fmt: skip


def test_replay_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Every replay is in the table, detected in the forward of its first bad read; the
    table is printed (slots as ``(full slot, position)``)."""
    for replay, test in ((replay_16507, test_replay_16507_unaligned_swa_eviction_frontier),
                         (replay_22470,
                          test_replay_22470_swa_frontier_reaches_radix_insert_boundary)):  # fmt: skip
        if replay().bug not in REPLAYS:
            test()
    assert len(REPLAYS) == 2
    for row in REPLAYS.values():
        assert row["steps_from_first_bad_read"] == 0
    lines = ["kvcanary SGLang replays (SGLang 0.5.23 pools):"]
    for row in REPLAYS.values():
        lines.append("  " + " | ".join(f"{c}={row[c]}" for c in TABLE_COLUMNS))
        extra = {k: v for k, v in row.items() if k not in TABLE_COLUMNS}
        lines.append(f"    {extra}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
