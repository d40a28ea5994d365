"""Violation records and their log lines (wire format shared with SGLang's canary).

The first line of every report is frozen; tools on both sides parse it::

    kv_canary violation: launch_tag=TAIL_K_SWA fail_reason=write_position slot_idx=53504 \
position=512 stored_token=1299 expected_token=1299 stored_chain_hash=0xe11e13af98c23f7f \
expected_aux=0x0000000000002100

(one line; wrapped here). Hashes print as their u64 bits, ``0x`` + 16 lowercase hex digits.
Fail reasons print in bit order joined with ``+`` (``none`` when no bit is set). Bits SGLang
does not define print as ``bit<n>`` (a kvcanary extension; SGLang never sets them).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from kvcanary.canary.wire.constants import (
    FAIL_REASON_LABELS,
    LEGACY_FAIL_REASON_LABELS,
    WRITE_FAIL_REASONS,
    CanaryLaunchTag,
    FailReason,
)
from kvcanary.canary.wire.hashing import MASK64, to_i64

VIOLATION_LINE_PREFIX = "kv_canary violation:"


class ViolationRecord(NamedTuple):
    """One ring row, field for field (``RING_COL_*`` order); hashes as signed int64 bits."""

    launch_tag: int
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int  # verify rows: expected chain hash; write rows: expected position
    fail_reason: int

    @property
    def is_write(self) -> bool:
        return bool(self.fail_reason & WRITE_FAIL_REASONS)


def launch_tag_name(tag: int) -> str:
    try:
        return CanaryLaunchTag(tag).name
    except ValueError:
        return f"unknown({tag})"


def fail_reason_labels(bits: int) -> list[str]:
    """Labels of the set bits, in bit order (newest SGLang labels)."""
    labels = []
    for i in range(64):
        bit = 1 << i
        if bits & bit:
            labels.append(FAIL_REASON_LABELS.get(FailReason(bit), f"bit{i}"))
    return labels


def _hex(value: int) -> str:
    return f"0x{value & MASK64:016x}"


def format_violation_line(r: ViolationRecord) -> str:
    """The frozen first line of a violation report (no trailing newline)."""
    reasons = "+".join(fail_reason_labels(r.fail_reason)) or "none"
    return (
        f"{VIOLATION_LINE_PREFIX} launch_tag={launch_tag_name(r.launch_tag)} "
        f"fail_reason={reasons} slot_idx={r.slot_idx} position={r.position} "
        f"stored_token={r.stored_token} expected_token={r.expected_token} "
        f"stored_chain_hash={_hex(r.stored_chain_hash)} expected_aux={_hex(r.expected_aux)}"
    )


def _canary_kind(tag: int) -> str:
    """SGLang's label: ``sweep_*`` as is, ``per_forward_*`` for the rest, ``unknown(n)``
    (a corrupt ring row's tag) unchanged."""
    name = launch_tag_name(tag).lower()
    if name.startswith(("sweep_", "unknown")):
        return name
    return f"per_forward_{name}"


def format_violation_message(
    r: ViolationRecord,
    *,
    total_violations: int,
    ring_overflow: bool,
    step_when_pumped: int,
    context: str = "",
) -> str:
    """The full multi-line report SGLang logs per violation (first line = the frozen line,
    then ``context``: more `` key=value`` fields a host appends, e.g. the vLLM connector's
    `` rank=1``; parsers ignore keys they do not know)."""
    tag = launch_tag_name(r.launch_tag)
    lines = [
        format_violation_line(r) + context,
        f"KV cache canary violation detected (kernel_kind={tag}, slot_idx={r.slot_idx}, "
        f"position={r.position})",
        f"canary_kind:       {_canary_kind(r.launch_tag)}",
        f"  fail_reasons: {' '.join(fail_reason_labels(r.fail_reason)) or 'none'}",
    ]
    if r.fail_reason & FailReason.VERIFY_NOT_RESIDENT:
        lines.append(
            f"  missing:  full_slot={r.slot_idx} position={r.position} has no slot, but "
            f"attention reads it at sequence length {r.expected_aux}"
        )
    elif r.fail_reason & FailReason.WRITE_KV_STORE_MISMATCH:
        lines += [
            f"  actual:   token_id={r.stored_token}   position={r.position} "
            f"pool_kv_hash={_hex(r.stored_chain_hash)}",
            f"  expected: stored_kv_hash={_hex(r.expected_aux)}",
        ]
    elif r.is_write:
        lines += [
            f"  actual:   token_id={r.stored_token}   position={r.position} "
            f"prev_hash={_hex(r.stored_chain_hash)}",
            f"  expected: token_id={r.expected_token}   position={r.expected_aux}",
        ]
    else:
        lines.append(
            f"  stored:   token_id={r.stored_token}   position={r.position} "
            f"prev_hash={_hex(r.stored_chain_hash)}"
        )
        if r.fail_reason & FailReason.VERIFY_TOKEN_MISMATCH:
            lines.append(
                f"  expected: token_id={r.expected_token} prev_hash={_hex(r.expected_aux)}"
            )
        else:
            lines.append(f"  expected: prev_hash={_hex(r.expected_aux)}")
    lines.append(
        f"  total_violations={total_violations} ring_overflow={ring_overflow} "
        f"step_when_pumped={step_when_pumped}"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- parsing

_LINE_RE = re.compile(re.escape(VIOLATION_LINE_PREFIX) + r"\s*([^\n]*)")
_FIELD_RE = re.compile(r"(\w+)=(\S+)")
_UNKNOWN_TAG_RE = re.compile(r"unknown\((-?\d+)\)")
_UNKNOWN_BIT_RE = re.compile(r"bit(\d+)")
_LABEL_TO_BITS: dict[str, int] = {
    label: int(reason)
    for table in (LEGACY_FAIL_REASON_LABELS, FAIL_REASON_LABELS)
    for reason, label in table.items()
}


def parse_fail_reason(text: str) -> int:
    """Bits of a ``fail_reason`` value: new or legacy labels joined by ``+``, or ``none``."""
    bits = 0
    for label in text.strip().lower().split("+"):
        if label == "none":
            continue
        if label in _LABEL_TO_BITS:
            bits |= _LABEL_TO_BITS[label]
        elif m := _UNKNOWN_BIT_RE.fullmatch(label):
            bits |= 1 << int(m.group(1))
        else:
            raise ValueError(f"unknown kv_canary fail_reason label {label!r}")
    return bits


def _parse_tag(text: str) -> int:
    if m := _UNKNOWN_TAG_RE.fullmatch(text):
        return int(m.group(1))
    try:
        return int(CanaryLaunchTag[text.upper()])
    except KeyError:
        raise ValueError(f"unknown kv_canary launch_tag {text!r}") from None


def _parse_int(text: str) -> int:
    low = text.lower()
    if low.startswith(("0x", "-0x")):
        return to_i64(int(low, 16))
    return to_i64(int(low, 10))


def parse_violation_line(line: str) -> ViolationRecord | None:
    """Decode a violation line from kvcanary or SGLang (any log prefix, any generation).

    Returns ``None`` when ``line`` holds no ``kv_canary violation:`` marker. Keys may come in
    any order; unknown keys (e.g. a trailing ``total_violations=``) are ignored; the first
    occurrence of a key wins. Raises ``ValueError`` when a marked line lacks a field or holds
    an undecodable value.
    """
    m = _LINE_RE.search(line)
    if m is None:
        return None
    fields: dict[str, str] = {}
    for key, value in _FIELD_RE.findall(m.group(1)):
        fields.setdefault(key, value.rstrip(",;"))
    missing = [k for k in ViolationRecord._fields if k not in fields]
    if missing:
        raise ValueError(f"kv_canary violation line lacks {missing}: {line.strip()!r}")
    try:
        return ViolationRecord(
            launch_tag=_parse_tag(fields["launch_tag"]),
            fail_reason=parse_fail_reason(fields["fail_reason"]),
            **{
                k: _parse_int(fields[k])
                for k in ViolationRecord._fields
                if k not in ("launch_tag", "fail_reason")
            },
        )
    except ValueError as e:
        raise ValueError(f"{e} in kv_canary violation line {line.strip()!r}") from None
