"""Triton plan builder: :func:`kvcanary.canary.plan.reference.build_plans` on CUDA (and on CPU tensors
when imported under ``TRITON_INTERPRET=1``, as the tests do), the same plans bit for bit
and the same errors as the torch and numba builders.

Plans are exact-sized, so the host reads a few counts, as the torch builder does::

    P1  one program      per row: verify start and first entry, seed, token start, count;
                         totals; req->token / expected-token row checks     -> host read 1
    PT  grid: tokens     write slots (full->SWA translation of out_cache_loc)
    P2  grid: rows       verify entries (slot, prev, position, expected token), holes per
                         row; LUT checks                                    -> host read 2 *
    P3  one program      the holes, in entry order (only when there are any)

    * only when a LUT can fail or holes are listed

Errors raise exactly as the other builders': ``ValueError`` when ``extend_lens`` overrun
the flat tokens, ``IndexError`` for a req->token row or position, an expected-token row or
a slot outside the LUT.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvcanary.canary.plan.types import (
    CanaryPlans,
    PlanInputs,
    VerifyPlan,
    WritePlan,
    long_or_none,
)
from kvcanary.canary.wire.constants import NO_SLOT, NO_TOKEN

_NO_SLOT = tl.constexpr(NO_SLOT)
_NO_TOKEN = tl.constexpr(NO_TOKEN)
# info (int64 [6], one per build): the host's reads.
_TOTAL_VERIFY, _TOTAL_EXTEND, _TOTAL_WRITE, _MAX_WRITE, _NUM_HOLES, _ERRORS = range(6)
_I_TOTAL_VERIFY = tl.constexpr(_TOTAL_VERIFY)
_I_TOTAL_EXTEND = tl.constexpr(_TOTAL_EXTEND)
_I_TOTAL_WRITE = tl.constexpr(_TOTAL_WRITE)
_I_MAX_WRITE = tl.constexpr(_MAX_WRITE)
_I_NUM_HOLES = tl.constexpr(_NUM_HOLES)
_I_ERRORS = tl.constexpr(_ERRORS)
_ERR_ROW, _ERR_LUT = 1, 2
_E_ROW = tl.constexpr(_ERR_ROW)
_E_LUT = tl.constexpr(_ERR_LUT)

_BLOCK = 256
_SCAN_BLOCK = 1024


@triton.jit
def _translate(slot, mask, lut, lut_len, HAS_LUT: tl.constexpr):
    """(full->SWA slot, out of the LUT?) where ``mask``; negative sentinels pass through."""
    if HAS_LUT:
        look = mask & (slot >= 0)
        bad = look & (slot >= lut_len)
        ok = look & ~bad
        mapped = tl.load(lut + tl.where(ok, slot, 0), mask=ok, other=0).to(tl.int64)
        return tl.where(look, mapped, slot), bad
    else:
        return slot, slot != slot


@triton.jit
def _flag(info, num_bad, code: tl.constexpr):
    if num_bad > 0:
        tl.atomic_or(info + _I_ERRORS, code)


@triton.jit
def _row_state(rows, prefix_lens, extend_lens, r, m, window):
    """(req->token row, prefix_len, clamped extend_len, real row?, verify start, verify count)."""
    row = tl.load(rows + r, mask=m, other=0).to(tl.int64)
    prefix = tl.load(prefix_lens + r, mask=m, other=0).to(tl.int64)
    extend = tl.load(extend_lens + r, mask=m, other=0).to(tl.int64)
    extend = tl.maximum(extend, 0)
    real = m & (row != 0)
    start = tl.where(window > 0, tl.maximum(prefix - window, 0), 0)
    count = tl.where(real, tl.maximum(prefix - start, 0), 0)
    return row, prefix, extend, real, start, count


@triton.jit(
    do_not_specialize=["r2t_s0", "r2t_s1", "r2t_rows", "r2t_cols", "bs", "window", "lut_len",
        "table_rows"]
)
def _plan_rows(
    r2t, r2t_s0, r2t_s1, r2t_rows, r2t_cols, rows, prefix_lens, extend_lens, bs, window,
    lut, lut_len, table_rows, verify_first, seeds, token_starts, num_tokens, info,
    HAS_LUT: tl.constexpr, HAS_TABLE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """P1: the per-row plan metadata and the totals."""
    bs = tl.cast(bs, tl.int64)
    window = tl.cast(window, tl.int64)
    carry_verify = tl.zeros([], tl.int64)
    carry_extend = tl.zeros([], tl.int64)
    total_write = tl.zeros([], tl.int64)
    max_write = tl.zeros([], tl.int64)
    num_bad_rows = tl.zeros([], tl.int32)
    num_bad_lut = tl.zeros([], tl.int32)
    for r0 in range(0, bs, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        m = r < bs
        row, prefix, extend, real, _, count = _row_state(rows, prefix_lens, extend_lens, r, m,
                                                         window)  # fmt: skip
        bad_row = real & ((row < 0) | (row >= r2t_rows) | (prefix > r2t_cols))
        if HAS_TABLE:
            bad_row |= real & (row >= table_rows)
        write_count = tl.where(real, extend, 0)
        has_seed = real & ~bad_row & (prefix > 0) & (extend > 0)
        seed = tl.load(r2t + row * r2t_s0 + (prefix - 1) * r2t_s1, mask=has_seed, other=0)
        seed, bad_lut = _translate(seed.to(tl.int64), has_seed, lut, lut_len, HAS_LUT)
        tl.store(seeds + r, tl.where(has_seed, seed, _NO_SLOT), mask=m)
        tl.store(verify_first + r, carry_verify + tl.cumsum(count, 0) - count, mask=m)
        tl.store(token_starts + r, carry_extend + tl.cumsum(extend, 0) - extend, mask=m)
        tl.store(num_tokens + r, write_count, mask=m)
        carry_verify += tl.sum(count, 0)
        carry_extend += tl.sum(extend, 0)
        total_write += tl.sum(write_count, 0)
        max_write = tl.maximum(max_write, tl.max(write_count, 0))
        num_bad_rows += tl.sum(bad_row.to(tl.int32), 0)
        num_bad_lut += tl.sum(bad_lut.to(tl.int32), 0)
    tl.store(info + _I_TOTAL_VERIFY, carry_verify)
    tl.store(info + _I_TOTAL_EXTEND, carry_extend)
    tl.store(info + _I_TOTAL_WRITE, total_write)
    tl.store(info + _I_MAX_WRITE, max_write)
    _flag(info, num_bad_rows, _E_ROW)
    _flag(info, num_bad_lut, _E_LUT)


@triton.jit(do_not_specialize=["n", "lut_len"])
def _translate_tokens(locs, n, lut, lut_len, out, info, HAS_LUT: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """PT: write slots = translated ``out_cache_loc``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < tl.cast(n, tl.int64)
    slot = tl.load(locs + offs, mask=m, other=0).to(tl.int64)
    slot, bad = _translate(slot, m, lut, lut_len, HAS_LUT)
    tl.store(out + offs, slot, mask=m)
    _flag(info, tl.sum(bad.to(tl.int32), 0), _E_LUT)


