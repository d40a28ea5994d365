"""The same canary inputs through SGLang 0.5.23's kernels and through ours.

A *scenario* is a random little serving run at kernel level (no engine, no pools): requests
with req->token rows, page-aligned slot allocation (page size 1 or > 1), prefix sharing,
chunked prefill, decode and finished requests, padding rows at the end of the batch (as a
CUDA-graph replay has them), an optional SWA group with a full->SWA LUT and window eviction,
real KV bytes that "attention" stores between HEAD and TAIL, real-data none / partial / all,
the V half on or off, the expected-token check, the write-input assertion and the
chain-position assertion, small verify capacities (overflow) and small rings (fill-once drop).
Every forward runs, per group in SGLang's launch order, the plan, then HEAD verify + write
(K, then V), the attention store, then TAIL verify + write.

Implementations, each on its own copy of the canary buffers, violation ring and run counters
(the req->token table, LUT, KV bytes and batch tensors are shared inputs):

* ``sglang``: ``sglang.kernels.ops.kv_canary.plan_ref`` / ``verify_ref`` / ``write_ref`` (the
  torch references SGLang pins its CUDA kernels to byte for byte), called exactly as
  ``sglang.srt.kv_canary.endpoint.CanaryEndpoint.launch_per_forward`` calls them (SWA write
  slots gathered through the LUT; HEAD launches without real-KV sources).
* ``torch`` / ``numba``: :func:`kvcanary.canary.plan.reference.build_plans` + :mod:`kvcanary.canary.kernels.dispatch`
  with that backend (materialised plans).
* ``rows``: :class:`kvcanary.canary.plan.rows.RowPlanner` + the numba kernels (our CPU
  per-forward path).

After every launch the record buffers must be byte-identical, the rings identical (rows and
write index) and the per-tag run counters identical; materialised plans must hold SGLang's
plan entries, enable flag, write offsets and seeds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.kernels.ops.kv_canary import consts as sg_consts
from sglang.kernels.ops.kv_canary.plan.api import launch_canary_plan_kernels
from sglang.kernels.ops.kv_canary.plan_ref import (
    launch_canary_plan_kernels_torch_reference as sg_plan,
)
from sglang.kernels.ops.kv_canary.verify import CanaryLaunchTag as SgTag
from sglang.kernels.ops.kv_canary.verify import RealKvSource as SgSource
from sglang.kernels.ops.kv_canary.verify import VerifyOrWriteContext as SgContext
from sglang.kernels.ops.kv_canary.verify import VerifyPlan as SgVerifyPlan
from sglang.kernels.ops.kv_canary.verify import launch_canary_verify_kernel
from sglang.kernels.ops.kv_canary.verify_ref import (
    launch_canary_verify_kernel_torch_reference as sg_verify,
)
from sglang.kernels.ops.kv_canary.write import WritePlan as SgWritePlan
from sglang.kernels.ops.kv_canary.write import launch_canary_write_kernel
from sglang.kernels.ops.kv_canary.write_ref import (
    launch_canary_write_kernel_torch_reference as sg_write,
)

from kvcanary.canary.kernels import dispatch as kernels
from kvcanary.canary.plan.reference import build_plans
from kvcanary.canary.plan.rows import HostInputs, RowPlanner
from kvcanary.canary.plan.types import PlanInputs, VerifyPlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.constants import (
    NUM_LAUNCH_TAGS,
    KvHalf,
    LaunchStage,
    PoolKind,
    RealKvHashMode,
    launch_tag,
)
from kvcanary.canary.wire.real_kv import RealKvSource, resolve_read_bytes

OUR_IMPLS = ("torch", "numba", "rows")
ALL_IMPLS = ("sglang", *OUR_IMPLS)
STAGES = (LaunchStage.HEAD, LaunchStage.TAIL)
CORRUPTIONS = ("token", "position", "chain", "real_kv_field", "remap", "kv_byte", "lut")


class Mismatch(AssertionError):
    """SGLang and one of ours disagree; the message names the launch and the difference."""


# ----------------------------------------------------------------------------- scenario config


@dataclass(frozen=True)
class ScenarioConfig:
    seed: int
    page_size: int  # pool page size: slots are allocated page by page
    source_paged: bool  # real-KV source rows hold page_size slots (kernel page_size > 1)
    bytes_per_token: int  # per K (or V) source
    extra_row_bytes: int  # trailing bytes per source row the fold must ignore
    slot_bytes: int  # canary record stride (SGLang allocates 32; the kernels read it)
    mode: RealKvHashMode
    v_half: bool
    swa_window: int | None  # None: one FULL group; else FULL + SWA groups
    check_token: bool
    token_offset: int  # kv_token_id_vs_position_offset
    truncate_valid_lens: bool  # expected-token table rows shorter than the sequence
    write_input_assert: bool
    chain_position_assert: bool
    verify_capacity: int
    ring_capacity: int
    num_steps: int
    corruption_prob: float  # per forward, a random single corruption before it
    max_reqs: int = 5
    max_ctx: int = 40
    chunk_max: int = 10

    @staticmethod
    def draw(seed: int, *, clean: bool = False) -> ScenarioConfig:
        """A random configuration; ``clean``: no corruption, no overflow, inputs as expected
        (a run whose records must verify clean under both implementations)."""
        rng = random.Random(seed)
        page_size = rng.choice([1, 1, 2, 4])
        bytes_per_token = rng.choice([16, 32, 64])
        return ScenarioConfig(
            seed=seed,
            page_size=page_size,
            source_paged=page_size > 1 and rng.random() < 0.5,
            bytes_per_token=bytes_per_token,
            extra_row_bytes=rng.choice([0, 0, 16]),
            slot_bytes=rng.choice([32, 32, 32, 48]),
            mode=rng.choice(list(RealKvHashMode)),
            v_half=rng.random() < 0.5,
            swa_window=rng.choice([None, None, 2, 3, 5, 8]),
            check_token=rng.random() < 0.5,
            token_offset=0 if clean else rng.choice([0, 0, 0, 1]),
            truncate_valid_lens=not clean and rng.random() < 0.2,
            write_input_assert=rng.random() < 0.4,
            chain_position_assert=rng.random() < 0.7,
            verify_capacity=10_000 if clean else rng.choice([10_000, 10_000, 10_000, 40, 12]),
            ring_capacity=4096 if clean else rng.choice([4096, 4096, 16, 3]),
            num_steps=rng.randint(3, 9),
            corruption_prob=0.0 if clean else rng.choice([0.0, 0.2, 0.5]),
        )


# ----------------------------------------------------------------------------- shared inputs


@dataclass
class Group:
    kind: PoolKind
    num_slots: int
    window: int | None
    lut: torch.Tensor | None  # int64 [full slots]: full -> SWA slot, 0 = not resident
    kv: dict[KvHalf, torch.Tensor]  # uint8 [rows, row_bytes] per half: the live "layer 0"

    def tag(self, stage: LaunchStage, half: KvHalf) -> int:
        return int(launch_tag(self.kind, stage, half))


@dataclass
class Request:
    row: int
    tokens: list[int]  # prompt, then generated tokens as they are fed
    prompt_len: int
    target_len: int
    pages: list[int] = field(default_factory=list)  # full pages, position order
    computed: int = 0  # tokens whose KV is in the cache

    def slot(self, pos: int, page_size: int) -> int:
        return self.pages[pos // page_size] * page_size + pos % page_size


@dataclass
class Forward:
    """One forward's batch (SGLang's field names in comments)."""

    req_pool_indices: torch.Tensor  # req_pool_indices
    prefix_lens: torch.Tensor  # extend_prefix_lens (decode: positions)
    extend_lens: torch.Tensor  # extend_seq_lens (decode: 1)
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    expected_table: torch.Tensor | None  # req_to_verify_expected_tokens (int32)
    expected_lens: torch.Tensor | None  # req_to_verify_expected_tokens_valid_lens
    expected_input_ids: torch.Tensor | None
    expected_positions: torch.Tensor | None
    write_req_capacity: int

    @property
    def bs(self) -> int:
        return int(self.req_pool_indices.shape[0])


class World:
    """Pools, req->token table and requests: the inputs every implementation shares."""

    def __init__(self, cfg: ScenarioConfig, rng: random.Random) -> None:
        self.cfg, self.rng = cfg, rng
        ps = cfg.page_size
        self.num_rows = cfg.max_reqs + 1  # row 0: padding
        self.req_to_token = torch.zeros(self.num_rows, cfg.max_ctx, dtype=torch.int32)
        self.token_table = torch.zeros(self.num_rows, cfg.max_ctx, dtype=torch.int32)
        pages_per_req = -(-cfg.max_ctx // ps)
        num_full_pages = 1 + cfg.max_reqs * pages_per_req + 2
        self.free_full = list(range(1, num_full_pages))  # page 0 (slot 0) is reserved
        rng.shuffle(self.free_full)
        self.page_refs: dict[int, int] = {}
        self.groups = [self._make_group(PoolKind.FULL, num_full_pages * ps, None, None)]
        self.swa_page: dict[int, int] = {}  # full page -> SWA page (resident ones)
        if cfg.swa_window is not None:
            w = cfg.swa_window
            swa_pages_per_req = -(-(w + cfg.chunk_max) // ps) + 3
            num_swa_pages = 1 + cfg.max_reqs * swa_pages_per_req
            self.free_swa = list(range(1, num_swa_pages))
            rng.shuffle(self.free_swa)
            lut = torch.zeros(num_full_pages * ps, dtype=torch.int64)
            self.groups.append(self._make_group(PoolKind.SWA, num_swa_pages * ps, w, lut))
        self.requests: dict[int, Request] = {}

    def _make_group(self, kind: PoolKind, num_slots: int, window: int | None,
                    lut: torch.Tensor | None) -> Group:  # fmt: skip
        cfg = self.cfg
        src_ps = cfg.page_size if cfg.source_paged else 1
        rows = num_slots // src_ps
        width = src_ps * cfg.bytes_per_token + cfg.extra_row_bytes
        gen = torch.Generator().manual_seed(self.rng.randrange(2**31))
        kv = {
            half: torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen)
            for half in KvHalf
        }
        return Group(kind, num_slots, window, lut, kv)

    @property
    def full(self) -> Group:
        return self.groups[0]

    @property
    def swa(self) -> Group | None:
        return self.groups[1] if len(self.groups) > 1 else None

    # ---- allocation

    def _alloc_page(self) -> int | None:
        if not self.free_full or (self.swa is not None and not self.free_swa):
            return None
        page = self.free_full.pop()
        self.page_refs[page] = 1
        if self.swa is not None:
            self._map_swa(page, self.free_swa.pop())
        return page

    def _map_swa(self, page: int, swa_page: int) -> None:
        ps = self.cfg.page_size
        assert self.swa is not None and self.swa.lut is not None
        self.swa_page[page] = swa_page
        self.swa.lut[page * ps : (page + 1) * ps] = torch.arange(ps) + swa_page * ps

    def _evict_swa(self, page: int) -> None:
        ps = self.cfg.page_size
        assert self.swa is not None and self.swa.lut is not None
        self.free_swa.append(self.swa_page.pop(page))
        self.swa.lut[page * ps : (page + 1) * ps] = 0

    def _release_page(self, page: int) -> None:
        self.page_refs[page] -= 1
        if self.page_refs[page] == 0:
            del self.page_refs[page]
            self.free_full.append(page)
            if page in self.swa_page:
                self._evict_swa(page)

    def _reserve(self, req: Request, n: int) -> list[int] | None:
        """Slots for positions [computed, computed + n), allocating pages; None if full."""
        ps = self.cfg.page_size
        need = -(-(req.computed + n) // ps) - len(req.pages)
        if need > len(self.free_full) or (self.swa is not None and need > len(self.free_swa)):
            return None
        for _ in range(need):
            page = self._alloc_page()
            assert page is not None
            req.pages.append(page)
        slots = [req.slot(p, ps) for p in range(req.computed, req.computed + n)]
        self.req_to_token[req.row, req.computed : req.computed + n] = torch.tensor(slots)
        return slots

    def _new_request(self) -> Request | None:
        cfg, rng, ps = self.cfg, self.rng, self.cfg.page_size
        rows = [r for r in range(1, self.num_rows) if r not in self.requests]
        if not rows:
            return None
        prompt_len = rng.randint(1, 24)
        target_len = min(cfg.max_ctx, prompt_len + rng.randint(0, 12))
        req = Request(rng.choice(rows), [rng.randrange(1000) for _ in range(prompt_len)],
                      prompt_len, target_len)  # fmt: skip
        donors = [d for d in self.requests.values() if d.computed >= ps]
        if donors and rng.random() < 0.4:  # radix hit: share whole pages of a donor's prefix
            donor = rng.choice(donors)
            shared = ps * rng.randint(1, min(donor.computed, prompt_len - 1) // ps or 1)
            if shared < prompt_len and shared <= donor.computed and self._swa_resident(
                donor, shared
            ):
                req.tokens[:shared] = donor.tokens[:shared]
                req.pages = donor.pages[: shared // ps]
                for page in req.pages:
                    self.page_refs[page] += 1
                req.computed = shared
                self.req_to_token[req.row, :shared] = self.req_to_token[donor.row, :shared]
        self.requests[req.row] = req
        return req

    def _swa_resident(self, donor: Request, prefix: int) -> bool:
        """The SWA window a consumer of ``donor[:prefix]`` reads is resident (else SGLang's
        radix cache would not hand that prefix out)."""
        if self.swa is None or self.cfg.swa_window is None:
            return True
        lut = self.swa.lut
        assert lut is not None
        lo = max(0, prefix - self.cfg.swa_window - 1)
        return all(int(lut[donor.slot(p, self.cfg.page_size)]) != 0 for p in range(lo, prefix))

    # ---- one forward

    def next_forward(self, *, clean: bool) -> Forward:
        """New requests maybe, then a random subset of the running ones (prefill chunks and
        decodes mixed), then 0-2 padding rows."""
        cfg, rng = self.cfg, self.rng
        if not self.requests or (len(self.requests) < cfg.max_reqs and rng.random() < 0.6):
            for _ in range(rng.randint(1, 2)):
                self._new_request()
        running = rng.sample(list(self.requests.values()), len(self.requests))
        selected = [r for i, r in enumerate(running) if i == 0 or rng.random() >= 0.2]
        return self.build_forward(selected, clean=clean, padding=rng.choice([0, 0, 1, 2]))

    def build_forward(self, selected: list[Request], *, clean: bool, padding: int = 0) -> Forward:
        """One forward over ``selected``: the next prefill chunk of each request still in its
        prompt, else one decode token; then ``padding`` rows (req row 0, slot 0)."""
        cfg, rng = self.cfg, self.rng
        rows, prefix, extend, ids, pos, locs = [], [], [], [], [], []
        for req in selected:
            if req.computed < req.prompt_len:  # (chunked) prefill
                n = min(rng.randint(1, cfg.chunk_max), req.prompt_len - req.computed)
            else:  # decode: feed the last sampled token
                n = 1
                req.tokens.append(rng.randrange(1000))
            slots = self._reserve(req, n)
            if slots is None:
                if n == 1 and req.computed >= req.prompt_len:
                    req.tokens.pop()
                continue
            rows.append(req.row)
            prefix.append(req.computed)
            extend.append(n)
            ids += req.tokens[req.computed : req.computed + n]
            pos += list(range(req.computed, req.computed + n))
            locs += slots
            req.computed += n
            self.token_table[req.row, : len(req.tokens)] = torch.tensor(req.tokens)
        for _ in range(padding):  # graph padding rows: row 0, slot 0
            rows.append(0)
            prefix.append(rng.randint(0, 5))
            extend.append(1)
            ids.append(0)
            pos.append(0)
            locs.append(0)
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        fwd_ids, fwd_pos = t(ids), t(pos)
        table = lens = exp_ids = exp_pos = None
        if cfg.check_token:
            table = self.token_table.clone()
            full_lens = [len(self.requests[r].tokens) if r else 0 for r in rows]
            if cfg.truncate_valid_lens:
                full_lens = [rng.randint(0, n) for n in full_lens]
            lens = t(full_lens)
        if cfg.write_input_assert:
            exp_ids, exp_pos = fwd_ids.clone(), fwd_pos.clone()
            if not clean and len(ids) and rng.random() < 0.3:
                i = rng.randrange(len(ids))
                (exp_ids if rng.random() < 0.5 else exp_pos)[i] += rng.choice([-1, 1, 7])
        return Forward(t(rows), t(prefix), t(extend), fwd_ids, fwd_pos, t(locs), table, lens,
                       exp_ids, exp_pos, write_req_capacity=len(rows) + rng.randint(0, 2))  # fmt: skip

    def store_kv(self, fwd: Forward) -> None:
        """Attention stores fresh K/V bytes for the forward's tokens (full and SWA pools)."""
        locs = fwd.out_cache_loc[fwd.req_pool_indices.repeat_interleave(fwd.extend_lens) != 0]
        for g in self.groups:
            slots = locs if g.lut is None else g.lut[locs]
            for half, kv in g.kv.items():
                if half == KvHalf.V and not self.cfg.v_half:
                    continue
                for slot in slots.tolist():
                    row, col = self.kv_cols(slot)
                    fill = 0 if self.rng.random() < 0.05 else None  # all-zero KV folds to 0
                    n = self.cfg.bytes_per_token
                    kv[row, col : col + n] = (
                        torch.zeros(n, dtype=torch.uint8) if fill == 0
                        else torch.randint(0, 256, (n,), dtype=torch.uint8)
                    )  # fmt: skip

    def kv_cols(self, slot: int) -> tuple[int, int]:
        src_ps = self.cfg.page_size if self.cfg.source_paged else 1
        row, off = divmod(slot, src_ps)
        return row, off * self.cfg.bytes_per_token

    def finish_and_evict(self) -> None:
        """Finished requests free their pages; SWA pages out of every holder's window go."""
        for row, req in list(self.requests.items()):
            if req.computed >= req.target_len:
                for page in req.pages:
                    self._release_page(page)
                del self.requests[row]
        if self.swa is None or self.cfg.swa_window is None:
            return
        ps = self.cfg.page_size
        keep = self.cfg.swa_window + ps
        for page in list(self.swa_page):
            holders = [
                (r, i) for r in self.requests.values() for i, p in enumerate(r.pages) if p == page
            ]
            if holders and all((i + 1) * ps <= r.computed - keep for r, i in holders):
                self._evict_swa(page)

    def used_slots(self, group: Group) -> list[int]:
        ps = self.cfg.page_size
        pages = self.page_refs if group.lut is None else self.swa_page.values()
        return [p * ps + i for p in pages for i in range(ps)]


