"""Plan builder on tiny hand-made req→token tables (reference/kv_canary_core.md §3.3)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.canary.plan.reference import CanaryPlans, PlanInputs, build_plans
from kvcanary.canary.plan.types import VerifyPlan


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_inputs(**overrides: torch.Tensor | None) -> PlanInputs:
    """Rows: 1 = slots [5, 6, 7] + decode into 8; 2 = slots [9, 10] + extend 2 into [12, 13].

    Batch = (row 1, padding row 0 in the middle, row 2).
    """
    r2t = torch.zeros(4, 8, dtype=torch.int32)
    r2t[1, :4] = torch.tensor([5, 6, 7, 8])
    r2t[2, :4] = torch.tensor([9, 10, 12, 13])
    r2t[3, :3] = torch.tensor([3, 4, 11])  # a live request not in this batch
    fields: dict[str, torch.Tensor | None] = dict(
        req_to_token=r2t,
        req_pool_indices=t([1, 0, 2]),
        prefix_lens=t([3, 5, 2]),  # the padding row's prefix is garbage and must be ignored
        extend_lens=t([1, 1, 2]),
        input_ids=t([100, 0, 200, 201]),
        positions=t([3, 0, 2, 3]),
        out_cache_loc=t([8, 0, 12, 13]),
    )
    fields.update(overrides)
    return PlanInputs(**fields)  # type: ignore[arg-type]


def entries(plan: VerifyPlan) -> list[tuple[int, int, int, int]]:
    cols = [plan.slots, plan.prev_slots, plan.positions, plan.expected_tokens]
    return [tuple(row) for row in torch.stack(cols, 1).tolist()]


def test_full_group() -> None:
    plans = build_plans(make_inputs(), verify_capacity=100)
    assert plans.verify.enabled and plans.verify.num_requested_entries == 5
    assert entries(plans.verify) == [
        (5, -1, 0, -1), (6, 5, 1, -1), (7, 6, 2, -1),  # row 1
        (9, -1, 0, -1), (10, 9, 1, -1),  # row 2; padding row contributes nothing
    ]  # fmt: skip
    w = plans.write
    assert w.seed_slots.tolist() == [7, -1, 10]
    assert w.token_starts.tolist() == [0, 1, 2]  # padding keeps its token: alignment preserved
    assert w.num_tokens.tolist() == [1, 0, 2]
    assert w.slots.tolist() == [8, 0, 12, 13]
    assert (w.max_num_tokens, w.total_num_tokens) == (2, 3)
    assert w.expected_token_ids is None and w.expected_positions is None


def test_window_restricts_verify_but_not_chain() -> None:
    plans = build_plans(make_inputs(), verify_capacity=100, window=2)
    assert entries(plans.verify) == [
        (6, 5, 1, -1), (7, 6, 2, -1),  # [3 - 2, 3): first entry names its real predecessor
        (9, -1, 0, -1), (10, 9, 1, -1),  # window longer than the prefix
    ]  # fmt: skip
    assert plans.write.seed_slots.tolist() == [7, -1, 10]


def test_lut_translation_with_non_resident_slots() -> None:
    lut = torch.zeros(17, dtype=torch.int64)
    lut[-1] = -1
    for full, swa in {6: 2, 7: 3, 8: 4, 10: 5, 12: 6, 13: 7}.items():  # 5 and 9: not resident
        lut[full] = swa
    plans = build_plans(make_inputs(), verify_capacity=100, window=2, lut=lut)
    assert entries(plans.verify) == [
        (2, 0, 1, -1),  # predecessor evicted → 0: chain check off for this entry
        (3, 2, 2, -1),
        (0, -1, 0, -1),  # slot evicted → 0: skipped by verify
        (5, 0, 1, -1),
    ]
    assert plans.write.seed_slots.tolist() == [3, -1, 5]
    assert plans.write.slots.tolist() == [4, 0, 6, 7]


def test_lut_out_of_range_raises() -> None:
    with pytest.raises(IndexError):
        build_plans(make_inputs(), verify_capacity=100, lut=torch.zeros(8, dtype=torch.int64))


def test_capacity_overflow_disables_verify_only() -> None:
    plans = build_plans(make_inputs(), verify_capacity=4)
    assert not plans.verify.enabled
    assert plans.verify.num_entries == 0 and plans.verify.num_requested_entries == 5
    assert plans.write.seed_slots.tolist() == [7, -1, 10]
    assert build_plans(make_inputs(), verify_capacity=5).verify.enabled


@pytest.mark.parametrize(
    ("offset", "lens", "want_row1", "want_row2"),
    [
        (0, [4, 0, 3], [50, 51, 52], [60, 61]),
        (1, [4, 0, 3], [51, 52, 53], [61, 62]),  # draft pools: slot p holds token p + 1
        (1, [2, 0, 3], [51, -1, -1], [61, 62]),  # beyond the valid length: not checked
        (0, [9, 0, 9], [50, 51, 52], [60, 61]),  # lens past the table width are clipped
    ],
)
def test_expected_tokens(
    offset: int, lens: list[int], want_row1: list[int], want_row2: list[int]
) -> None:
    table = torch.zeros(4, 8, dtype=torch.int32)
    table[1, :4] = torch.tensor([50, 51, 52, 53])
    table[2, :3] = torch.tensor([60, 61, 62])
    inputs = make_inputs(expected_token_table=table, expected_token_lens=t(lens))
    plans = build_plans(inputs, verify_capacity=100, kv_token_id_vs_position_offset=offset)
    assert plans.verify.expected_tokens.tolist() == want_row1 + want_row2


def test_write_input_expectations_pass_through() -> None:
    inputs = make_inputs(expected_input_ids=t([1, 2, 3, 4]), expected_positions=t([5, 6, 7, 8]))
    w = build_plans(inputs, verify_capacity=100).write
    assert w.expected_token_ids is not None and w.expected_token_ids.tolist() == [1, 2, 3, 4]
    assert w.expected_positions is not None and w.expected_positions.tolist() == [5, 6, 7, 8]


def test_empty_and_all_padding_batches() -> None:
    empty = make_inputs(
        req_pool_indices=t([]), prefix_lens=t([]), extend_lens=t([]),
        input_ids=t([]), positions=t([]), out_cache_loc=t([]),
    )  # fmt: skip
    plans = build_plans(empty, verify_capacity=1)
    assert plans.verify.num_entries == 0 and plans.write.max_num_tokens == 0
    padding = make_inputs(req_pool_indices=t([0, 0, 0]))
    plans = build_plans(padding, verify_capacity=1)
    assert plans.verify.enabled and plans.verify.num_entries == 0
    assert plans.write.seed_slots.tolist() == [-1, -1, -1] and plans.write.total_num_tokens == 0


def test_from_entries_defaults_to_no_token_check() -> None:
    plan = VerifyPlan.from_entries(t([3, 4]), t([-1, 3]), t([0, 1]))
    assert entries(plan) == [(3, -1, 0, -1), (4, 3, 1, -1)]
    with pytest.raises(ValueError):
        VerifyPlan.from_entries(t([3, 4]), t([-1]), t([0, 1]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(verify_capacity=0), "verify_capacity"),
        (dict(verify_capacity=10, window=0), "window"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_plans(make_inputs(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(prefix_lens=t([1, 2])), "prefix_lens"),
        (dict(positions=t([1])), "positions"),
        (dict(expected_token_lens=t([1, 1, 1])), "go together"),
        (dict(expected_input_ids=t([1, 1, 1, 1])), "go together"),
    ],
)
def test_inconsistent_inputs_rejected(overrides: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_inputs(**overrides)


def test_extend_lens_beyond_tokens_rejected() -> None:
    with pytest.raises(ValueError, match="flat tokens"):
        build_plans(make_inputs(extend_lens=t([1, 1, 3])), verify_capacity=10)


def test_plans_are_exact_sized_int64() -> None:
    plans: CanaryPlans = build_plans(make_inputs(), verify_capacity=100)
    for tensor in (plans.verify.slots, plans.write.slots, plans.write.seed_slots):
        assert tensor.dtype == torch.int64
