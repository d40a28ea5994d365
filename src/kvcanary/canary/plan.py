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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import torch

from kvcanary.canary.constants import NO_SLOT, NO_TOKEN, REQ_POOL_IDX_PADDING

if TYPE_CHECKING:
    from kvcanary.canary.row_plan import HostWritePlan, RowVerifyPlan


def _check_1d(owner: str, length: int, tensors: dict[str, Any], *, int64: bool) -> None:
    """Each tensor (or numpy array) that is not None has shape ``(length,)``."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.shape != (length,):
            raise ValueError(f"{owner}.{name} has shape {tuple(t.shape)}; expected ({length},)")
        if int64 and t.dtype != torch.int64:
            raise ValueError(f"{owner}.{name} has dtype {t.dtype}; expected torch.int64")


@dataclass(frozen=True, slots=True)
class VerifyPlan:
    """Flat verify entries (int64 ``[num_entries]`` each).

    ``prev_slots[i]``: -1 = first token of its request (expect the anchor hash), 0 = predecessor
    not reachable (chain check skipped). ``slots[i] == 0`` entries are skipped.
    ``expected_tokens[i]`` = -1: token not checked.
    """

    slots: torch.Tensor
    prev_slots: torch.Tensor
    positions: torch.Tensor
    expected_tokens: torch.Tensor
    enabled: bool = True  # False: capacity overflow, verify skipped this step
    num_requested_entries: int = 0  # entries the step wanted (> capacity when disabled)

    def __post_init__(self) -> None:
        fields = ("slots", "prev_slots", "positions", "expected_tokens")
        n = self.slots.shape[0] if self.slots.dim() == 1 else -1
        _check_1d("VerifyPlan", n, {f: getattr(self, f) for f in fields}, int64=True)

    @property
    def num_entries(self) -> int:
        return self.slots.shape[0]

    @staticmethod
    def from_entries(
        slots: torch.Tensor,
        prev_slots: torch.Tensor,
        positions: torch.Tensor,
        expected_tokens: torch.Tensor | None = None,
    ) -> VerifyPlan:
        """A plan from explicit entries (e.g. a radix sweep); no token check by default."""
        if expected_tokens is None:
            expected_tokens = torch.full_like(slots, NO_TOKEN, dtype=torch.int64)
        return VerifyPlan(
            slots.long(),
            prev_slots.long(),
            positions.long(),
            expected_tokens.long(),
            True,
            slots.shape[0],
        )


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Per-request write metadata over flat per-token arrays.

    Request ``r`` writes tokens ``[token_starts[r], token_starts[r] + num_tokens[r])`` of
    ``token_ids``/``positions``/``slots`` (int64 ``[num_tokens]``), chained from
    ``seed_slots[r]`` (-1: the anchor). A token whose slot is -1 is skipped. When
    ``expected_token_ids``/``expected_positions`` are given, the write-input assertion runs.
    """

    seed_slots: torch.Tensor  # int64 [bs]
    token_starts: torch.Tensor  # int64 [bs]
    num_tokens: torch.Tensor  # int64 [bs]; 0 for padding rows
    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    max_num_tokens: int  # max(num_tokens), host side
    total_num_tokens: int  # sum(num_tokens), host side
    expected_token_ids: torch.Tensor | None = None
    expected_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        per_req = ("seed_slots", "token_starts", "num_tokens")
        per_token = ("token_ids", "positions", "slots", "expected_token_ids", "expected_positions")
        bs, num_tokens = self.seed_slots.shape[0], self.token_ids.shape[0]
        _check_1d("WritePlan", bs, {f: getattr(self, f) for f in per_req}, int64=True)
        _check_1d("WritePlan", num_tokens, {f: getattr(self, f) for f in per_token}, int64=True)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """One forward, engine-agnostic; shared by every buffer group.

    ``prefix_lens``: tokens already committed per batch row (decode: ``positions``);
    ``extend_lens``: tokens this forward writes per row, laid out row after row in the flat
    token arrays (padding rows may own tokens; they are skipped, not misaligned).
    """

    req_to_token: torch.Tensor  # int32 [num_rows, max_context_len]; row 0 = padding
    req_pool_indices: torch.Tensor  # [bs]
    prefix_lens: torch.Tensor  # [bs]
    extend_lens: torch.Tensor  # [bs]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] full-pool slots written this forward
    expected_token_table: torch.Tensor | None = None  # [num_rows, max_ctx] tokens a row must hold
    expected_token_lens: torch.Tensor | None = None  # [bs] valid prefix of each row's table
    expected_input_ids: torch.Tensor | None = None  # [num_tokens] write-input assertion
    expected_positions: torch.Tensor | None = None  # [num_tokens] write-input assertion

    def __post_init__(self) -> None:
        check_plan_inputs(self)