# ----------------------------------------------------------------------------- implementations


class Impl:
    """One implementation's canary state: record buffers per (group, stage, half), ring, counters."""

    def __init__(self, name: str, world: World) -> None:
        cfg = world.cfg
        self.name, self.world = name, world
        self.bufs: dict[tuple[int, LaunchStage, KvHalf], torch.Tensor] = {
            (gi, stage, half): torch.zeros(g.num_slots, cfg.slot_bytes, dtype=torch.uint8)
            for gi, g in enumerate(world.groups)
            for stage in STAGES
            for half in KvHalf
            if half == KvHalf.K or cfg.v_half
        }
        mode = cfg.mode
        self.sources: dict[tuple[int, KvHalf], tuple[Any, ...]] = {}
        src_ps = cfg.page_size if cfg.source_paged else 1
        for gi, g in enumerate(world.groups):
            for half, kv in g.kv.items():
                nbpt = cfg.bytes_per_token
                if mode == RealKvHashMode.NONE:
                    self.sources[gi, half] = ()  # SGLang's adapters: no source with read_bytes 0
                elif name == "sglang":
                    read = 16 if mode == RealKvHashMode.PARTIAL else nbpt  # partial: kernel reads 16
                    self.sources[gi, half] = (
                        SgSource(tensor=kv, page_size=src_ps, num_bytes_per_token=nbpt,
                                 read_bytes=read),
                    )  # fmt: skip
                else:
                    self.sources[gi, half] = (
                        RealKvSource(kv, src_ps, nbpt, resolve_read_bytes(mode, nbpt)),
                    )

    def plan(self, gi: int, fwd: Forward) -> Any:
        raise NotImplementedError

    def verify(self, gi: int, stage: LaunchStage, half: KvHalf, plan: Any, fwd: Forward) -> None:
        raise NotImplementedError

    def write(self, gi: int, stage: LaunchStage, half: KvHalf, plan: Any, fwd: Forward) -> None:
        raise NotImplementedError

    def ring_state(self) -> tuple[int, torch.Tensor]:
        raise NotImplementedError

    def counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class SglangImpl(Impl):
    """``public``: SGLang's public launchers (which, off CUDA, dispatch to the references)."""

    def __init__(self, world: World, *, public: bool = False) -> None:
        super().__init__("sglang", world)
        self.name = "sglang_launchers" if public else "sglang"
        self._plan = launch_canary_plan_kernels if public else sg_plan
        self._verify = launch_canary_verify_kernel if public else sg_verify
        self._write = launch_canary_write_kernel if public else sg_write
        cfg = world.cfg
        self.ring = torch.zeros(cfg.ring_capacity, sg_consts.VIOLATION_FIELDS, dtype=torch.int64)
        self.write_index = torch.zeros(1, dtype=torch.int32)
        self.kernel_runs = torch.zeros(NUM_LAUNCH_TAGS, dtype=torch.int64)
        self.slot_runs = torch.zeros(NUM_LAUNCH_TAGS, dtype=torch.int64)
        self.chain_assert = torch.tensor([int(cfg.chain_position_assert)], dtype=torch.int32)

    def plan(self, gi: int, fwd: Forward) -> tuple[SgVerifyPlan, SgWritePlan]:
        g, cfg = self.world.groups[gi], self.world.cfg
        verify = SgVerifyPlan.allocate(verify_capacity=cfg.verify_capacity, device=torch.device("cpu"))
        write = SgWritePlan.allocate(write_req_capacity=max(1, fwd.write_req_capacity),
                                     device=torch.device("cpu"))  # fmt: skip
        self._plan(
            verify_plan_out=verify,
            write_plan_out=write,
            req_pool_indices=fwd.req_pool_indices,
            prefix_lens=fwd.prefix_lens,
            extend_seq_lens=fwd.extend_lens,
            req_to_token=self.world.req_to_token,
            swa_window_size=g.window or 0,
            full_to_swa_index_mapping=g.lut,
            verify_capacity=cfg.verify_capacity,
            req_to_verify_expected_tokens=fwd.expected_table,
            req_to_verify_expected_tokens_valid_lens=fwd.expected_lens,
            kv_token_id_vs_position_offset=cfg.token_offset,
        )
        return verify, write

    def context(self, gi: int, stage: LaunchStage, half: KvHalf) -> SgContext:
        tag = self.world.groups[gi].tag(stage, half)
        return SgContext(
            canary_buf=self.bufs[gi, stage, half],
            kernel_kind=SgTag(tag),
            violation_ring=self.ring,
            violation_write_index=self.write_index,
            slot_run_counter=self.slot_runs[tag : tag + 1],
            kernel_run_counter=self.kernel_runs[tag : tag + 1],
            real_kv_sources=self.sources[gi, half] if stage == LaunchStage.TAIL else (),
            real_kv_hash_mode=sg_consts.RealKvHashMode(int(self.world.cfg.mode)),
            enable_chain_position_assert=self.chain_assert,
        )

    def verify(self, gi: int, stage: LaunchStage, half: KvHalf, plan: Any, fwd: Forward) -> None:
        self._verify(context=self.context(gi, stage, half), plan=plan[0],
                  check_verify_expected_token=self.world.cfg.check_token)  # fmt: skip

    def verify_plan(self, gi: int, stage: LaunchStage, half: KvHalf, plan: SgVerifyPlan) -> None:
        """A verify of an explicit plan (cross-verification), token check off."""
        self._verify(context=self.context(gi, stage, half), plan=plan,
                  check_verify_expected_token=False)  # fmt: skip

    def write(self, gi: int, stage: LaunchStage, half: KvHalf, plan: Any, fwd: Forward) -> None:
        lut = self.world.groups[gi].lut
        # CanaryEndpoint.launch_per_forward: SWA endpoints gather lut[out_cache_loc].
        out_cache_loc = fwd.out_cache_loc if lut is None else lut[fwd.out_cache_loc]
        assert_inputs = fwd.expected_input_ids is not None
        self._write(
            context=self.context(gi, stage, half),
            plan=plan[1],
            input_ids=fwd.input_ids,
            positions=fwd.positions,
            out_cache_loc=out_cache_loc,
            enable_write_input_assert=assert_inputs,
            expected_input_tokens=fwd.expected_input_ids,
            expected_input_positions=fwd.expected_positions,
        )

    def ring_state(self) -> tuple[int, torch.Tensor]:
        n = int(self.write_index[0])
        return n, self.ring[: min(n, self.ring.shape[0])].clone()

    def counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel_runs.clone(), self.slot_runs.clone()


