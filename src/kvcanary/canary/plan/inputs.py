"""Plan inputs of one forward: read from the engine's forward batch, and derived per group.

The forward batch contract (duck-typed; see docs/CANARY_PROTOCOL.md)::

    req_pool_indices  [bs]          req->token row of each batch row (0 = padding row)
    prefix_lens       [bs]          tokens already in the KV cache (decode: == positions)
    extend_seq_lens   [bs]          tokens this forward computes per row
    input_ids         [num_tokens]  the tokens, rows packed in batch order
    positions         [num_tokens]  prefix_lens[r] + j for the j-th token of row r
    out_cache_loc     [num_tokens]  full-pool slot each token's K/V is written to

Compressed groups (DSV4 C4/C128/indexer, ``ratio`` > 1) hold one record per *complete*
block of ``ratio`` positions; block ``j`` covers positions ``[j*ratio, (j+1)*ratio)``, is
written by the forward that computes its last position and is recorded as token = that
last token, position = ``j``, slot = (full slot of that last position) // ratio::

    positions   0 1 2 3 | 4 5 6 7 | 8 9        ratio 4, prefix 6, extend 4 (6..9)
    blocks      block 0 | block 1 | (open)     verify block 0 (prefix_c = 6 // 4 = 1),
                                               write block 1 (its last position 7 is new)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcanary.canary.plan.rows import HostInputs
from kvcanary.canary.plan.types import PlanInputs


def plan_inputs_from_batch(
    fb: Any,
    req_to_token_pool: Any,
    *,
    verify_tokens: bool,
    expected_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PlanInputs:
    """The shared plan inputs of a forward (tensors are used as they are, no copies).
    ``expected_inputs``: (token ids, positions) every written token must carry (the
    write-input assertion; None: off)."""
    table = lens = None
    if verify_tokens:
        table = req_to_token_pool.token_ids
        lens = req_to_token_pool.token_lens[fb.req_pool_indices.long()]
    return PlanInputs(
        req_to_token=req_to_token_pool.req_to_token,
        req_pool_indices=fb.req_pool_indices,
        prefix_lens=fb.prefix_lens,
        extend_lens=fb.extend_seq_lens,
        input_ids=fb.input_ids,
        positions=fb.positions,
        out_cache_loc=fb.out_cache_loc,
        expected_token_table=table,
        expected_token_lens=lens,
        expected_input_ids=None if expected_inputs is None else expected_inputs[0],
        expected_positions=None if expected_inputs is None else expected_inputs[1],
    )


def host_inputs_from_batch(
    fb: Any,
    req_to_token: np.ndarray,
    token_table: tuple[np.ndarray, np.ndarray] | None = None,
    expected_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> HostInputs:
    """:func:`plan_inputs_from_batch` as numpy views of the batch's (CPU) tensors, for the
    row planner, which checks the shapes. ``req_to_token``: the pool's table as numpy;
    ``token_table``: (the pool's token table, its per-row valid lengths; numpy) when
    tokens are verified."""
    table = lens = ids = positions = None
    arrays = getattr(fb, "host_arrays", None)  # the host's own views (ForwardBatchView)
    if arrays is None:
        arrays = (fb.req_pool_indices.numpy(), fb.prefix_lens.numpy(),
                  fb.extend_seq_lens.numpy(), fb.input_ids.numpy(), fb.positions.numpy(),
                  fb.out_cache_loc.numpy())  # fmt: skip
    if token_table is not None:
        table, lens = token_table[0], token_table[1][arrays[0]]
    if expected_inputs is not None:
        ids, positions = expected_inputs[0].numpy(), expected_inputs[1].numpy()
    rows, prefix, extend, input_ids, input_positions, out_cache_loc = arrays
    return HostInputs(req_to_token, rows, prefix, extend, input_ids, input_positions,
                      out_cache_loc, table, lens, ids, positions)  # fmt: skip


def compress_plan_inputs(inputs: PlanInputs, ratio: int) -> PlanInputs:
    """The inputs of a ``ratio``-compressed group (module doc); translate slots with a
    ``full slot // ratio`` LUT. The write-input assertion is not carried over."""
    if ratio < 2:
        raise ValueError(f"compression ratio={ratio}; allowed: >= 2")
    prefix = inputs.prefix_lens.long()
    seq = prefix + inputs.extend_lens.long().clamp(min=0)
    last_of_block = torch.nonzero(inputs.positions.long() % ratio == ratio - 1).squeeze(1)
    table, lens = inputs.expected_token_table, inputs.expected_token_lens
    return PlanInputs(
        req_to_token=inputs.req_to_token[:, ratio - 1 :: ratio],
        req_pool_indices=inputs.req_pool_indices,
        prefix_lens=torch.div(prefix, ratio, rounding_mode="floor"),
        extend_lens=torch.div(seq, ratio, rounding_mode="floor")
        - torch.div(prefix, ratio, rounding_mode="floor"),
        input_ids=inputs.input_ids[last_of_block],
        positions=torch.div(inputs.positions[last_of_block].long(), ratio, rounding_mode="floor"),
        out_cache_loc=inputs.out_cache_loc[last_of_block],
        expected_token_table=None if table is None else table[:, ratio - 1 :: ratio],
        expected_token_lens=None if lens is None else torch.div(
            lens.long(), ratio, rounding_mode="floor"
        ),
    )
