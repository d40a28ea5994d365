"""sample_batch: the greedy batch's argmax taken in numpy on host logits picks what torch's
argmax picks (first maximum, NaN counted the largest); sampled rows keep their own path."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import SamplingParams
from kvcanary.engine.sampling import make_generator, sample_batch

GREEDY = SamplingParams()


@pytest.mark.parametrize("seed", range(4))
def test_greedy_batch_is_torchs_argmax_with_ties_and_nan(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 259, generator=g)
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: the first index
    logits[5, 11] = float("nan")  # NaN wins, as in torch
    logits[6] = float("-inf")  # all equal: index 0
    logits[8, 100] = logits[8, 200] = float("inf")
    want = torch.argmax(logits, dim=-1).tolist()
    got = sample_batch(logits, [GREEDY] * 64, [None] * 64)
    assert got == want
    assert (got[3], got[5], got[6], got[8]) == (7, 11, 0, 100)
    assert all(type(t) is int for t in got)


def test_greedy_batch_of_a_strided_view_and_other_dtypes() -> None:
    base = torch.randn(8, 2 * 259)
    view = base[:, ::2]  # not contiguous: numpy follows the strides
    assert sample_batch(view, [GREEDY] * 8, [None] * 8) == torch.argmax(view, dim=-1).tolist()
    half = torch.randn(4, 259).to(torch.bfloat16)  # no numpy dtype: torch's argmax
    assert sample_batch(half, [GREEDY] * 4, [None] * 4) == torch.argmax(half, dim=-1).tolist()


def test_a_sampled_row_keeps_the_batch_off_the_argmax_path() -> None:
    """One non-greedy row: every row goes through sample_one (greedy rows still argmax),
    the sampled row draws from its seeded generator (reproducible, not always the max)."""
    logits = torch.zeros(2, 16)
    logits[:, 3] = 1.0
    hot = [SamplingParams(temperature=20.0, seed=s) for s in range(12)]
    rows = [sample_batch(logits, [GREEDY, p], [None, make_generator(p, 0, 1)]) for p in hot]
    again = [sample_batch(logits, [GREEDY, p], [None, make_generator(p, 0, 1)]) for p in hot]
    assert rows == again and all(r[0] == 3 for r in rows)
    assert {r[1] for r in rows} != {3} and all(0 <= r[1] < 16 for r in rows)