class OurImpl(Impl):
    def __init__(self, name: str, world: World) -> None:
        super().__init__(name, world)
        cfg = world.cfg
        self.ring = ViolationRing(cfg.ring_capacity)
        self.run_counters = RunCounters()
        self.backend = "numba" if name == "rows" else name
        self.planners = {
            gi: RowPlanner(verify_capacity=cfg.verify_capacity, window=g.window, lut=g.lut,
                           kv_token_id_vs_position_offset=cfg.token_offset)
            for gi, g in enumerate(world.groups)
        }  # fmt: skip

    def inputs(self, fwd: Forward) -> PlanInputs:
        return PlanInputs(
            req_to_token=self.world.req_to_token,
            req_pool_indices=fwd.req_pool_indices,
            prefix_lens=fwd.prefix_lens,
            extend_lens=fwd.extend_lens,
            input_ids=fwd.input_ids,
            positions=fwd.positions,
            out_cache_loc=fwd.out_cache_loc,
            expected_token_table=fwd.expected_table,
            expected_token_lens=fwd.expected_lens,
            expected_input_ids=fwd.expected_input_ids,
            expected_positions=fwd.expected_positions,
        )

    def plan(self, gi: int, fwd: Forward) -> Any:
        g, cfg = self.world.groups[gi], self.world.cfg
        if self.name == "rows":
            return self.planners[gi].plan(HostInputs.of(self.inputs(fwd)))
        return build_plans(self.inputs(fwd), verify_capacity=cfg.verify_capacity,
                           window=g.window, lut=g.lut,
                           kv_token_id_vs_position_offset=cfg.token_offset,
                           backend=self.backend)  # type: ignore[arg-type]  # fmt: skip

    def _sources(self, gi: int, stage: LaunchStage, half: KvHalf) -> tuple[Any, ...]:
        return self.sources[gi, half] if stage == LaunchStage.TAIL else ()

    def verify(self, gi: int, stage: LaunchStage, half: KvHalf, plan: Any, fwd: Forward) -> None:
        tag = self.world.groups[gi].tag(stage, half)
        kernels.verify(self.bufs[gi, stage, half], plan.verify, self.ring, tag,
                       real_kv_sources=self._sources(gi, stage, half),
                       check_token=self.world.cfg.check_token, counters=self.run_counters,
                       backend=self.backend)  # type: ignore[arg-type]  # fmt: skip

    def verify_plan(self, gi: int, stage: LaunchStage, half: KvHalf, plan: VerifyPlan) -> None:
        tag = self.world.groups[gi].tag(stage, half)
        kernels.verify(self.bufs[gi, stage, half], plan, self.ring, tag,
                       real_kv_sources=self._sources(gi, stage, half), counters=self.run_counters,
                       backend=self.backend if self.name != "rows" else "numba")  # type: ignore[arg-type]  # fmt: skip

    def write(self, gi: int, stage: LaunchStage, half: KvHalf, plan: Any, fwd: Forward) -> None:
        tag = self.world.groups[gi].tag(stage, half)
        kernels.write(self.bufs[gi, stage, half], plan.write, self.ring, tag,
                      real_kv_sources=self._sources(gi, stage, half),
                      chain_position_assert=self.world.cfg.chain_position_assert,
                      counters=self.run_counters, backend=self.backend)  # type: ignore[arg-type]  # fmt: skip

    def ring_state(self) -> tuple[int, torch.Tensor]:
        n = self.ring.num_recorded()
        return n, self.ring.rows[: min(n, self.ring.capacity)].clone()

    def counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run_counters.kernel_runs.clone(), self.run_counters.slots_processed.clone()


