"""Expected forward inputs under the deterministic token oracle (the write-input assertion).

With the engine's oracle sampler (``EngineConfig(token_oracle=True)``) every generated token
is a function of the request and its position, ``oracle(rid, p) = splitmix64(rid ^ p) % vocab``,
so the canary knows what each forward *must* feed before it runs::

    extend rows   expected token = the input token itself (prompts are arbitrary; a resumed
                  request re-prefills its outputs), expected position = prefix_len + j
    decode rows   expected token = oracle(rid, position), expected position = prefix_len;
                  but the input token itself while ``position < prompt_len`` (an engine may
                  feed a prompt's last token by decode, e.g. after a chunk or a cache hit
                  that stops one token short)

The write kernels then compare the real ``input_ids`` / ``positions`` of every written token
with these (``write_token`` / ``write_position`` rows). It catches what leaves the KV chain
self-consistent: a token fed to the wrong request, a sampler/scheduler mix-up, a position
off by one. Padding rows (``req_pool_idx`` 0) write nothing, so their expectations are moot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcanary.canary.wire.hashing import splitmix64_t

_TWO_POW_64 = 1 << 64


def oracle_tokens_t(rids: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vectorised ``splitmix64(rid ^ position) % vocab`` (unsigned modulo on int64 bits);
    equals :func:`kvcanary.engine.sampling.oracle_token` element for element."""
    h = splitmix64_t(rids.long() ^ positions.long())
    mod = torch.remainder(h, vocab_size)  # floor mod of the signed value
    # A negative int64 h stands for h + 2^64: add 2^64 mod vocab back.
    return torch.where(h < 0, torch.remainder(mod + _TWO_POW_64 % vocab_size, vocab_size), mod)


class TokenOracleExpectations:
    """``__call__(fb) -> (expected_input_ids, expected_positions)``, int64 ``[num_tokens]``.

    Reads ``fb.rids`` (request id per batch row, 0 for padding), ``fb.is_decode``,
    ``fb.prefix_lens``, ``fb.extend_seq_lens`` and ``fb.input_ids``; ``prompt_lens(rids)``
    gives each row's prompt length (0 for padding rows).
    """

    def __init__(self, vocab_size: int, prompt_lens: Callable[[list[int]], list[int]]):
        if vocab_size < 1:
            raise ValueError(f"token oracle vocab_size={vocab_size}; allowed: >= 1")
        self.vocab_size = vocab_size
        self.prompt_lens = prompt_lens

    def __call__(self, fb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        device = fb.input_ids.device
        extend = fb.extend_seq_lens.long()
        n = fb.input_ids.shape[0]
        row_of_token = torch.repeat_interleave(
            torch.arange(extend.shape[0], device=device), extend, output_size=n
        )
        first = torch.cumsum(extend, 0) - extend
        offset = torch.arange(n, device=device) - first[row_of_token]
        positions = fb.prefix_lens.long()[row_of_token] + offset
        if not fb.is_decode:
            return fb.input_ids.long(), positions
        rids = torch.as_tensor(fb.rids, dtype=torch.int64, device=device)[row_of_token]
        prompt = torch.as_tensor(self.prompt_lens(list(fb.rids)), dtype=torch.int64, device=device)
        oracle = oracle_tokens_t(rids, positions, self.vocab_size)
        return torch.where(positions < prompt[row_of_token], fb.input_ids.long(), oracle), positions
