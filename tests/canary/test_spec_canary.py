"""The canary across speculative decoding (kvcanary.engine.speculative): the draft model's
runner carries a canary of its own (its pools, rows and records), silent on clean runs of
high and low acceptance, and a fault in the draft's KV is reported by it, with
`` pool=draft`` on the line, while the target's canary stays silent (the target verifies
every draft, so the outputs stay greedy-exact)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch
from engine_utils import tiny_engine
from prometheus_client.parser import text_string_to_metric_families

from kvcanary import Engine, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.explain import explain
from kvcanary.cli.command import main
from kvcanary.config import SpeculativeConfig

CANARY = CanaryConfig(mode="log", real_data="all", verify_tokens=True)


def _draft(model: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", num_speculative_tokens=k, draft_model=model)


def _prompts(seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    pat = [rng.randrange(vocab) for _ in range(5)]
    return [pat * 7 + [rng.randrange(vocab) for _ in range(3)],
            [rng.randrange(vocab) for _ in range(37)]]  # fmt: skip


@pytest.mark.parametrize("draft", ["builtin:tiny-swa", "builtin:tiny-mha"],
                         ids=["same-model-high-acceptance", "other-model-low-acceptance"])  # fmt: skip
def test_draft_runner_has_its_own_canary_silent_on_clean_runs(draft: str) -> None:
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = [o.output_ids for o in tiny_engine().generate(prompts, sp)]
    engine = tiny_engine(speculative=_draft(draft), canary=CANARY, page_size=2)
    assert [o.output_ids for o in engine.generate(prompts, sp)] == expected
    target, drafted = engine.canary, engine.draft_canary
    assert target is not None and drafted is not None and target is not drafted
    assert engine.canaries == [target, drafted]
    proposer = engine.scheduler.proposer
    assert proposer is not None
    # The draft canary guards the draft's own pool, and saw every draft forward.
    assert drafted.pool is proposer.runner.token_to_kv_pool  # type: ignore[attr-defined]
    assert drafted.step == proposer.num_forwards > 0  # type: ignore[attr-defined]
    assert drafted.stats()["verify_entries_by_tag"]["HEAD_K_FULL"] > 1000
    assert target.violations == [] and drafted.violations == []
    st = engine.stats
    if draft == "builtin:tiny-swa":  # the draft is the target: every draft accepted
        assert st.spec_num_accepted == st.spec_num_proposed > 0
    else:  # rejections: the draft rolls its KV back and recomputes it
        assert st.spec_num_accepted < 0.2 * st.spec_num_proposed
    engine.check_integrity()


def _draft_slot_of_kept_position(engine: Engine) -> tuple[int, int]:
    """A slot of a running request's draft KV that the next draft forward reads (a kept,
    committed position), and that position."""
    proposer = engine.scheduler.proposer
    d = next(d for d in proposer.reqs.values() if d.kv_len > 8)  # type: ignore[union-attr]
    pos = 3  # inside the prompt: kept by every rollback
    table = proposer.kv.req_to_token  # type: ignore[union-attr]
    return int(table[d.req_pool_idx, pos]), pos


def test_a_flipped_draft_kv_byte_is_reported_by_the_draft_canary_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompts = _prompts(seed=3)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = [o.output_ids for o in tiny_engine().generate(prompts, sp)]
    engine = tiny_engine(speculative=_draft("builtin:tiny-mha"), canary=CANARY, page_size=2)
    rids = [engine.add_request(p, sp) for p in prompts]
    for _ in range(3):
        engine.step()
    slot, pos = _draft_slot_of_kept_position(engine)
    draft_pool = engine.scheduler.proposer.runner.token_to_kv_pool  # type: ignore[union-attr]
    draft_pool.k_buffer[0][slot].view(-1).view(torch.uint8)[0] ^= 0xFF  # the draft's layer 0
    drafted = engine.draft_canary
    assert drafted is not None and drafted.violations == []
    with caplog.at_level(logging.WARNING, logger="kvcanary.canary"):
        engine.step()  # its next proposal reads the draft's KV
        rows = list(drafted.violations)
        done = {}
        while engine.has_unfinished():
            done.update({o.rid: o.output_ids for o in engine.step()})
    assert rows, "the draft canary reported nothing in the step after the flip"
    assert {(r.launch_tag, r.slot_idx, r.position) for r in rows} == {("TAIL_K_FULL", slot, pos)}
    assert all("verify_real_kv_hash" in r.fail_reasons for r in rows)
    assert engine.canary is not None and engine.canary.violations == []  # the target: clean
    assert [done[r] for r in rids] == expected  # every draft verified: outputs exact
    lines = [m for m in caplog.messages if "kv_canary violation:" in m]
    assert lines and all(" pool=draft" in m.splitlines()[0] for m in lines)
    summary = explain("\n".join(caplog.messages))
    assert summary["violations"] == len(lines)
    assert summary["by_tag"] == {"TAIL_K_FULL": len(lines)}


def test_run_summary_and_metrics_carry_the_draft_canary(tmp_path: Path) -> None:
    out, prom = tmp_path / "run.json", tmp_path / "run.prom"
    assert main(["run", "--model", "builtin:tiny-swa", "--num-requests", "3", "--input-len", "48",
                 "--output-len", "24", "--speculative-method", "draft", "--speculative-draft-model",
                 "builtin:tiny-mha", "--kv-canary", "log", "--kv-canary-verify-tokens",
                 "--no-progress", "--json", str(out), "--metrics-file", str(prom)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["canary_violations"] == 0 and data["canary_draft_violations"] == 0
    assert data["canary_draft_verify_entries"] > 0 and data["canary_draft_write_entries"] > 0
    assert data["canary_draft_verify_entries"] != data["canary_verify_entries"]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(prom.read_text())
               for s in family.samples}  # fmt: skip
    assert samples[("kvcanary_canary_enabled", ())] == 1
    pools = (("target", "canary_verify_entries"), ("draft", "canary_draft_verify_entries"))
    for pool, key in pools:
        entries = sum(v for (name, labels), v in samples.items()
                      if name == "kvcanary_verify_entries_total" and ("pool", pool) in labels)  # fmt: skip
        assert entries == data[key]
