"""Speculative decoding, greedy-exact: proposers and the acceptance rule.

Each decode step (``Scheduler._schedule_verify``) a proposer drafts up to ``K``
(``num_speculative_tokens``) tokens ``d1 .. dK`` for every eligible request (greedy, no
logprobs, no token oracle), one target forward verifies them all, and the request keeps
the longest prefix ``d1 .. dj`` its own argmax agrees with plus the target's token at the
first disagreement (or after ``dK``), so its output is plain greedy decoding's::

    positions   p          p+1   ...   p+K           p = kv_len = seq_len - 1
    inputs      last       d1    ...   dK            one extend forward, every logit
    argmax      t0         t1    ...   tK
    kept        d1 .. dj (di == t(i-1) for i <= j), then tj; KV of [p+j+1, p+K] rolled back

Proposers:
  * :class:`NgramProposer` (prompt lookup): the tokens that followed the most recent
    earlier occurrence of the sequence's last ``n`` tokens, ``n`` from ``ngram_max`` down to
    ``ngram_min``; stateless.
  * :class:`DraftProposer`: a second, smaller model sharing the vocab, run as its own
    :class:`ModelRunner` with its own pools and :class:`KVManager` (no prefix cache). Its
    KV follows each request's committed sequence: it prefills what it lacks (chunked as
    the target), decodes the drafts autoregressively, and at the next proposal rolls its
    KV back to the longest prefix of its sequence the target committed.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from kvcanary.config import CanaryConfig, ConfigFieldError, EngineConfig, SpeculativeConfig
from kvcanary.engine.forward_batch import build_decode_batch, build_extend_batch
from kvcanary.engine.kv_manager import KVManager, KVSpec
from kvcanary.engine.model_runner import ModelRunner
from kvcanary.engine.request import Req
from kvcanary.engine.stats import KVStats


def ngram_propose(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of ``tokens``'
    last ``n`` tokens, trying ``n`` from ``ngram_max`` down to ``ngram_min``; [] when none
    occurs earlier. One pass over the sequence finds the earlier occurrences of the last
    token; each longer suffix only narrows those."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = seq.size
    if length < 2:
        return []
    ends = np.flatnonzero(seq[: length - 1] == seq[length - 1])  # earlier last tokens
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        cand = ends[ends >= n - 1]  # an occurrence of the last n tokens ending at cand
        for j in range(1, n):
            if not cand.size:
                break
            cand = cand[seq[cand - j] == seq[length - 1 - j]]
        if cand.size:
            start = int(cand[-1]) + 1
            return seq[start : start + k].tolist()  # type: ignore[no-any-return]
    return []


def accept_greedy(drafts: list[int], target: list[int]) -> tuple[list[int], int]:
    """The tokens greedy decoding emits given ``drafts`` ``d1 .. dK`` and the target's
    argmax ``t0 .. tK`` at positions ``p .. p+K``: ``d1 .. dj`` while ``d(i) == t(i-1)``,
    then ``tj``; and ``j``, the drafts accepted."""
    j = 0
    while j < len(drafts) and drafts[j] == target[j]:
        j += 1
    return drafts[:j] + [target[j]], j


class Proposer(Protocol):
    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` draft tokens continuing each request's sequence (``[]``: none)."""
        ...

    def drop(self, req: Req) -> None:
        """``req`` left the running batch (finished, aborted, retracted): forget it."""
        ...

    def check_integrity(self) -> bool: ...


class NgramProposer:
    def __init__(self, spec: SpeculativeConfig):
        self.ngram_min, self.ngram_max = spec.ngram_min, spec.ngram_max

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        return [ngram_propose(r.all_ids(), k, self.ngram_min, self.ngram_max) if k > 0 else []
                for r, k in zip(reqs, ks, strict=True)]  # fmt: skip

    def drop(self, req: Req) -> None:
        pass

    def check_integrity(self) -> bool:
        return True