def make_impls(world: World, names: tuple[str, ...] = ALL_IMPLS) -> dict[str, Impl]:
    def make(name: str) -> Impl:
        if name.startswith("sglang"):
            return SglangImpl(world, public=name == "sglang_launchers")
        return OurImpl(name, world)

    return {n: make(n) for n in names}


# ----------------------------------------------------------------------------- comparison


def compare_plans(where: str, sg: tuple[SgVerifyPlan, SgWritePlan], ours: Any, bs: int) -> None:
    """SGLang's filled plan buffers hold exactly our materialised plan."""
    sv, sw = sg
    v, w = ours.verify, ours.write
    enable = bool(int(sv.enable[0]))
    if enable != v.enabled:
        raise Mismatch(f"{where}: verify enable sglang={enable} ours={v.enabled}")
    if enable:
        n = int(sv.verify_num_valid[0])
        if n != v.num_entries:
            raise Mismatch(f"{where}: verify entries sglang={n} ours={v.num_entries}")
        for name, theirs, mine in (
            ("slots", sv.verify_slot_indices, v.slots),
            ("prev_slots", sv.verify_prev_slot_indices, v.prev_slots),
            ("positions", sv.verify_expected_positions, v.positions),
            ("expected_tokens", sv.verify_expected_tokens, v.expected_tokens),
        ):
            if not torch.equal(theirs[:n], mine):
                raise Mismatch(f"{where}: verify {name}\n sglang={theirs[:n].tolist()}\n "
                               f"ours  ={mine.tolist()}")  # fmt: skip
    offsets = sw.write_offsets[: bs + 1]
    counts = offsets[1:] - offsets[:-1]
    if int(sw.write_num_valid_reqs[0]) != bs:
        raise Mismatch(f"{where}: write_num_valid_reqs {int(sw.write_num_valid_reqs[0])} != {bs}")
    if not torch.equal(counts, w.num_tokens):
        raise Mismatch(f"{where}: write counts sglang={counts.tolist()} ours={w.num_tokens.tolist()}")
    live = counts > 0
    if not torch.equal(offsets[:-1][live], w.token_starts[live]):
        raise Mismatch(f"{where}: write offsets sglang={offsets.tolist()} "
                       f"ours={w.token_starts.tolist()}")  # fmt: skip
    if not torch.equal(sw.write_seed_slot_indices[:bs], w.seed_slots):
        raise Mismatch(f"{where}: write seeds sglang={sw.write_seed_slot_indices[:bs].tolist()} "
                       f"ours={w.seed_slots.tolist()}")  # fmt: skip


