"""``kvcanary explain``: from violation lines to likely causes, with the evidence.

Reads any log holding ``kv_canary violation: ...`` lines, from kvcanary or SGLang, with the
newest (``verify_chain_hash`` ...) or the older (``chain_hash`` ...) fail-reason labels, any
prefix (timestamps, ``RuntimeError:``) and trailing fields. Rows are grouped by launch tag
and fail reasons and by slot, and each row is matched to the cause its signature points at:

    signature                                              likely cause
    write_position, expected_aux != position               stale_seed: the seed slot of the
      (expected_aux = seed position + 1)                   write held another position (SWA
                                                           tags: stale full->SWA mapping)
    write_token                                            wrong_input_token (sampler/scheduler
                                                           fed another request's token)
    real_kv_hash only, stored chain == expected            kv_byte_corruption (SWEEP tags only:
                                                           cached_kv_byte_corruption; *_STATE
                                                           tags: compress_state_corruption)
    chain_hash with expected_aux = 0                       never_written_predecessor
    chain_hash only (position and token match)             req_to_token_remap / stale reuse
    position (+chain), stored record all zero              unwritten_slot (page-table shift,
                                                           mapping onto a fresh slot)
    position + chain_hash                                  wrong_slot (page table, mapping or
                                                           reuse points at another position's slot)
    position only (chain intact)                           position_shift (a page table shifted
                                                           onto another self-consistent run of
                                                           slots, or KV written at a wrong position)
    verify_token, a token field >= 2^62 on either side     cross_namespace_hit (tenant
                                                           isolation: KV of one cache
                                                           namespace read by another)
    verify_token                                           wrong_token
    verify_not_resident, SWA tags                          premature_window_eviction
    verify_not_resident, FULL tags                         missing_slot
    write_kv_store                                         lost_kv_store

Rows of a speculative draft model's canary (lines ending `` pool=draft``) get draft causes:
the draft's KV only (the target verified every draft: outputs unaffected, acceptance lost)::

    write_position one position off (|position - expected_aux| = 1),  draft_position_shift
      or verify_position only (a record chained right, at a wrong position)
    verify_token / write_token                                        draft_wrong_token
    anything else                                                     draft_kv_corruption

Tags name their pool kind: FULL and SWA (SGLang's), C4 / C128 / INDEXER (DeepSeek-V4
compressed rows: ``slot_idx`` is the compressed row, ``position`` the block index) and
C4_STATE / C128_STATE / INDEXER_STATE (compressor rings: ``slot_idx`` is the ring row,
``position`` the token whose raw state the row holds). Slots are grouped per kind.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvcanary.canary.wire.constants import (
    FAIL_REASON_LABELS,
    LEGACY_FAIL_REASON_LABELS,
    FailReason,
    split_launch_tag,
)
from kvcanary.canary.wire.violation import (
    VIOLATION_LINE_PREFIX,
    ViolationRecord,
    fail_reason_labels,
    launch_tag_name,
    parse_violation_line,
)

_REASON_RE = re.compile(r"fail_reason=(\S+)")
_LEGACY_ONLY = set(LEGACY_FAIL_REASON_LABELS.values()) - set(FAIL_REASON_LABELS.values())
_CHAIN = FailReason.VERIFY_CHAIN_HASH_MISMATCH
_POSITION = FailReason.VERIFY_POSITION_MISMATCH
_REAL_KV = FailReason.VERIFY_REAL_KV_HASH_MISMATCH
_TOKEN = FailReason.VERIFY_TOKEN_MISMATCH
_WRITE_TOKEN = FailReason.WRITE_TOKEN_MISMATCH
_WRITE_POSITION = FailReason.WRITE_POSITION_MISMATCH
_NOT_RESIDENT = FailReason.VERIFY_NOT_RESIDENT
_KV_STORE = FailReason.WRITE_KV_STORE_MISMATCH
_SALTED = 1 << 62  # token fields salted by tenant isolation (integrations.vllm.namespace)

_DRAFT = ("the draft model's KV (pool=draft); the target verified every draft, outputs "
          "unaffected (acceptance drops); look at draft positions / chunk-boundary inputs / "
          "draft rollback: ")
_DRAFT_CONTEXT = " pool=draft"

CAUSES: dict[str, str] = {
    "premature_window_eviction": "a position inside the sliding window (which attention "
    "reads) has no SWA slot: the full->SWA mapping of its full slot is 0, so its SWA KV was "
    "freed while still in the window (an eviction frontier off by some pages, or a free_swa "
    "of an in-window page); attention read a freed or reused slot",
    "missing_slot": "a position attention reads has no slot at all: its req->token entry "
    "is 0 (a table row truncated or zeroed while the request runs)",
    "lost_kv_store": "a slot written this forward does not hold the K/V bytes attention was "
    "given for its token: the store was skipped or went to another slot (a wrong "
    "out_cache_loc / slot mapping inside the attention kernel), while the records look right",
    "stale_seed": "a write was chained from a seed slot holding another position: the "
    "predecessor slot (req->token[pos - 1], SWA-translated on SWA tags) is stale. On SWA tags "
    "a stale full->SWA mapping (the SWA slot was freed and reused, e.g. after a restore or "
    "window eviction); on FULL tags a req->token entry or a slot reused after free",
    "wrong_input_token": "the forward fed a token the request does not hold (write-input "
    "assertion): a sampler or scheduler mix-up between requests, or stale input ids",
    "kv_byte_corruption": "the real KV bytes changed after they were written while token, "
    "position and chain are intact: byte corruption of the KV (a stray write, a copy or "
    "transfer that landed on the wrong pages without its record)",
    "compress_state_corruption": "the raw compressor state of a token still waiting for its "
    "compression window (a DeepSeek-V4 compress-state ring row in the live tail) changed "
    "after it was written, while its record is intact: a stray write into the ring, a "
    "compressor that stored a token's state into another token's row, or a transfer that "
    "moved SWA pages without their rings; the next compressed entry will be computed from "
    "the wrong state",
    "cached_kv_byte_corruption": "bytes of cached-but-unused KV changed (only the radix sweep "
    "saw it: no running request read them): corruption in the prefix cache or an "
    "offload/restore path",
    "never_written_predecessor": "the predecessor slot's record is all zeros (its hash "
    "mix3(0,0,0) = 0): a slot read as history was never written by the canary, e.g. a fresh "
    "slot mapped into a request, or a mapping/page table pointing at unwritten memory",
    "req_to_token_remap": "position (and token) match but the chain differs: the slot holds "
    "the same position of another request's history; a req->token entry remapped to another "
    "request's slot, or a slot freed and reused while still referenced",
    "unwritten_slot": "the slot's record is all zeros: the request reads a slot nothing "
    "wrote, e.g. a page table shifted onto free pages or a mapping onto a fresh SWA slot",
    "wrong_slot": "the slot holds the record of another position (and history): the page "
    "table, req->token entry or SWA mapping points at the wrong slot, or the slot was "
    "reused after free",
    "position_shift": "the slot's record chains correctly from its predecessor but sits at "
    "another position: the page table (req->token row) or mapping is shifted onto another, "
    "self-consistent run of slots (e.g. off by whole pages), or the KV was written with a "
    "wrong position (e.g. a RoPE / draft position off by one)",
    "cross_namespace_hit": "the slot holds KV written under another cache namespace (tenant "
    "isolation is on, so token fields carry the namespace's salt): a prefix-cache hit across "
    "LoRA adapters or cache_salt values, e.g. a block hash that leaves the adapter or the "
    "salt out (vLLM #27211's lineage, #44701); the KV was computed with another tenant's "
    "weights or prompt",
    "wrong_token": "the slot holds another token than the request's: a wrong token was written "
    "into the KV (e.g. a draft rotation bug) or the slot was reused; with position and chain "
    "intact under speculative decoding: a rejected draft's KV read as accepted (the bonus "
    "token's KV went to another slot, or a rollback kept the rejected draft's slot)",
    "draft_position_shift": _DRAFT + "a draft forward wrote its KV one position off (its seed "
    "slot holds the position before the one it claims): draft positions off by one, as SGLang's "
    "EAGLE draft positions were (#25015); the draft's RoPE and records are shifted",
    "draft_wrong_token": _DRAFT + "the draft's KV holds another token than the sequence: the "
    "draft's inputs are rotated wrongly, e.g. at a chunk boundary of its catch-up prefill "
    "(SGLang #26329: the next chunk's first token fed at the last position), or stale drafts "
    "left after its rollback",
    "draft_kv_corruption": _DRAFT + "the draft's KV or its req->token rows are corrupt (see the "
    "evidence for the per-row signature): look at the draft's rollback and page accounting",
    "unclassified": "a combination of checks no single cause explains",
}


@dataclass(frozen=True, slots=True)
class ParsedViolation:
    record: ViolationRecord
    line_no: int  # 1-based
    line: str  # from the marker on
    legacy_labels: bool

    @property
    def tag(self) -> str:
        return launch_tag_name(self.record.launch_tag)

    @property
    def kind(self) -> str:
        """The pool kind of the tag (``SWA``, ``C4_STATE`` ...), or the tag when unknown."""
        try:
            return split_launch_tag(self.record.launch_tag)[0].name
        except ValueError:
            return self.tag

    @property
    def reasons(self) -> str:
        return "+".join(fail_reason_labels(self.record.fail_reason)) or "none"

    @property
    def draft(self) -> bool:
        """A row of a speculative draft model's canary (its line ends `` pool=draft``)."""
        return _DRAFT_CONTEXT in self.line


