"""Next-token sampling: greedy, temperature / top-k / top-p with per-request seeds, and
the deterministic token oracle used by tests and the canary's fault campaigns.

The oracle ignores the logits: ``token = splitmix64(rid ^ position) % vocab``, where
``position`` is the position the new token will occupy. Its output depends only on the
request and position, so any scheduling (chunking, batching, retraction) must reproduce
it exactly — and a swapped or corrupted input is immediately visible.
"""

from __future__ import annotations

import torch

from kvcanary.canary.wire.hashing import splitmix64
from kvcanary.config import SamplingParams
from kvcanary.engine.request import Req, TokenLogprob


def oracle_token(rid: int, position: int, vocab_size: int) -> int:
    return splitmix64((rid ^ position) & 0xFFFFFFFFFFFFFFFF) % vocab_size


def make_generator(params: SamplingParams, engine_seed: int, rid: int) -> torch.Generator | None:
    """Per-request CPU generator (None for greedy): seeded by ``params.seed`` when given,
    else by (engine seed, request id), so reruns reproduce."""
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else (engine_seed * 1_000_003 + rid))
    return g


def sample_one(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from ``logits [vocab]`` (float32)."""
    if params.greedy or gen is None:
        return int(torch.argmax(logits))
    scaled = logits.float().cpu() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        drop = torch.cumsum(sorted_p, 0) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Tokens for a batch; all-greedy batches take one argmax (of host logits in numpy:
    torch's splits a batch-64 row block among its threads, ~45 us against ~6; the same
    first-maximum index, NaN counted the largest, in both)."""
    if all(p.greedy for p in params):
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
            return logits.detach().numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]
        return torch.argmax(logits, dim=-1).tolist()
    return [sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators, strict=True))]


def record_logprobs(reqs: list[Req], logits: torch.Tensor, tokens: list[int]) -> None:
    """Each sampled token's log-probability (and top alternatives) for the requests that
    asked (``params.logprobs``); one log-softmax over just their rows."""
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not rows:
        return
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1).cpu()
    for lp, i in zip(logprobs, rows, strict=True):
        req, num_top = reqs[i], reqs[i].params.logprobs or 0
        alts: tuple[tuple[int, float], ...] = ()
        if num_top:
            top = torch.topk(lp, num_top)
            alts = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        req.output_logprobs.append(TokenLogprob(tokens[i], float(lp[tokens[i]]), alts))