class DraftProposer:
    """The draft model as its own runner (own pools, own KV manager, own req->token rows):
    a KV-cache canary installs on :attr:`runner` as on the target's."""

    def __init__(self, config: EngineConfig, target: ModelRunner):
        from kvcanary.model.loader import load_model_config

        spec = config.speculative
        vocab = load_model_config(spec.draft_model).vocab_size
        if vocab != target.vocab_size:
            raise ConfigFieldError(
                "--speculative-draft-model (speculative.draft_model)", spec.draft_model,
                f"a model with the target's vocab size {target.vocab_size} (it has {vocab})",
            )  # fmt: skip
        draft_config = dataclasses.replace(
            config, model=spec.draft_model, max_context_len=target.max_context_len,
            enable_prefix_cache=False, enable_host_offload=False, graph_batch_sizes=(),
            token_oracle=False, canary=CanaryConfig(), speculative=SpeculativeConfig(),
        )  # fmt: skip
        self.runner = ModelRunner(draft_config)
        self.stats = KVStats()
        runner = self.runner
        self.kv = KVManager(
            runner.allocator, runner.req_to_token_pool, runner.token_to_kv_pool,
            KVSpec(config.page_size, runner.sliding_window if runner.is_swa else None),
            enable_prefix_cache=False, enable_host_offload=False, stats=self.stats,
        )  # fmt: skip
        self.chunk = config.chunked_prefill_size if config.chunked_prefill_size > 0 else 1 << 62
        self.reqs: dict[int, Req] = {}  # target rid -> the draft's own request
        self.num_forwards = 0

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        active: list[tuple[Req, int]] = []  # (draft request, K) of each request drafting
        for req, k in zip(reqs, ks, strict=True):
            if k > 0 and (d := self._sync(req)) is not None:
                active.append((d, k))
        drafts = self._catch_up(active)
        self._decode(drafts)
        out = {d.rid: d.output_ids[:k] for d, k in drafts}
        return [out.get(r.rid, []) for r in reqs]

    def _sync(self, req: Req) -> Req | None:
        """The draft's request for ``req``: its sequence set to ``req``'s, its KV rolled back
        to the longest prefix the target committed (None: no req->token row free)."""
        d = self.reqs.get(req.rid)
        target = req.all_ids()
        if d is None:
            if self.kv.req_to_token_pool.available_size() == 0:
                return None
            d = Req(rid=req.rid, prompt_ids=target, params=req.params)
            self.kv.admit(d)  # a row, nothing cached (no prefix cache): kv_len 0
            self.reqs[req.rid] = d
            return d
        mine = np.asarray(d.all_ids()[: d.kv_len], dtype=np.int64)
        theirs = np.asarray(target[: d.kv_len], dtype=np.int64)
        n = min(mine.size, theirs.size)
        differ = np.flatnonzero(mine[:n] != theirs[:n])
        keep = min(int(differ[0]) if differ.size else n, req.seq_len - 1)
        self.kv.rollback(d, keep, d.kv_len)  # (the draft allocates exactly [0, kv_len))
        d.prompt_ids, d.output_ids = target, []
        self.kv.req_to_token_pool.set_tokens(d.req_pool_idx, target)
        self.kv.evict_window([d])  # from committed tokens only
        return d

    def _catch_up(self, active: list[tuple[Req, int]]) -> list[tuple[Req, int]]:
        """Prefill what each draft request lacks of its sequence in chunked extend forwards;
        the last chunk's logits give its first draft. Returns the requests that got one."""
        pending, done = list(active), []
        while pending:
            budget, plan, left = self.chunk, [], []
            for d, k in pending:
                if budget <= 0:
                    left.append((d, k))
                    continue
                start, end = d.kv_len, min(d.seq_len, d.kv_len + budget)
                if not self.kv.extend(d, end):
                    self._release(d)  # the draft pools are full: no drafts for it
                    continue
                plan.append((d, k, start, end))
                budget -= end - start
            if not plan:
                break
            logits = self._forward_extend(plan)
            for i, (d, k, _, end) in enumerate(plan):
                d.kv_len = end
                if end == d.seq_len:
                    self._append(d, int(torch.argmax(logits[i])))
                    done.append((d, k))
                else:
                    left.append((d, k))
            self.kv.evict_window([d for d, _, _, _ in plan])
            pending = left
        return done

    def _forward_extend(self, plan: list[tuple[Req, int, int, int]]) -> torch.Tensor:
        fb = build_extend_batch(self.runner.device, self.kv.req_to_token,
                                [(d, s, e, d.prompt_ids[s:e]) for d, _, s, e in plan])  # fmt: skip
        self.num_forwards += 1
        return self.runner.forward(fb)

    def _decode(self, drafts: list[tuple[Req, int]]) -> None:
        """Decode the remaining drafts, one batched forward per draft position (no window
        eviction: these positions are not committed)."""
        while True:
            batch = [d for d, k in drafts if len(d.output_ids) < k]
            if not batch:
                return
            out = self.kv.extend_decode(batch)
            if out is None:  # the draft pools are full: the drafts so far
                return
            self.num_forwards += 1
            logits = self.runner.forward(build_decode_batch(self.runner.device, batch, out))
            tokens = logits.argmax(dim=-1).tolist()
            for d, tok in zip(batch, tokens, strict=True):
                d.kv_len += 1
                self._append(d, tok)

    def _append(self, d: Req, tok: int) -> None:
        self.kv.req_to_token_pool.append_tokens([d.req_pool_idx], [d.seq_len], [tok])
        d.output_ids.append(tok)

    def _release(self, d: Req) -> None:
        self.kv.release(d, insert=False)
        del self.reqs[d.rid]

    def drop(self, req: Req) -> None:
        d = self.reqs.get(req.rid)
        if d is not None:
            self._release(d)

    def abort_referencing(self, full_slots: torch.Tensor, swa_slots: torch.Tensor,
                          req_rows: torch.Tensor) -> list[int]:  # fmt: skip
        """The draft canary's abort handler (abort mode): forget the draft requests whose
        KV includes ``full_slots`` (or maps to ``swa_slots``) or that hold one of
        ``req_rows``; their pages go back to the draft's pools (rewritten, records too,
        before any read) and they prefill again at their next proposal. No target request
        is aborted (the target verifies every draft: a bad draft costs acceptance, never
        an output token); returns []."""
        dev = self.kv.req_to_token.device
        full = full_slots.reshape(-1).to(dev, torch.int64)
        swa = swa_slots.reshape(-1).to(dev, torch.int64)
        rows = set(req_rows.reshape(-1).tolist())
        for d in list(self.reqs.values()):
            if d.req_pool_idx in rows or (d.kv_len and self.kv.references(d, full, swa)):
                self._release(d)
        return []

    def check_integrity(self) -> bool:
        return self.kv.check_integrity()


def make_proposer(config: EngineConfig, target: ModelRunner) -> Proposer | None:
    """The proposer of ``config.speculative`` (None: speculation off)."""
    spec = config.speculative
    if spec.enabled and target.model_config.dsv4 is not None:
        # Its compressed sub-pools and compress-state rings are not rolled back (measured:
        # ngram drafts changed greedy outputs of builtin:tiny-dsv4).
        raise ConfigFieldError("--speculative-method (speculative.method)", spec.method,
                               f"\"none\" for DeepSeek-V4 models ({config.model})")  # fmt: skip
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "draft":
        return DraftProposer(config, target)
    return None