def compare_state(where: str, impls: dict[str, Impl]) -> None:
    """Records, rings and counters of every implementation equal SGLang's."""
    sg = impls["sglang"]
    sg_n, sg_rows = sg.ring_state()
    sg_runs, sg_slots = sg.counters()
    for name, impl in impls.items():
        if impl is sg:
            continue
        for key, buf in sg.bufs.items():
            if not torch.equal(buf, impl.bufs[key]):
                diff = (buf != impl.bufs[key]).any(1).nonzero().flatten().tolist()
                raise Mismatch(
                    f"{where}: {name} records of {key} differ at slots {diff[:8]}: "
                    f"sglang={buf[diff[:2]].view(torch.int64).tolist()} "
                    f"ours={impl.bufs[key][diff[:2]].view(torch.int64).tolist()}"
                )
        n, rows = impl.ring_state()
        if n != sg_n or not torch.equal(rows, sg_rows):
            raise Mismatch(f"{where}: {name} ring (index {n}) != sglang's (index {sg_n})\n"
                           f" sglang={sg_rows.tolist()}\n ours  ={rows.tolist()}")  # fmt: skip
        runs, slots = impl.counters()
        if not torch.equal(runs, sg_runs) or not torch.equal(slots, sg_slots):
            raise Mismatch(f"{where}: {name} run counters {runs.tolist()} / {slots.tolist()} "
                           f"!= sglang's {sg_runs.tolist()} / {sg_slots.tolist()}")  # fmt: skip


