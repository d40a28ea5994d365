"""An SGLang ``ForwardBatch`` as the canary's :class:`~kvcanary.canary.host.ForwardBatchView`.

SGLang's batch carries ``input_ids``, ``positions``, ``out_cache_loc`` and
``req_pool_indices`` as the canary reads them; the per-row prefix / extend lengths depend on
the forward mode, as SGLang's own canary derives them
(``sglang.srt.kv_canary.plan_input._extract_prefix_lens_and_extend_seq_lens``)::

    mode                    prefix_lens                    extend_seq_lens
    decode / idle           positions (one token per row)  1
    target_verify           seq_lens                       spec_info.draft_token_num
    draft_extend_v2         seq_lens - extend_seq_lens     extend_seq_lens
    extend / mixed          extend_prefix_lens             extend_seq_lens

Anything else raises ``NotImplementedError``. The view is made once per forward (it copies
nothing but the two length vectors) and handed to both ``before_forward`` and
``after_forward``.
"""

from __future__ import annotations

from typing import Any

import torch


class SGLangForwardBatchView:
    """The canary's view of one SGLang ``ForwardBatch`` (duck-typed: any object with the
    fields above and a ``forward_mode`` offering SGLang's ``is_*`` predicates)."""

    def __init__(self, forward_batch: Any):
        self.forward_batch = forward_batch
        self.prefix_lens, self.extend_seq_lens = prefix_and_extend_lens(forward_batch)

    @property
    def req_pool_indices(self) -> torch.Tensor:
        return self.forward_batch.req_pool_indices

    @property
    def input_ids(self) -> torch.Tensor:
        return self.forward_batch.input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self.forward_batch.positions

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.forward_batch.out_cache_loc


def prefix_and_extend_lens(fb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prefix_lens, extend_seq_lens)``, int64 ``[bs]``, by forward mode (module doc)."""
    mode = fb.forward_mode
    bs = int(fb.req_pool_indices.shape[0])
    device = fb.req_pool_indices.device
    if mode.is_decode_or_idle():
        prefix = torch.zeros(bs, dtype=torch.int64, device=device)
        n = min(bs, int(fb.positions.shape[0]))
        prefix[:n] = fb.positions[:n].to(torch.int64)
        return prefix, torch.ones(bs, dtype=torch.int64, device=device)
    if mode.is_target_verify():
        draft = int(fb.spec_info.draft_token_num)
        return (fb.seq_lens[:bs].to(torch.int64),
                torch.full((bs,), draft, dtype=torch.int64, device=device))  # fmt: skip
    if mode.is_draft_extend_v2():
        extend = fb.extend_seq_lens[:bs].to(torch.int64)
        return fb.seq_lens[:bs].to(torch.int64) - extend, extend
    if mode.is_extend():  # extend and mixed
        return (fb.extend_prefix_lens[:bs].to(torch.int64),
                fb.extend_seq_lens[:bs].to(torch.int64))  # fmt: skip
    raise NotImplementedError(
        f"kv-canary on SGLang: forward mode {mode} is not supported; supported: decode, idle, "
        "extend, mixed, target_verify, draft_extend_v2"
    )
