"""Per-forward canary plans: which slots to verify and which records to write.

For batch row ``r`` (req_to_token row ``rp``, ``K = prefix_len``, ``E = extend_len``)::

    positions   0 ........ K-W-1 | K-W ........ K-1 | K ........ K+E-1
                                 |<---- verify ---->|<--- write ---->|
                (FULL groups verify from 0; SWA groups from max(0, K - window))

* verify entry: ``slot = req_to_token[rp, pos]``, ``prev = req_to_token[rp, pos - 1]`` (-1 for
  pos 0), expected position ``pos``, expected token from the expected-token table (or -1).
  Windows do not restart the chain: the first in-window entry names its real predecessor.
* write: this forward's tokens, chained from the seed ``req_to_token[rp, K - 1]`` (-1 if K = 0).
* SWA groups translate every slot through the full→SWA ``lut`` (0 = not resident: a verify
  slot 0 is skipped, a predecessor 0 disables that entry's chain check). A slot 0 where
  attention reads (FULL: ``[0, K)``; SWA: ``[K - W + 1, K)``) is a *hole*: the kernels skip
  it, the plan lists it (:class:`CanaryPlans`) and the canary reports it
  (``verify_not_resident``), since the window invariant says it must be resident.
* Rows with ``req_pool_idx == 0`` (padding) contribute no entries and write nothing.

Plans are exact-sized int64 tensors on the inputs' device; building one costs a single
host read of a few counts (free on CPU). A verify plan over ``capacity`` entries is disabled
(no entries) and reports how many were requested. On the CPU a compiled builder
(:mod:`.plan_numba`) produces the same plans in one pass; the torch builder serves every
device.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

from kvcanary.canary.plan.types import (
    CanaryPlans,
    PlanInputs,
    VerifyPlan,
    WritePlan,
    check_plan_args,
    long_or_none,
)
from kvcanary.canary.wire.constants import NO_SLOT, NO_TOKEN, REQ_POOL_IDX_PADDING

# build_plans' argument and result types (the rest of the plan types: .plan_types).
__all__ = ["PLAN_BACKENDS", "CanaryPlans", "PlanBackend", "PlanInputs", "build_plans",
           "translate_slots"]  # fmt: skip


def translate_slots(slots: torch.Tensor, lut: torch.Tensor | None) -> torch.Tensor:
    """Full→SWA slots; negative sentinels pass through. Out-of-range slots raise (IndexError)."""
    if lut is None:
        return slots
    return torch.where(slots >= 0, lut[slots.clamp(min=0)].long(), slots)


PlanBackend = Literal["auto", "numba", "torch", "triton"]
PLAN_BACKENDS: tuple[PlanBackend, ...] = ("auto", "numba", "torch", "triton")


def build_plans(
    inputs: PlanInputs,
    *,
    verify_capacity: int,
    window: int | None = None,
    lut: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
    backend: PlanBackend = "auto",
    check_residency: int = 1,
) -> CanaryPlans:
    """Verify and write plans of one buffer group for one forward.

    ``window``: the SWA window (None: full attention); ``lut``: full→SWA slot mapping for SWA
    groups; ``verify_capacity``: most verify entries per forward (more ⇒ verify disabled);
    ``kv_token_id_vs_position_offset``: 1 for draft pools whose slot ``p`` holds token ``p + 1``;
    ``backend``: auto = numba on CPU tensors, Triton on CUDA when triton is installed, torch
    elsewhere; ``check_residency``: list the plan's holes (:class:`CanaryPlans`): 0 no, 1 from
    ``prefix - window + 1``, 2 from ``prefix - window`` (a host whose attention reads it).
    """
    check_plan_args(verify_capacity, window)
    if backend not in PLAN_BACKENDS:
        raise ValueError(f"plan backend={backend!r}; allowed: {', '.join(PLAN_BACKENDS)}")
    on_cpu = inputs.req_to_token.device.type == "cpu"
    if backend == "numba" and not on_cpu:
        raise ValueError(f"numba plan builder needs CPU tensors, got {inputs.req_to_token.device}")
    if backend == "numba" or (backend == "auto" and on_cpu):
        from kvcanary.canary.plan.numba_plan import build_plans_numba  # numba: only when used

        return build_plans_numba(inputs, verify_capacity, window, lut,
                                 kv_token_id_vs_position_offset, check_residency)  # fmt: skip
    on_cuda = inputs.req_to_token.device.type == "cuda"
    if backend == "triton" or (backend == "auto" and on_cuda and _triton_installed()):
        if not _triton_installed():
            raise ValueError(
                "plan backend='triton' needs the triton package, which is not installed "
                "(pip install 'kvcanary[gpu]')"
            )
        from kvcanary.canary.plan.triton_plan import build_plans_triton  # triton: only when used

        return build_plans_triton(inputs, verify_capacity, window, lut,
                                  kv_token_id_vs_position_offset, check_residency)  # fmt: skip
    return _build_plans_torch(inputs, verify_capacity, window, lut, kv_token_id_vs_position_offset,
                              check_residency)  # fmt: skip


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _build_plans_torch(
    inputs: PlanInputs,
    verify_capacity: int,
    window: int | None,
    lut: torch.Tensor | None,
    kv_token_id_vs_position_offset: int,
    check_residency: int,
) -> CanaryPlans:
    r2t = inputs.req_to_token
    device = r2t.device
    rows = inputs.req_pool_indices.long()
    prefix = inputs.prefix_lens.long()
    extend = inputs.extend_lens.long().clamp(min=0)
    real = rows != REQ_POOL_IDX_PADDING
    verify_start = (
        (prefix - window).clamp(min=0) if window is not None else torch.zeros_like(prefix)
    )
    verify_counts = torch.where(real, (prefix - verify_start).clamp(min=0), 0)
    write_counts = torch.where(real, extend, 0)
    # The one host read per group: entry totals and the longest write (loop bound of torch path).
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    totals = [
        verify_counts.sum(),
        extend.sum(),
        write_counts.sum(),
        torch.cat([write_counts, zero]).max(),
    ]
    total_verify, total_extend, total_write, max_write = torch.stack(totals).tolist()
    if total_extend > inputs.input_ids.shape[0]:
        raise ValueError(
            f"extend_lens sum to {total_extend} > {inputs.input_ids.shape[0]} flat tokens"
        )

    # ---- verify entries
    holes = None
    if total_verify > verify_capacity:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        verify = VerifyPlan(empty, empty, empty, empty, False, total_verify)
    else:
        entry_req = torch.repeat_interleave(verify_counts, output_size=total_verify)
        first_entry = torch.cumsum(verify_counts, 0) - verify_counts
        arange = torch.arange(total_verify, dtype=torch.int64, device=device)
        pos = verify_start[entry_req] + arange - first_entry[entry_req]
        row = rows[entry_req]
        slots = r2t[row, pos].long()
        prev = torch.where(pos > 0, r2t[row, (pos - 1).clamp(min=0)].long(), NO_SLOT)
        expected = torch.full_like(pos, NO_TOKEN)
        table, table_lens = inputs.expected_token_table, inputs.expected_token_lens
        if table is not None and table_lens is not None:
            idx = pos + kv_token_id_vs_position_offset
            ok = (idx >= 0) & (idx < table_lens.long()[entry_req]) & (idx < table.shape[1])
            gathered = table[row, torch.where(ok, idx, 0)].long()
            expected = torch.where(ok, gathered, NO_TOKEN)
        translated = translate_slots(slots, lut)
        verify = VerifyPlan(
            translated, translate_slots(prev, lut), pos, expected, True, total_verify
        )
        if check_residency and total_verify:
            needed_from = (
                (prefix - window + int(check_residency == 1)).clamp(min=0)
                if window is not None else torch.zeros_like(prefix)
            )
            is_hole = (translated == 0) & (pos >= needed_from[entry_req])
            if bool(is_hole.any()):  # a host read, like the totals above
                holes = torch.stack((slots, pos, prefix[entry_req]))[:, is_hole]

    # ---- write metadata
    token_starts = torch.cumsum(extend, 0) - extend
    has_seed = real & (prefix > 0) & (extend > 0)
    seed = r2t[rows, torch.where(has_seed, prefix - 1, 0)].long()
    seed = torch.where(has_seed, seed, NO_SLOT)
    write = WritePlan(
        seed_slots=translate_slots(seed, lut),
        token_starts=token_starts,
        num_tokens=write_counts,
        token_ids=inputs.input_ids.long(),
        positions=inputs.positions.long(),
        slots=translate_slots(inputs.out_cache_loc.long(), lut),
        max_num_tokens=max_write,
        total_num_tokens=total_write,
        expected_token_ids=long_or_none(inputs.expected_input_ids),
        expected_positions=long_or_none(inputs.expected_positions),
    )
    return CanaryPlans(verify, write, holes)
