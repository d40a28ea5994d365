"""The canary's plan types: what one forward verifies and writes, per buffer group.

:class:`PlanInputs` (one forward, shared by the groups) goes in; :class:`CanaryPlans` comes
out of :func:`.plan.build_plans` (any device: :class:`VerifyPlan` + :class:`WritePlan`, flat
int64 tensors) or of a :class:`.row_plan.RowPlanner` (CPU: :class:`RowVerifyPlan` +
:class:`HostWritePlan`, the same entries kept per batch row; see :mod:`.row_plan`). The
planners (:mod:`.plan`, :mod:`.plan_numba`, :mod:`.row_plan`) and the kernels build on this
module, which imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kvcanary.canary.wire.constants import NO_TOKEN


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


class RowVerifyPlan(NamedTuple):
    """The verify entries of one group (:mod:`.row_plan`): rows ``[0, bs)`` of ``requests``,
    entries ``[0, num_requested_entries)`` of ``entries`` (when enabled)."""

    requests: np.ndarray  # int64 [7, >= bs]
    bs: int
    entries: np.ndarray  # int64 [2, >= num entries]: slots, expected tokens
    has_tokens: bool
    enabled: bool  # False: more entries than the verify capacity; verify skipped
    num_requested_entries: int

    @property
    def num_entries(self) -> int:
        return self.num_requested_entries if self.enabled else 0


class HostWritePlan(NamedTuple):
    """:class:`WritePlan` on the CPU: requests ``[0, bs)`` of ``requests`` (rows
    SEED, TOKEN_START, NUM_TOKENS) over the flat per-token arrays."""

    requests: np.ndarray
    bs: int
    token_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray  # [>= len(token_ids)], LUT-translated out_cache_loc
    max_num_tokens: int
    total_num_tokens: int
    expected_token_ids: np.ndarray | None = None
    expected_positions: np.ndarray | None = None


class CanaryPlans(NamedTuple):
    """One group's plans of one forward: materialised (any device) or, on the CPU, the
    compact row form of :mod:`.row_plan` (same entries; the kernels accept both).

    ``holes``: int64 ``[3, n]`` (full slot, position, prefix_len) of the verify entries
    attention reads that have no slot (FULL: req->token entry 0; SWA: full->SWA mapping 0
    inside ``[prefix_len - window + 1, prefix_len)``), each a ``verify_not_resident``
    violation; None when there are none (or the check is off, e.g. compressed groups).

    ``tail_verify``: what TAIL verifies when it differs from HEAD's ``verify`` (compress-state
    rings, :mod:`.state_plan`: rows this forward took over are not verified after it);
    None: TAIL verifies ``verify`` again.
    """

    verify: VerifyPlan | RowVerifyPlan
    write: WritePlan | HostWritePlan
    holes: torch.Tensor | np.ndarray | None = None
    tail_verify: VerifyPlan | None = None


def long_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.long()


def check_plan_args(verify_capacity: int, window: int | None) -> None:
    if verify_capacity < 1:
        raise ValueError(f"verify_capacity={verify_capacity}; allowed: >= 1")
    if window is not None and window < 1:
        raise ValueError(f"window={window}; allowed: None (full attention) or >= 1")