def parse_log(text: str) -> tuple[list[ParsedViolation], list[dict[str, Any]]]:
    """Violation lines of a log; the second list names the marked lines that did not parse."""
    parsed, unparsed = [], []
    for i, line in enumerate(text.splitlines(), 1):
        at = line.find(VIOLATION_LINE_PREFIX)
        if at < 0:
            continue
        try:
            record = parse_violation_line(line)
        except ValueError as e:
            unparsed.append({"line_no": i, "error": str(e)})
            continue
        assert record is not None
        m = _REASON_RE.search(line)
        legacy = m is not None and any(x in _LEGACY_ONLY for x in m.group(1).lower().split("+"))
        parsed.append(ParsedViolation(record, i, line[at:].strip(), legacy))
    return parsed, unparsed


@dataclass
class _Cause:
    name: str
    count: int = 0
    tags: Counter[str] = field(default_factory=Counter)
    evidence: Counter[str] = field(default_factory=Counter)
    example: str = ""


def _hex(v: int) -> str:
    return f"0x{v & (2**64 - 1):016x}"


def classify(v: ParsedViolation) -> tuple[str, str]:
    """``(cause, evidence)`` of one row (see the module table; draft-pool rows: the draft
    table)."""
    if v.draft:
        return _classify_draft(v)
    return _classify(v)


