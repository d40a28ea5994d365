"""The canary under vLLM's speculative decoding (n-gram proposer, ``method`` "ngram").

Each step schedules a request's committed token and up to ``num_speculative_tokens``
draft tokens after it; vLLM's rejection sampler accepts a prefix of the drafts and the
scheduler rolls ``num_computed_tokens`` back over the rejected ones
(``Scheduler.update_from_output``). The connector sends the drafts' token ids
(``scheduled_spec_decode_tokens``) in the step's metadata, so an accepted draft's record
carries its token and the committed token is checked against it; a rejected draft's
position is computed again before anything reads it. Drafts accepted and rejected are
counted from vLLM's own accounting (``Scheduler.make_spec_decoding_stats``, called for
every request that had drafts, whether or not stats are logged). Other methods, and
``ngram`` under async scheduling, are refused at start-up.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import vllm_harness as H

CANARY = {"mode": "log", "real_data": "partial"}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip
MAX_TOKENS = 48


def _prompts() -> list[list[int]]:
    """Four prompts, each a short random pattern repeated (n-gram drafts get proposed)."""
    rng = random.Random(1)
    out = []
    for i in range(4):
        pattern = [rng.randrange(1, 300) for _ in range(5 + i)]
        out.append((pattern * 20)[: 60 + 7 * i])
    return out


@dataclass
class Drafts:
    """vLLM's per-request draft accounting: totals, and the last step's (request, drafts,
    accepted)."""

    drafted: int = 0
    accepted: int = 0
    last: list[tuple[str, int, int]] = field(default_factory=list)


def _count_drafts(llm: Any) -> Drafts:
    sched, drafts = H.scheduler(llm), Drafts()
    make = sched.make_spec_decoding_stats

    def counting(stats: Any, num_draft_tokens: int, num_accepted_tokens: int,
                 num_invalid_spec_tokens: Any, request_id: str) -> Any:  # fmt: skip
        drafts.drafted += num_draft_tokens
        drafts.accepted += num_accepted_tokens
        drafts.last.append((request_id, num_draft_tokens, num_accepted_tokens))
        return make(stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                    request_id)  # fmt: skip

    sched.make_spec_decoding_stats = counting
    return drafts


def test_ngram_clean_run_matches_vllm_and_reports_nothing(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvcanary.canary")
    with H.vllm_engine(checkpoints["llama"], speculative_config=SPEC) as llm:
        plain_drafts = _count_drafts(llm)
        plain = H.generate(llm, _prompts(), MAX_TOKENS)
    with H.vllm_engine(checkpoints["llama"], canary=CANARY, speculative_config=SPEC) as llm:
        drafts = _count_drafts(llm)
        out = H.generate(llm, _prompts(), MAX_TOKENS)
        conn = H.connector(llm)
        conn.worker.flush()
        stats = conn.worker.stats()
        rows = list(conn.worker.violations)
    print(f"\nngram: {drafts.drafted} drafts, {drafts.accepted} accepted; canary {stats}")
    assert out == plain
    assert (drafts.drafted, drafts.accepted) == (plain_drafts.drafted, plain_drafts.accepted)
    assert 0 < drafts.accepted < drafts.drafted  # drafts both accepted and rejected
    assert rows == [] and stats["violations"] == 0
    assert "kv_canary violation" not in caplog.text
    assert stats["verify_entries"] > 10_000
    # Every draft's record was written with its token: no position went out as not
    # known and was settled afterwards (the path drafts took when sent as -1).
    assert stats["async_arrived"] == 0 and stats["async_settled"] == 0


def _accepted_positions(llm: Any, drafts: Drafts, limit: int = 60) -> tuple[Any, list[int]]:
    """Step until a running request has just had drafts accepted (and some left to
    generate); the request and its accepted drafts' positions (computed now)."""
    sched = H.scheduler(llm)
    for _ in range(limit):
        drafts.last.clear()
        H.step(llm)
        for rid, _, accepted in drafts.last:
            request = sched.requests.get(rid)
            if accepted and request is not None and not request.is_finished() and (
                    request.num_output_tokens < MAX_TOKENS - 8):  # fmt: skip
                k = request.num_computed_tokens  # rolled back past the rejected drafts
                return request, list(range(k - accepted, k))
    raise AssertionError(f"no draft accepted in {limit} steps ({drafts})")