@triton.jit
def _row_entries(r2t, r2t_s0, r2t_s1, row, start, j, m, lut, lut_len, HAS_LUT: tl.constexpr):
    """(position, full slot, slot, prev slot, LUT misses) of a row's verify entries ``j``."""
    pos = start + j
    base = r2t + row * r2t_s0
    full = tl.load(base + pos * r2t_s1, mask=m, other=0).to(tl.int64)
    has_prev = m & (pos > 0)
    prev = tl.load(base + (pos - 1) * r2t_s1, mask=has_prev, other=0).to(tl.int64)
    prev = tl.where(has_prev, prev, _NO_SLOT)
    slot, bad = _translate(full, m, lut, lut_len, HAS_LUT)
    prev, bad_prev = _translate(prev, m, lut, lut_len, HAS_LUT)
    return pos, full, slot, prev, bad | bad_prev


@triton.jit(
    do_not_specialize=["r2t_s0", "r2t_s1", "window", "lut_len", "table_s0", "table_s1",
        "table_cols", "offset"]
)
def _plan_verify(
    r2t, r2t_s0, r2t_s1, rows, prefix_lens, extend_lens, window, lut, lut_len, table,
    table_s0, table_s1, table_cols, table_lens, offset, verify_first, out_slots, out_prev,
    out_positions, out_tokens, holes_per_row, info,
    HAS_LUT: tl.constexpr, HAS_TABLE: tl.constexpr, CHECK_HOLES: tl.constexpr,
    HOLE_MARGIN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """P2: row ``r``'s verify entries; its hole count."""
    r = tl.program_id(0).to(tl.int64)
    window = tl.cast(window, tl.int64)
    row, prefix, _, _, start, count = _row_state(rows, prefix_lens, extend_lens, r, r >= 0,
                                                 window)  # fmt: skip
    first = tl.load(verify_first + r)
    needed_from = tl.where(window > 0, tl.maximum(prefix - window + HOLE_MARGIN, 0), 0)
    if HAS_TABLE:
        num_valid_tokens = tl.load(table_lens + r).to(tl.int64)
    num_holes = tl.zeros([], tl.int64)
    num_bad = tl.zeros([], tl.int32)
    for j0 in range(0, count, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < count
        pos, _full, slot, prev, bad = _row_entries(r2t, r2t_s0, r2t_s1, row, start, j, m, lut,
                                               lut_len, HAS_LUT)  # fmt: skip
        if HAS_TABLE:
            idx = pos + offset
            ok = m & (idx >= 0) & (idx < num_valid_tokens) & (idx < table_cols)
            token = tl.load(table + row * table_s0 + idx * table_s1, mask=ok, other=0)
            token = tl.where(ok, token.to(tl.int64), _NO_TOKEN)
        else:
            token = tl.full(pos.shape, _NO_TOKEN, tl.int64)
        tl.store(out_slots + first + j, slot, mask=m)
        tl.store(out_prev + first + j, prev, mask=m)
        tl.store(out_positions + first + j, pos, mask=m)
        tl.store(out_tokens + first + j, token, mask=m)
        if CHECK_HOLES:
            num_holes += tl.sum((m & (slot == 0) & (pos >= needed_from)).to(tl.int64), 0)
        num_bad += tl.sum(bad.to(tl.int32), 0)
    tl.store(holes_per_row + r, num_holes)
    if CHECK_HOLES:
        tl.atomic_add(info + _I_NUM_HOLES, num_holes)
    _flag(info, num_bad, _E_LUT)


@triton.jit(do_not_specialize=["r2t_s0", "r2t_s1", "bs", "window", "lut_len", "num_holes"])
def _plan_holes(
    r2t, r2t_s0, r2t_s1, rows, prefix_lens, extend_lens, bs, window, lut, lut_len,
    holes_per_row, holes, num_holes, HAS_LUT: tl.constexpr, HOLE_MARGIN: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """P3: ``holes[:, k]`` = (full slot, position, prefix_len) of the k-th hole."""
    bs = tl.cast(bs, tl.int64)
    window = tl.cast(window, tl.int64)
    num_holes = tl.cast(num_holes, tl.int64)
    carry = tl.zeros([], tl.int64)
    for r in range(0, bs):
        if tl.load(holes_per_row + r) > 0:
            row, prefix, _extend, _real, start, count = _row_state(
                rows, prefix_lens, extend_lens, r, r >= 0, window
            )
            needed_from = tl.where(window > 0, tl.maximum(prefix - window + HOLE_MARGIN, 0), 0)
            for j0 in range(0, count, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                m = j < count
                pos, full, slot, _prev, _bad = _row_entries(r2t, r2t_s0, r2t_s1, row, start, j,
                                                            m, lut, lut_len, HAS_LUT)  # fmt: skip
                hole = (m & (slot == 0) & (pos >= needed_from)).to(tl.int64)
                k = carry + tl.cumsum(hole, 0) - hole
                keep = hole != 0
                tl.store(holes + k, full, mask=keep)
                tl.store(holes + num_holes + k, pos, mask=keep)
                tl.store(holes + 2 * num_holes + k, tl.zeros_like(pos) + prefix, mask=keep)
                carry += tl.sum(hole, 0)


def is_interpreted() -> bool:
    """Whether these kernels were imported under ``TRITON_INTERPRET=1`` (CPU tensors)."""
    return isinstance(_plan_rows, InterpretedFunction)


def _raise_on_errors(errors: int) -> None:
    if errors & _ERR_ROW:
        raise IndexError("kv-canary plan: req_to_token index out of range")
    if errors & _ERR_LUT:
        raise IndexError("kv-canary plan: slot out of range of the LUT")


def build_plans_triton(
    inputs: PlanInputs,
    verify_capacity: int,
    window: int | None,
    lut: torch.Tensor | None,
    offset: int,
    check_residency: int = 1,
) -> CanaryPlans:
    """:func:`kvcanary.canary.plan.reference.build_plans` with Triton kernels (arguments checked there)."""
    r2t = inputs.req_to_token
    device = r2t.device
    if device.type != "cuda" and not is_interpreted():
        raise ValueError(
            f"triton plan builder needs CUDA tensors, got device {device} (CPU tensors run only "
            f"when kvcanary.canary.plan.triton_plan is imported under TRITON_INTERPRET=1)"
        )
    bs, num_flat = inputs.req_pool_indices.shape[0], inputs.out_cache_loc.shape[0]
    rows, prefix = inputs.req_pool_indices.contiguous(), inputs.prefix_lens.contiguous()
    extend = inputs.extend_lens.contiguous()
    has_lut = lut is not None
    lut_t = lut.contiguous() if lut is not None else r2t  # r2t: a never-read dummy
    lut_len = lut_t.shape[0] if has_lut else 0
    table, table_lens = inputs.expected_token_table, inputs.expected_token_lens
    has_table = table is not None and table_lens is not None
    table_t = table if table is not None and has_table else r2t
    table_lens_t = table_lens.contiguous() if table_lens is not None and has_table else rows
    win = window or 0
    info = torch.zeros(6, dtype=torch.int64, device=device)
    per_row = [torch.empty(bs, dtype=torch.int64, device=device) for _ in range(4)]
    verify_first, seeds, token_starts, num_tokens = per_row
    write_slots = torch.empty(num_flat, dtype=torch.int64, device=device)
    if bs:
        _plan_rows[(1,)](
            r2t, r2t.stride(0), r2t.stride(1), r2t.shape[0], r2t.shape[1], rows, prefix, extend,
            bs, win, lut_t, lut_len, table_t.shape[0], verify_first, seeds, token_starts,
            num_tokens, info, HAS_LUT=has_lut, HAS_TABLE=has_table, BLOCK=_SCAN_BLOCK,
        )  # fmt: skip
    if num_flat:
        _translate_tokens[(triton.cdiv(num_flat, _BLOCK),)](
            inputs.out_cache_loc.contiguous(), num_flat, lut_t, lut_len, write_slots, info,
            HAS_LUT=has_lut, BLOCK=_BLOCK,
        )  # fmt: skip
    total_verify, total_extend, total_write, max_write, _, errors = info.tolist()
    if total_extend > inputs.input_ids.shape[0]:
        raise ValueError(
            f"extend_lens sum to {total_extend} > {inputs.input_ids.shape[0]} flat tokens"
        )
    _raise_on_errors(errors)

    holes = None
    if total_verify > verify_capacity:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        verify = VerifyPlan(empty, empty, empty, empty, False, total_verify)
    else:
        out = [torch.empty(total_verify, dtype=torch.int64, device=device) for _ in range(4)]
        check_holes = bool(check_residency) and total_verify > 0
        margin = 1 if check_residency == 1 else 0  # 2: the window's start is read too
        if total_verify:
            holes_per_row = torch.empty(bs, dtype=torch.int64, device=device)
            _plan_verify[(bs,)](
                r2t, r2t.stride(0), r2t.stride(1), rows, prefix, extend, win, lut_t, lut_len,
                table_t, table_t.stride(0), table_t.stride(1), table_t.shape[1], table_lens_t,
                offset, verify_first, *out, holes_per_row, info, HAS_LUT=has_lut,
                HAS_TABLE=has_table, CHECK_HOLES=check_holes, HOLE_MARGIN=margin,
                BLOCK=_BLOCK,
            )  # fmt: skip
            if has_lut or check_holes:
                num_holes, errors = info[_NUM_HOLES:].tolist()
                _raise_on_errors(errors)
                if num_holes:
                    holes = torch.empty(3, num_holes, dtype=torch.int64, device=device)
                    _plan_holes[(1,)](
                        r2t, r2t.stride(0), r2t.stride(1), rows, prefix, extend, bs, win,
                        lut_t, lut_len, holes_per_row, holes, num_holes, HAS_LUT=has_lut,
                        HOLE_MARGIN=margin, BLOCK=_BLOCK,
                    )  # fmt: skip
        verify = VerifyPlan(out[0], out[1], out[2], out[3], True, total_verify)

    write = WritePlan(
        seed_slots=seeds,
        token_starts=token_starts,
        num_tokens=num_tokens,
        token_ids=inputs.input_ids.long(),
        positions=inputs.positions.long(),
        slots=write_slots,
        max_num_tokens=max_write,
        total_num_tokens=total_write,
        expected_token_ids=long_or_none(inputs.expected_input_ids),
        expected_positions=long_or_none(inputs.expected_positions),
    )
    return CanaryPlans(verify, write, holes)
