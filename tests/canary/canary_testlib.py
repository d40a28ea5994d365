"""Helpers for the canary tests: the three kernel implementations, random real-KV sources,
and a toy KV system (full pool, optional SWA sub-pool + LUT, req→token table) that produces
engine-style :class:`PlanInputs` step by step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import reference_kernels
import torch

from kvcanary.canary.kernels import numba_kernels as kernels_numba
from kvcanary.canary.kernels import torch_kernels as kernels_torch
from kvcanary.canary.plan.reference import PlanInputs
from kvcanary.canary.plan.types import WritePlan
from kvcanary.canary.report.ring import ViolationRing
from kvcanary.canary.wire.constants import CanaryLaunchTag
from kvcanary.canary.wire.real_kv import RealKvSource
from kvcanary.canary.wire.records import as_int64_records

IMPLS: dict[str, ModuleType] = {
    "numba": kernels_numba,
    "torch": kernels_torch,
    "reference": reference_kernels,
}


def force_split(m: pytest.MonkeyPatch) -> None:
    """Every row-plan verify on two threads (:func:`.kernels_numba._split_rows`), however
    small, and however many cores the machine has (prange runs the two runs in turn on one)."""
    m.setattr(kernels_numba, "SPLIT_MIN_WORK", 0)
    m.setattr(kernels_numba, "parallel_threads", lambda: 2)


def make_sources(
    num_slots: int,
    rng: random.Random,
    *,
    num_sources: int,
    page_size: int = 1,
    bytes_per_token: int = 16,
    read_bytes: int = 16,
    extra_row_bytes: int = 0,
) -> list[RealKvSource]:
    """``num_sources`` random KV buffers covering ``num_slots`` slots."""
    num_rows = -(-num_slots // page_size)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    width = page_size * bytes_per_token + extra_row_bytes
    return [
        RealKvSource(
            torch.randint(0, 256, (num_rows, width), dtype=torch.uint8, generator=gen),
            page_size,
            bytes_per_token,
            read_bytes,
        )
        for _ in range(num_sources)
    ]


def make_strided_sources(
    num_slots: int,
    rng: random.Random,
    *,
    num_sources: int,
    page_size: int,
    element_size: int,
    token_bytes: int,
    read_bytes: int,
) -> list[RealKvSource]:
    """``num_sources`` random KV buffers laid out like vLLM's CPU K: each row a transposed
    ``[token_bytes // element_size, page_size]`` tile of elements (a token's elements
    ``page_size * element_size`` bytes apart); strided sources (``page_size > 1``)."""
    num_rows = -(-num_slots // page_size)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return [
        RealKvSource(
            torch.randint(0, 256, (num_rows, page_size * token_bytes), dtype=torch.uint8,
                          generator=gen),
            page_size, element_size, read_bytes,
            element_size=element_size, element_stride=page_size * element_size,
        )  # fmt: skip
        for _ in range(num_sources)
    ]


def written_fingerprints(impl: ModuleType, sources: list[RealKvSource], slots: list[int]) -> list[int]:
    """Field 3 that ``impl``'s write kernel stores for ``slots`` (one request, from the
    anchor, into fresh records)."""
    n = len(slots)
    records = torch.zeros(max(slots) + 1, 32, dtype=torch.uint8)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    plan = WritePlan(t([-1]), t([0]), t([n]), t([0] * n), t(list(range(n))), t(slots), n, n)
    impl.write(records, plan, ViolationRing(4), CanaryLaunchTag.TAIL_K_FULL,
               real_kv_sources=sources)  # fmt: skip
    return as_int64_records(records)[t(slots), 3].tolist()


def store_kv(sources: list[RealKvSource], slots: list[int], rng: random.Random) -> None:
    """Simulate attention storing fresh KV bytes for ``slots`` (the whole token stride; a
    strided source's read window)."""
    for s in sources:
        for slot in slots:
            if s.strided:
                row, cols = s.byte_offsets(slot)
                fresh = [rng.randrange(256) for _ in cols]
                s.tensor[row, torch.tensor(cols)] = torch.tensor(fresh, dtype=torch.uint8)
                continue
            row, offset = divmod(slot, s.page_size)
            col = offset * s.num_bytes_per_token
            fresh = [rng.randrange(256) for _ in range(s.num_bytes_per_token)]
            s.tensor[row, col : col + s.num_bytes_per_token] = torch.tensor(
                fresh, dtype=torch.uint8
            )


@dataclass
class ToyKvSystem:
    """Slot allocation and req→token bookkeeping for canary round-trip tests.

    Slot 0 of both pools and row 0 of ``req_to_token`` are padding. With ``window`` set, every
    token also gets an SWA slot (``lut[full] = swa``) and :meth:`evict_out_of_window` frees the
    SWA slots of positions ``< seq_len - window`` (``lut`` entry back to 0).
    """

    num_full_slots: int
    num_rows: int
    max_context_len: int
    rng: random.Random
    window: int | None = None
    num_swa_slots: int = 0
    vocab_size: int = 50
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.req_to_token = torch.zeros(self.num_rows, self.max_context_len, dtype=torch.int32)
        self.free_full = list(range(1, self.num_full_slots))
        self.free_swa = list(range(1, self.num_swa_slots))
        self.rng.shuffle(self.free_full)
        self.rng.shuffle(self.free_swa)
        self.lut = torch.zeros(self.num_full_slots + 1, dtype=torch.int64)
        self.lut[-1] = -1  # the "no prefix" sentinel entry of the full→SWA mapping

    def free_rows(self) -> list[int]:
        return [r for r in range(1, self.num_rows) if r not in self.tokens]

    def share_prefix(self, row: int, donor: int, num_tokens: int) -> None:
        """Start ``row`` as a radix hit on ``donor``'s first ``num_tokens`` tokens."""
        self.tokens[row] = list(self.tokens[donor][:num_tokens])
        self.req_to_token[row, :num_tokens] = self.req_to_token[donor, :num_tokens]

    def step(self, batch: list[tuple[int, int]], num_padding_rows: int = 0) -> PlanInputs:
        """One forward: each ``(row, num_new_tokens)`` appends fresh tokens; padding rows last."""
        rows, prefix_lens, extend_lens, ids, pos, locs = [], [], [], [], [], []
        for row, num_new in batch:
            seq = self.tokens.setdefault(row, [])
            rows.append(row)
            prefix_lens.append(len(seq))
            extend_lens.append(num_new)
            for _ in range(num_new):
                slot = self.free_full.pop()
                self.req_to_token[row, len(seq)] = slot
                if self.window is not None:
                    self.lut[slot] = self.free_swa.pop()
                ids.append(self.rng.randrange(self.vocab_size))
                pos.append(len(seq))
                locs.append(slot)
                seq.append(ids[-1])
        for _ in range(num_padding_rows):  # graph padding: row 0, one token into slot 0
            rows.append(0)
            prefix_lens.append(0)
            extend_lens.append(1)
            ids.append(0)
            pos.append(0)
            locs.append(0)
        table = torch.zeros(self.num_rows, self.max_context_len, dtype=torch.int32)
        for row, seq in self.tokens.items():
            table[row, : len(seq)] = torch.tensor(seq, dtype=torch.int32)
        lens = [len(self.tokens[r]) if r else 0 for r in rows]

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        return PlanInputs(
            req_to_token=self.req_to_token.clone(),
            req_pool_indices=t(rows),
            prefix_lens=t(prefix_lens),
            extend_lens=t(extend_lens),
            input_ids=t(ids),
            positions=t(pos),
            out_cache_loc=t(locs),
            expected_token_table=table,
            expected_token_lens=t(lens),
            expected_input_ids=t(ids),
            expected_positions=t(pos),
        )

    def evict_out_of_window(self) -> None:
        assert self.window is not None
        for row, seq in self.tokens.items():
            for p in range(max(0, len(seq) - self.window)):
                full = int(self.req_to_token[row, p])
                if self.lut[full] != 0:
                    self.free_swa.append(int(self.lut[full]))
                    self.lut[full] = 0

    def finish(self, row: int) -> None:
        """Free a request's slots (stale records stay behind, as in a real pool)."""
        for p in range(len(self.tokens.pop(row))):
            full = int(self.req_to_token[row, p])
            if self.window is not None and self.lut[full] != 0:
                self.free_swa.append(int(self.lut[full]))
                self.lut[full] = 0
            self.free_full.append(full)
        self.req_to_token[row] = 0