def _slot(llm: Any, request: Any, position: int) -> tuple[int, int]:
    block_ids = H.scheduler(llm).kv_cache_manager.get_block_ids(request.request_id)[0]
    return block_ids[position // H.BLOCK_SIZE], position % H.BLOCK_SIZE


def _at_accepted_drafts(llm: Any) -> tuple[Any, list[int], Any, int]:
    """The workload's requests stepped until one has accepted drafts: that request, its
    accepted positions, the connector and the violation rows reported so far."""
    drafts = _count_drafts(llm)
    for i, p in enumerate(_prompts()):
        H.add_request(llm, f"r{i}", p, MAX_TOKENS)
    request, positions = _accepted_positions(llm, drafts)
    conn = H.connector(llm)
    conn.worker.flush()
    return request, positions, conn, len(conn.worker.violations)


def _next_step_rows(llm: Any, conn: Any, before: int) -> list[Any]:
    H.step(llm)
    conn.worker.flush()
    return conn.worker.violations[before:]


def test_kv_byte_flipped_at_accepted_draft_is_reported_next_step(
    checkpoints: dict[str, Path],
) -> None:
    """A K byte of an accepted draft's slot flipped in vLLM's KV cache after the step that
    computed it: the next step's read of it fails its TAIL fingerprint (the draft's TAIL
    record holds the fingerprint of the KV the step stored there)."""
    with H.vllm_engine(checkpoints["llama"], canary=CANARY, speculative_config=SPEC) as llm:
        request, positions, conn, before = _at_accepted_drafts(llm)
        assert before == 0
        block, offset = _slot(llm, request, positions[-1])
        H.flip_k_byte(conn, 0, block, offset)
        rows = _next_step_rows(llm, conn, before)
    slot = block * H.BLOCK_SIZE + offset
    assert rows, f"not reported in the next step (slot {slot}, position {positions[-1]})"
    assert {(r.launch_tag, r.slot_idx) for r in rows} == {("TAIL_K_FULL", slot)}
    assert all("verify_real_kv_hash" in r.fail_reasons for r in rows)


def test_committed_token_other_than_accepted_draft_fails_verify_token(
    checkpoints: dict[str, Path],
) -> None:
    """vLLM commits, at an accepted draft's position, a token other than the draft whose
    KV the step computed (the request's token ids rewritten in the scheduler: a sampler
    that reports one token and keeps the KV of another). The next step sends the
    committed token; the draft's record carries the draft's, so the read of that slot
    fails ``verify_token`` in that step."""
    with H.vllm_engine(checkpoints["llama"], canary=CANARY, speculative_config=SPEC) as llm:
        request, positions, conn, before = _at_accepted_drafts(llm)
        p = positions[0]
        draft = request._all_token_ids[p]
        other = draft % 300 + 1
        request._all_token_ids[p] = other
        request._output_token_ids[p - request.num_prompt_tokens] = other
        block, offset = _slot(llm, request, p)
        rows = _next_step_rows(llm, conn, before)
    slot = block * H.BLOCK_SIZE + offset
    hits = [r for r in rows if r.slot_idx == slot and "verify_token" in r.fail_reasons]
    assert hits, [(r.launch_tag, r.fail_reasons, r.slot_idx) for r in rows]
    assert hits[0].launch_tag == "HEAD_K_FULL"
    assert (hits[0].stored_token, hits[0].expected_token) == (draft, other)


def _start_up_error(ckpt: Path, spec: dict[str, Any]) -> list[str]:
    """The messages of the exception chain an engine with the canary and ``spec`` fails
    its start-up with."""
    with pytest.raises(Exception) as info, H.vllm_engine(ckpt, canary=CANARY,
                                                         speculative_config=spec):  # fmt: skip
        pass
    return [str(e) for e in H.error_chain(info.value)]


def test_other_speculative_methods_are_refused(tmp_path: Path) -> None:
    """A drafter model (``draft_model``: a 1-layer tiny Llama beside the target) is refused
    at start-up with one line naming the option and what is allowed."""
    from hf_fixtures import make_tiny_hf_checkpoint

    target = H.make_checkpoint(tmp_path, "llama")
    draft = make_tiny_hf_checkpoint(tmp_path / "draft", "llama", head_dim=H.HEAD_DIM,
                                    num_hidden_layers=1)  # fmt: skip
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    chain = _start_up_error(target, spec)
    want = ("speculative_config method 'draft_model' is not covered; the canary covers "
            "speculative decoding with method 'ngram' only")  # fmt: skip
    assert any(want in s for s in chain), chain


def test_ngram_under_async_scheduling_is_refused(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ngram`` with async scheduling turned on after vLLM's config checks (the CPU
    platform hook, as test_vllm_async.py does): refused at start-up."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def with_async(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(with_async))
    chain = _start_up_error(checkpoints["llama"], SPEC)
    want = "speculative_config method 'ngram' with async_scheduling=True is not covered"
    assert any(want in s for s in chain), chain
