"""Static-capacity decode plans: the planner of the graph-safe canary.

A captured CUDA graph replays fixed shapes at fixed addresses, and nothing inside it may read
the device from the host. The per-forward planners (:mod:`.row_plan`, :mod:`.plan`) size a
plan by the batch (a host read of a few counts, and holes listed on the host); this one plans
a decode step of a graph bucket (``B`` rows, one new token each, keys at most ``width``) into
tensors whose shapes depend only on ``(B, width)``, with device ops only: no ``.item()``, no
``nonzero``, no output whose size depends on data. Batch row ``r`` (req->token row ``rp``,
``K`` = prefix length = position of its new token)::

    verify grid  [B, G] flattened, entry (r, j): position p = start_r + j
                 G = width (FULL) or min(window, width) (SWA)
                 start_r = 0 (FULL) or max(0, K - window) (SWA)
                 live: p < K and rp != 0; a dead entry has slot 0 (the kernels skip it)
                 slot = LUT[req_to_token[rp, p]], prev = LUT[req_to_token[rp, p - 1]]
                 (-1 at p = 0), expected token from the table (or -1), as :mod:`.plan`
    holes        live entries attention reads with slot 0 (FULL: [0, K); SWA: [K - W + 1, K)),
                 as ring candidates + a mask (:meth:`.ring.ViolationRing.append_t` appends
                 them without a host read)
    write        one token per row, chained from LUT[req_to_token[rp, K - 1]] (-1 when
                 K = 0); a padding row's token has slot -1 (skipped); totals are B

The entries are those of :func:`.plan.build_plans` in the same order, plus dead entries, so
the kernels leave the same records and ring rows; the run counters count dead entries as
processed (an entry scanned). There is no verify-capacity check: the grid is the capacity.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvcanary.canary.plan.reference import translate_slots
from kvcanary.canary.plan.types import CanaryPlans, PlanInputs, VerifyPlan, WritePlan, long_or_none
from kvcanary.canary.wire.constants import (
    NO_SLOT,
    NO_TOKEN,
    REQ_POOL_IDX_PADDING,
    RING_COL_EXPECTED_AUX,
    RING_COL_EXPECTED_TOKEN,
    RING_COL_FAIL_REASON,
    RING_COL_LAUNCH_TAG,
    RING_COL_POSITION,
    RING_COL_SLOT_IDX,
    RING_COL_STORED_TOKEN,
    VIOLATION_ROW_FIELDS,
    FailReason,
)

STATIC_KEY_WIDTH_BUCKET = 64  # the GraphRunner's key-width bucket on CUDA


def static_key_width(fb: Any, max_keys: int) -> int:
    """The verify grid width of a decode batch: its longest sequence (host metadata:
    ``seq_lens_cpu``, when the batch has it) rounded up to the bucket, at most ``max_keys``
    (the req->token table's width, used when the batch has no host lengths)."""
    lens = getattr(fb, "seq_lens_cpu", None)
    if not lens:
        return max_keys
    bucket = STATIC_KEY_WIDTH_BUCKET
    return max(1, min(-(-max(lens) // bucket) * bucket, max_keys))


class StaticPlans(NamedTuple):
    """One group's plans of one decode step, with its holes as ring candidates."""

    plans: CanaryPlans  # verify: [B * G] entries; write: B tokens; holes: None
    hole_rows: torch.Tensor  # int64 [B * G, 8]: verify_not_resident rows (tag column 0)
    hole_mask: torch.Tensor  # bool [B * G]: which rows are holes
    num_live: torch.Tensor  # int64 [1]: live verify entries (for stats; no host read)


def is_decode(batch: Any) -> bool:
    """One new token per row (host-side shapes only): a :class:`PlanInputs` or a forward
    batch (``input_ids``, ``req_pool_indices``)."""
    return bool(batch.input_ids.shape[0] == batch.req_pool_indices.shape[0])


def build_static_decode_plans(
    inputs: PlanInputs,
    width: int,
    *,
    window: int | None = None,
    lut: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
    check_residency: int = 1,
    hole_tag: int = 0,
    compiled: bool = False,
) -> StaticPlans:
    """Plans of one per-position group (FULL: ``window`` None; SWA: its window and the
    full->SWA ``lut``) for a decode step whose rows see at most ``width`` keys (module doc).
    ``inputs.prefix_lens`` must be each row's position (``seq_len - 1``). ``hole_tag``: the
    hole rows' launch tag column. ``compiled``: the tensor work through ``torch.compile``
    (:func:`compiled_static_tensors`; same tensors, a few fused kernels instead of ~90)."""
    if not is_decode(inputs):
        raise ValueError(
            f"static decode plans need one new token per row: {inputs.input_ids.shape[0]} "
            f"tokens for {inputs.req_pool_indices.shape[0]} rows"
        )
    if width < 1 or (window is not None and window < 1):
        raise ValueError(f"static decode plan width={width}, window={window}; allowed: >= 1")
    core = compiled_static_tensors() if compiled else static_tensors
    (slots, prev, pos, expected, hole_rows, hole_mask, seed, write_slots, num_live) = core(
        inputs.req_to_token, inputs.req_pool_indices, inputs.prefix_lens, inputs.out_cache_loc,
        lut, inputs.expected_token_table, inputs.expected_token_lens, width=width,
        window=window, offset=kv_token_id_vs_position_offset, check_residency=check_residency,
        hole_tag=hole_tag,
    )  # fmt: skip
    bs = inputs.req_pool_indices.shape[0]
    verify = VerifyPlan(slots, prev, pos, expected, True, int(slots.shape[0]))
    write = WritePlan(
        seed_slots=seed,
        token_starts=torch.arange(bs, device=slots.device),
        num_tokens=torch.ones(bs, dtype=torch.int64, device=slots.device),
        token_ids=inputs.input_ids.long(),
        positions=inputs.positions.long(),
        slots=write_slots,
        max_num_tokens=1 if bs else 0,
        total_num_tokens=bs,
        expected_token_ids=long_or_none(inputs.expected_input_ids),
        expected_positions=long_or_none(inputs.expected_positions),
    )
    return StaticPlans(CanaryPlans(verify, write, None), hole_rows, hole_mask, num_live)


def static_tensors(
    r2t: torch.Tensor, rows_in: torch.Tensor, prefix_in: torch.Tensor,
    out_cache_loc: torch.Tensor, lut: torch.Tensor | None, table: torch.Tensor | None,
    table_lens: torch.Tensor | None, *, width: int, window: int | None, offset: int,
    check_residency: int, hole_tag: int,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The tensor work of :func:`build_static_decode_plans`: verify slots, prev slots,
    positions, expected tokens (flat ``[B * G]``), hole rows and mask, the write's seed and
    slots, the live-entry count. Device ops only, shapes from ``(B, width)`` only."""
    device = r2t.device
    rows = rows_in.long()
    prefix = prefix_in.long()
    real = rows != REQ_POOL_IDX_PADDING
    bs = rows.shape[0]
    grid = width if window is None else min(window, width)
    start = torch.zeros_like(prefix) if window is None else (prefix - window).clamp(min=0)
    pos = start[:, None] + torch.arange(grid, device=device)[None, :]  # [B, G]
    live = real[:, None] & (pos < prefix[:, None])
    col = torch.where(live, pos, 0)
    row2 = rows[:, None].expand(bs, grid)
    full = torch.where(live, r2t[row2, col].long(), 0)
    prev_full = torch.where(live & (pos > 0), r2t[row2, (col - 1).clamp(min=0)].long(), NO_SLOT)
    slots = torch.where(live, translate_slots(full, lut), 0)
    prev = torch.where(live, translate_slots(prev_full, lut), 0)
    expected = torch.full_like(pos, NO_TOKEN)
    if table is not None and table_lens is not None:
        idx = pos + offset
        ok = live & (idx >= 0) & (idx < table_lens.long()[:, None]) & (idx < table.shape[1])
        expected = torch.where(ok, table[row2, torch.where(ok, idx, 0)].long(), NO_TOKEN)

    hole_rows = torch.zeros(bs * grid, VIOLATION_ROW_FIELDS, dtype=torch.int64, device=device)
    hole_mask = torch.zeros(bs * grid, dtype=torch.bool, device=device)
    if check_residency:
        needed_from = (torch.zeros_like(prefix) if window is None
                       else (prefix - window + int(check_residency == 1)).clamp(min=0))  # fmt: skip
        hole_mask = (live & (slots == 0) & (pos >= needed_from[:, None])).reshape(-1)
        hole_rows[:, RING_COL_LAUNCH_TAG] = hole_tag
        hole_rows[:, RING_COL_SLOT_IDX] = full.reshape(-1)  # the full slot (0 in FULL groups)
        hole_rows[:, RING_COL_POSITION] = pos.reshape(-1)
        hole_rows[:, RING_COL_STORED_TOKEN] = NO_TOKEN
        hole_rows[:, RING_COL_EXPECTED_TOKEN] = NO_TOKEN
        hole_rows[:, RING_COL_EXPECTED_AUX] = prefix[:, None].expand(bs, grid).reshape(-1)
        hole_rows[:, RING_COL_FAIL_REASON] = int(FailReason.VERIFY_NOT_RESIDENT)

    has_seed = real & (prefix > 0)
    seed = torch.where(has_seed, r2t[rows, (prefix - 1).clamp(min=0)].long(), NO_SLOT)
    write_slots = torch.where(real, translate_slots(out_cache_loc.long(), lut), NO_SLOT)
    return (slots.reshape(-1), prev.reshape(-1), torch.where(live, pos, 0).reshape(-1),
            expected.reshape(-1), hole_rows, hole_mask, translate_slots(seed, lut), write_slots,
            live.sum().reshape(1))  # fmt: skip


_compiled: dict[tuple[str, bool], Any] = {}


def compiled_static_tensors(backend: str = "inductor", fullgraph: bool = False) -> Any:
    """:func:`static_tensors` through ``torch.compile``, made once per (backend, fullgraph).
    On CUDA inductor fuses its ~90 small ops into a few Triton kernels, which a captured
    decode graph then replays. Shapes are symbolic (``dynamic``): the graph buckets
    ``(B, width)`` share a compile (batch 1, FULL vs SWA groups and token tables compile
    apart), done in the graph runner's warm-up runs before each capture. Not ``fullgraph``
    by default: past dynamo's recompile limit (8 per code object, every engine of the
    process counted) a call falls back to the eager ops instead of raising (the tests trace
    it with ``fullgraph=True``: it is one graph)."""
    key = (backend, fullgraph)
    if key not in _compiled:
        _compiled[key] = torch.compile(static_tensors, backend=backend, fullgraph=fullgraph, dynamic=True)
    return _compiled[key]