PER_REQ_INPUTS = ("req_pool_indices", "prefix_lens", "extend_lens", "expected_token_lens")
PER_TOKEN_INPUTS = (
    "input_ids", "positions", "out_cache_loc", "expected_input_ids", "expected_positions",
)  # fmt: skip


def check_plan_inputs(inputs: Any) -> None:
    """The shape contract of :class:`PlanInputs` on anything with its fields (tensors or
    numpy arrays, e.g. :class:`.row_plan.HostInputs`)."""
    r2t = inputs.req_to_token
    if len(r2t.shape) != 2:
        raise ValueError(f"req_to_token must be 2-D, got shape {tuple(r2t.shape)}")
    bs, num_tokens = inputs.req_pool_indices.shape[0], inputs.input_ids.shape[0]
    _check_1d("PlanInputs", bs, {f: getattr(inputs, f) for f in PER_REQ_INPUTS}, int64=False)
    _check_1d("PlanInputs", num_tokens, {f: getattr(inputs, f) for f in PER_TOKEN_INPUTS},
              int64=False)  # fmt: skip
    if (inputs.expected_token_table is None) != (inputs.expected_token_lens is None):
        raise ValueError("expected_token_table and expected_token_lens go together")
    if (inputs.expected_input_ids is None) != (inputs.expected_positions is None):
        raise ValueError("expected_input_ids and expected_positions go together")


class CanaryPlans(NamedTuple):
    """One group's plans of one forward: materialised (any device) or, on the CPU, the
    compact row form of :mod:`.row_plan` (same entries; the kernels accept both).

    ``holes``: int64 ``[3, n]`` (full slot, position, prefix_len) of the verify entries
    attention reads that have no slot (FULL: req->token entry 0; SWA: full->SWA mapping 0
    inside ``[prefix_len - window + 1, prefix_len)``), each a ``verify_not_resident``
    violation; None when there are none (or the check is off, e.g. compressed groups).
    """

    verify: VerifyPlan | RowVerifyPlan
    write: WritePlan | HostWritePlan
    holes: torch.Tensor | np.ndarray | None = None


def translate_slots(slots: torch.Tensor, lut: torch.Tensor | None) -> torch.Tensor:
    """Full→SWA slots; negative sentinels pass through. Out-of-range slots raise (IndexError)."""
    if lut is None:
        return slots
    return torch.where(slots >= 0, lut[slots.clamp(min=0)].long(), slots)


def long_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.long()


def check_plan_args(verify_capacity: int, window: int | None) -> None:
    if verify_capacity < 1:
        raise ValueError(f"verify_capacity={verify_capacity}; allowed: >= 1")
    if window is not None and window < 1:
        raise ValueError(f"window={window}; allowed: None (full attention) or >= 1")


PlanBackend = Literal["auto", "numba", "torch"]
PLAN_BACKENDS: tuple[PlanBackend, ...] = ("auto", "numba", "torch")


def build_plans(
    inputs: PlanInputs,
    *,
    verify_capacity: int,
    window: int | None = None,
    lut: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
    backend: PlanBackend = "auto",
    check_residency: bool = True,
) -> CanaryPlans:
    """Verify and write plans of one buffer group for one forward.

    ``window``: the SWA window (None: full attention); ``lut``: full→SWA slot mapping for SWA
    groups; ``verify_capacity``: most verify entries per forward (more ⇒ verify disabled);
    ``kv_token_id_vs_position_offset``: 1 for draft pools whose slot ``p`` holds token ``p + 1``;
    ``backend``: auto = numba on CPU tensors, torch elsewhere; ``check_residency``: list the
    plan's holes (:class:`CanaryPlans`).
    """
    check_plan_args(verify_capacity, window)
    if backend not in PLAN_BACKENDS:
        raise ValueError(f"plan backend={backend!r}; allowed: {', '.join(PLAN_BACKENDS)}")
    on_cpu = inputs.req_to_token.device.type == "cpu"
    if backend == "numba" and not on_cpu:
        raise ValueError(f"numba plan builder needs CPU tensors, got {inputs.req_to_token.device}")
    if backend == "numba" or (backend == "auto" and on_cpu):
        from kvcanary.canary.plan_numba import build_plans_numba  # imports this module

        return build_plans_numba(inputs, verify_capacity, window, lut,
                                 kv_token_id_vs_position_offset, check_residency)  # fmt: skip
    return _build_plans_torch(inputs, verify_capacity, window, lut, kv_token_id_vs_position_offset,
                              check_residency)  # fmt: skip


def _build_plans_torch(
    inputs: PlanInputs,
    verify_capacity: int,
    window: int | None,
    lut: torch.Tensor | None,
    kv_token_id_vs_position_offset: int,
    check_residency: bool,
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
                (prefix - window + 1).clamp(min=0) if window is not None else torch.zeros_like(prefix)
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