@dataclass
class Stats:
    scenarios: int = 0
    forwards: int = 0
    plans: int = 0
    launches: int = 0
    violation_rows: int = 0
    corruptions: int = 0


STATS = Stats()


def run_forward(world: World, impls: dict[str, Impl], fwd: Forward, where: str) -> None:
    """Plan + HEAD per group, the attention store, then TAIL per group (SGLang's order)."""
    halves = list(KvHalf) if world.cfg.v_half else [KvHalf.K]
    plans: list[dict[str, Any]] = []
    for gi in range(len(world.groups)):
        per_impl = {name: impl.plan(gi, fwd) for name, impl in impls.items()}
        STATS.plans += 1
        if "sglang" in per_impl:
            for name in ("torch", "numba"):
                if name in per_impl:
                    compare_plans(f"{where} plan g{gi} {name}", per_impl["sglang"],
                                  per_impl[name], fwd.bs)  # fmt: skip
        plans.append(per_impl)
        for half in halves:
            _launch(world, impls, plans[gi], gi, LaunchStage.HEAD, half, fwd, where)
    world.store_kv(fwd)
    for gi in range(len(world.groups)):
        for half in halves:
            _launch(world, impls, plans[gi], gi, LaunchStage.TAIL, half, fwd, where)
    STATS.forwards += 1