def _classify_draft(v: ParsedViolation) -> tuple[str, str]:
    r, bits = v.record, v.record.fail_reason
    if bits & _WRITE_POSITION and abs(r.position - r.expected_aux) == 1:
        return "draft_position_shift", (
            f"{v.tag} pool=draft: slot {r.slot_idx} written as position {r.position}, its seed "
            f"says {r.expected_aux} (off by {r.position - r.expected_aux:+d})"
        )
    if bits & (_TOKEN | _WRITE_TOKEN):
        return "draft_wrong_token", (
            f"{v.tag} pool=draft: position {r.position} (slot {r.slot_idx}) holds token "
            f"{r.stored_token}, the sequence has {r.expected_token}"
        )
    cause, evidence = _classify(v)
    if cause == "position_shift":  # a self-consistent record at another position: read later
        return "draft_position_shift", f"pool=draft: {evidence}"
    return "draft_kv_corruption", f"pool=draft, as {cause}: {evidence}"


def _classify(v: ParsedViolation) -> tuple[str, str]:
    r, bits = v.record, v.record.fail_reason
    if bits & _NOT_RESIDENT:
        if "_SWA" in v.tag:
            return "premature_window_eviction", (
                f"{v.tag}: position {r.position} (full slot {r.slot_idx}) is inside the window "
                f"of sequence length {r.expected_aux} but maps to no SWA slot"
            )
        return "missing_slot", (
            f"{v.tag}: position {r.position} of a sequence of length {r.expected_aux} has "
            f"req->token entry {r.slot_idx}"
        )
    if bits & _KV_STORE:
        return "lost_kv_store", (
            f"{v.tag}: slot {r.slot_idx} (position {r.position}) holds KV fingerprint "
            f"{_hex(r.stored_chain_hash)}, attention stored {_hex(r.expected_aux)}"
        )
    if bits & _WRITE_POSITION and not bits & _WRITE_TOKEN and r.expected_aux != r.position:
        seed_pos = r.expected_aux - 1
        return "stale_seed", (
            f"{v.tag}: write at position {r.position} has expected_aux={r.expected_aux} (seed "
            f"position + 1) => its seed slot held position {seed_pos}, not {r.position - 1} "
            f"(off by {seed_pos - (r.position - 1):+d})"
        )
    if bits & _WRITE_TOKEN:
        return "wrong_input_token", (
            f"{v.tag}: fed token {r.stored_token} at position {r.position}, the request holds "
            f"{r.expected_token}"
        )
    chain_intact = r.stored_chain_hash == r.expected_aux
    if bits == _REAL_KV and chain_intact and v.kind.endswith("_STATE"):
        return "compress_state_corruption", (
            f"{v.tag}: ring row {r.slot_idx} (the raw state of position {r.position}) changed "
            f"after it was written; stored chain == expected ({_hex(r.expected_aux)})"
        )
    if bits == _REAL_KV and chain_intact:
        cause = "cached_kv_byte_corruption" if v.tag.startswith("SWEEP_") else "kv_byte_corruption"
        return cause, (
            f"{v.tag}: only the real-KV fingerprint differs; stored chain == expected "
            f"({_hex(r.expected_aux)}), token and position intact"
        )
    if bits & _CHAIN and r.expected_aux == 0:
        return "never_written_predecessor", (
            f"{v.tag}: expected_aux=0x0000000000000000 (the predecessor's record is all zeros)"
        )
    if bits & _TOKEN and max(r.stored_token, r.expected_token) >= _SALTED:
        return "cross_namespace_hit", (
            f"{v.tag}: slot {r.slot_idx} (position {r.position}) was written under another "
            f"cache namespace (salted token {_hex(r.stored_token)}, the reader's "
            f"{_hex(r.expected_token)})"
        )
    if bits & _POSITION and r.position == 0 and r.stored_token == 0 and r.stored_chain_hash == 0:
        return "unwritten_slot", f"{v.tag}: slot {r.slot_idx} holds an all-zero record"
    if bits & _POSITION and bits & _CHAIN:
        return "wrong_slot", (
            f"{v.tag}: slot {r.slot_idx} holds position {r.position} with another history"
        )
    if bits & _POSITION:
        return "position_shift", (
            f"{v.tag}: slot {r.slot_idx} stores position {r.position}, chained correctly from "
            f"its predecessor"
        )
    if bits & _TOKEN:
        return "wrong_token", (
            f"{v.tag}: slot {r.slot_idx} holds token {r.stored_token}, the request has "
            f"{r.expected_token}"
        )
    if bits & _CHAIN:
        return "req_to_token_remap", (
            f"{v.tag}: position {r.position} matches, chain {_hex(r.stored_chain_hash)} != "
            f"expected {_hex(r.expected_aux)}"
        )
    return "unclassified", f"{v.tag}: fail_reason={v.reasons}"


def _swapped_tokens(rows: list[ParsedViolation]) -> int:
    """Pairs of write_token rows whose (fed, expected) tokens mirror each other."""
    pairs = Counter(
        (v.record.stored_token, v.record.expected_token)
        for v in rows if v.record.fail_reason & _WRITE_TOKEN
    )  # fmt: skip
    return sum(min(n, pairs[(b, a)]) for (a, b), n in pairs.items() if a < b)


def explain(text: str) -> dict[str, Any]:
    """The analysis of a log (stable JSON keys, see docs/CLI.md)."""
    rows, unparsed = parse_log(text)
    groups: dict[tuple[str, str], list[ParsedViolation]] = defaultdict(list)
    slots: dict[tuple[str, int], list[ParsedViolation]] = defaultdict(list)
    causes: dict[str, _Cause] = {}
    for v in rows:
        groups[(v.tag + (_DRAFT_CONTEXT if v.draft else ""), v.reasons)].append(v)
        slots[(v.kind + (_DRAFT_CONTEXT if v.draft else ""), v.record.slot_idx)].append(v)
        name, evidence = classify(v)
        c = causes.setdefault(name, _Cause(name, example=v.line))
        c.count += 1
        c.tags[v.tag] += 1
        c.evidence[evidence] += 1
    hints = _hints(rows)
    return {
        "lines": len(text.splitlines()),
        "violations": len(rows),
        "unparsed": unparsed,
        "label_generations": {"new": sum(not v.legacy_labels for v in rows),
                              "legacy": sum(v.legacy_labels for v in rows)},  # fmt: skip
        "by_tag": dict(sorted(Counter(v.tag for v in rows).items())),
        "by_pool": dict(sorted(Counter("draft" if v.draft else "target" for v in rows).items())),
        "by_reason": dict(sorted(Counter(x for v in rows for x in v.reasons.split("+")).items())),
        "groups": [
            {"launch_tag": tag, "fail_reason": reasons, "count": len(g),
             "distinct_slots": len({v.record.slot_idx for v in g}),
             "positions": [min(v.record.position for v in g), max(v.record.position for v in g)],
             "first_line_no": g[0].line_no, "example": g[0].line}
            for (tag, reasons), g in sorted(groups.items(), key=lambda kv: -len(kv[1]))
        ],  # fmt: skip
        "top_slots": [
            {"group": kind, "slot_idx": slot, "count": len(g),
             "tags": sorted({v.tag for v in g}), "positions": sorted({v.record.position for v in g})[:8]}
            for (kind, slot), g in sorted(slots.items(), key=lambda kv: -len(kv[1]))[:10]
        ],  # fmt: skip
        "causes": [
            {"cause": c.name, "count": c.count, "explanation": CAUSES[c.name],
             "launch_tags": dict(c.tags.most_common()),
             "evidence": [e for e, _ in c.evidence.most_common(3)],
             "example": c.example}
            for c in sorted(causes.values(), key=lambda c: -c.count)
        ],  # fmt: skip
        "hints": hints,
    }