def _launch(world: World, impls: dict[str, Impl], plans: dict[str, Any], gi: int,
            stage: LaunchStage, half: KvHalf, fwd: Forward, where: str) -> None:  # fmt: skip
    tag = world.groups[gi].tag(stage, half)
    for op in ("verify", "write"):
        for name, impl in impls.items():
            getattr(impl, op)(gi, stage, half, plans[name], fwd)
        if "sglang" in impls:
            try:
                compare_state(f"{where} {op} tag={tag}", impls)
            except Mismatch as e:
                if op == "write" and (alias := seed_aliasing(world, gi, fwd)):
                    raise Mismatch(f"{e}\nDIAGNOSIS (seed aliasing, see SEED_ALIASING): "
                                   f"{alias}") from None  # fmt: skip
                raise
        STATS.launches += 1


SEED_ALIASING = """\
A request's chain seed slot is also written by an EARLIER request of the same write launch
(only after a fault: a remapped req->token entry or LUT entry aliasing a fresh slot).
SGLang's write_ref walks requests in batch order on one buffer copy, so request r seeds from
the record request q < r just stored (chain and chain-position assert). Ours must too: every
write kernel reads a request's seed when that request starts (numba_kernels._write_kernel),
so a mismatch here is a regression of that. SGLang's CUDA kernel (one block per request,
concurrent) races here; its reference is the declared spec and what SGLang runs off CUDA."""


def seed_aliasing(world: World, gi: int, fwd: Forward) -> str | None:
    """Describe the first request whose seed slot an earlier request writes in this launch."""
    g = world.groups[gi]
    rows, prefix, extend = (fwd.req_pool_indices.tolist(), fwd.prefix_lens.tolist(),
                            fwd.extend_lens.tolist())  # fmt: skip
    locs = fwd.out_cache_loc if g.lut is None else g.lut[fwd.out_cache_loc]
    written: dict[int, int] = {}
    start = 0
    for r, (row, k, n) in enumerate(zip(rows, prefix, extend, strict=True)):
        if row != 0 and n > 0:
            if k > 0:
                seed = int(world.req_to_token[row, k - 1])
                seed = seed if g.lut is None else int(g.lut[seed])
                if seed in written:
                    return (f"group {gi}: batch row {r} (req row {row}) seeds from slot {seed}, "
                            f"written earlier in this launch by batch row {written[seed]}")  # fmt: skip
            for s in locs[start : start + n].tolist():
                written.setdefault(s, r)
        start += max(n, 0)
    return None