def _hints(rows: list[ParsedViolation]) -> list[str]:
    """Observations across rows that sharpen the per-row causes."""
    hints = []
    kinds = Counter(v.kind for v in rows if v.record.fail_reason & (_CHAIN | _POSITION))
    if kinds and set(kinds) == {"SWA"}:
        hints.append(
            "chain/position violations only on SWA tags, none on FULL: the full-pool view is "
            "consistent, so the full->SWA translation (the SWA mapping) is the suspect"
        )
    stages = Counter(v.tag.split("_", 1)[0] for v in rows)
    if stages and set(stages) == {"SWEEP"}:
        hints.append(
            "only the radix sweep reported: the corrupted KV is cached but unused (no running "
            "request read it)"
        )
    zeros = sum(1 for v in rows if v.record.fail_reason & _CHAIN and v.record.expected_aux == 0)
    if zeros >= 10:
        hints.append(
            f"expected_aux=0 flood ({zeros} rows): many predecessors were never written; "
            "look for a path that maps slots into requests without computing them"
        )
    drafted = sum(v.draft for v in rows)
    if drafted:
        hints.append(
            f"{drafted} row(s) on the draft model's pool (pool=draft): the draft model's KV; the "
            "target verified every draft, outputs unaffected; look at draft positions / "
            "chunk-boundary inputs / draft rollback"
        )
    kept = sum(1 for v in rows if not v.draft and v.record.fail_reason == _TOKEN
               and v.record.stored_chain_hash == v.record.expected_aux)  # fmt: skip
    if kept:
        hints.append(
            f"{kept} verify_token row(s) with position and chain intact on the target: KV "
            "computed for the right position and history but from another token; under "
            "speculative decoding, a rejected draft's KV read as accepted (the bonus token's "
            "KV written to another slot, or a rollback that kept the rejected draft's slot)"
        )
    swaps = _swapped_tokens(rows)
    if swaps:
        hints.append(
            f"{swaps} pair(s) of write_token rows with mirrored tokens: two requests' next "
            "tokens were swapped (sampler output rows misassigned)"
        )
    return hints


def render_explain(summary: dict[str, Any]) -> str:
    from tabulate import tabulate

    if not summary["violations"]:
        tail = f" ({len(summary['unparsed'])} marked line(s) did not parse)" if summary["unparsed"] else ""
        return f"kvcanary explain: no kv_canary violation lines found{tail}"
    groups = tabulate(
        [[g["launch_tag"], g["fail_reason"], g["count"], g["distinct_slots"],
          f"{g['positions'][0]}..{g['positions'][1]}"] for g in summary["groups"]],
        headers=["launch_tag", "fail_reason", "rows", "slots", "positions"], tablefmt="simple",
    )  # fmt: skip
    causes = tabulate(
        [[c["cause"], c["count"], ", ".join(c["launch_tags"]), c["evidence"][0]]
         for c in summary["causes"]],
        headers=["likely cause", "rows", "tags", "evidence (most frequent)"], tablefmt="simple",
    )  # fmt: skip
    head = (
        f"kvcanary explain: {summary['violations']} violation line(s) "
        f"({summary['label_generations']['legacy']} with legacy labels), "
        f"{len(summary['unparsed'])} unparsed"
    )
    meanings = "\n".join(f"  {c['cause']}: {c['explanation']}" for c in summary["causes"])
    sections = [head, "by tag and reason\n" + groups, "likely causes\n" + causes,
                "what each cause means\n" + meanings]  # fmt: skip
    if summary["hints"]:
        sections.append("hints\n" + "\n".join(f"  - {h}" for h in summary["hints"]))
    return "\n\n".join(sections)