# ----------------------------------------------------------------------------- corruption


def corrupt(world: World, impls: dict[str, Impl], kind: str) -> str | None:
    """One single corruption, applied identically to every implementation (records) or to
    the shared inputs (req->token, KV bytes, LUT). Returns a description, None if not
    applicable now."""
    rng, cfg = world.rng, world.cfg
    if kind in ("token", "position", "chain", "real_kv_field"):
        gi = rng.randrange(len(world.groups))
        slots = world.used_slots(world.groups[gi])
        if not slots:
            return None
        key = (gi, rng.choice(STAGES), rng.choice(list(KvHalf) if cfg.v_half else [KvHalf.K]))
        slot, f = rng.choice(slots), ("token", "position", "chain", "real_kv_field").index(kind)
        value = rng.choice([rng.randrange(-(2**63), 2**63), None])
        for impl in impls.values():
            rec = impl.bufs[key].view(torch.int64)
            rec[slot, f] = value if value is not None else int(rec[slot, f]) + 1
        return f"{kind} of slot {slot} in {key}"
    if kind == "remap":
        reqs = [r for r in world.requests.values() if r.computed >= 2]
        used = world.used_slots(world.full)
        if not reqs or len(used) < 2:
            return None
        req = rng.choice(reqs)
        p = rng.randrange(req.computed)
        old = int(world.req_to_token[req.row, p])
        new = rng.choice([s for s in used if s != old])
        world.req_to_token[req.row, p] = new
        return f"req_to_token[{req.row}, {p}] {old} -> {new}"
    if kind == "kv_byte":
        if cfg.mode == RealKvHashMode.NONE:
            return None
        gi = rng.randrange(len(world.groups))
        slots = world.used_slots(world.groups[gi])
        if not slots:
            return None
        slot = rng.choice(slots)
        half = rng.choice(list(KvHalf) if cfg.v_half else [KvHalf.K])
        row, col = world.kv_cols(slot)
        byte = col + rng.randrange(cfg.bytes_per_token)
        world.groups[gi].kv[half][row, byte] ^= 1 << rng.randrange(8)
        return f"KV byte {byte - col} of slot {slot} ({half.name}, group {gi})"
    if kind == "lut":
        swa = world.swa
        if swa is None or swa.lut is None:
            return None
        full_slots = [s for s in world.used_slots(world.full) if int(swa.lut[s]) != 0]
        if not full_slots:
            return None
        s = rng.choice(full_slots)
        old = int(swa.lut[s])
        swa.lut[s] = rng.choice([0, rng.randrange(1, swa.num_slots)])
        return f"lut[{s}] {old} -> {int(swa.lut[s])}"
    raise ValueError(kind)


def run_scenario(cfg: ScenarioConfig, names: tuple[str, ...] = ALL_IMPLS,
                 *, clean: bool = False) -> tuple[World, dict[str, Impl]]:  # fmt: skip
    """Run ``cfg`` through ``names``, comparing after every launch; returns the final state."""
    rng = random.Random(cfg.seed * 7919 + 1)
    world = World(cfg, rng)
    impls = make_impls(world, names)
    for step in range(cfg.num_steps):
        if rng.random() < cfg.corruption_prob and corrupt(world, impls, rng.choice(CORRUPTIONS)):
            STATS.corruptions += 1
        fwd = world.next_forward(clean=clean)
        run_forward(world, impls, fwd, f"seed={cfg.seed} step={step}")
        world.finish_and_evict()
    STATS.scenarios += 1
    if "sglang" in impls:
        STATS.violation_rows += impls["sglang"].ring_state()[0]
    return world, impls


def sweep_entries(world: World, gi: int) -> tuple[list[int], list[int], list[int]]:
    """(slot, prev slot, position) of every committed position of every running request,
    in this group's slot space (SWA: through the LUT; 0 = not resident)."""
    g = world.groups[gi]
    slots, prevs, positions = [], [], []
    for req in world.requests.values():
        row = world.req_to_token[req.row, : req.computed].long()
        if g.lut is not None:
            row = g.lut[row]
        for p in range(req.computed):
            slots.append(int(row[p]))
            prevs.append(int(row[p - 1]) if p else -1)
            positions.append(p)
    return slots, prevs, positions


def sweep_plans(world: World, gi: int) -> tuple[SgVerifyPlan, VerifyPlan] | None:
    slots, prevs, positions = sweep_entries(world, gi)
    if not slots:
        return None
    n = len(slots)
    sg = SgVerifyPlan.allocate(verify_capacity=n, device=torch.device("cpu"))
    sg.verify_slot_indices.copy_(torch.tensor(slots))
    sg.verify_prev_slot_indices.copy_(torch.tensor(prevs))
    sg.verify_expected_positions.copy_(torch.tensor(positions))
    sg.verify_expected_tokens.fill_(-1)
    sg.verify_num_valid.fill_(n)
    ours = VerifyPlan.from_entries(torch.tensor(slots), torch.tensor(prevs), torch.tensor(positions))
    return sg, ours
