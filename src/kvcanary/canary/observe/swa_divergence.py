"""SWA divergence reporter: coverage telemetry proving the sliding-window path was exercised.

It never checks anything and never changes a forward. On a pool with an SWA group, a green
run only means something if (1) the SWA allocator's slots drifted away from the full ones,
so the full->SWA translation is not the identity, (2) the window actually slid, and (3) the
SWA group verified less than the FULL group (the window clipped it). Every ``interval``
forward steps it samples the current batch (SGLang's ``kv_canary_swa_divergence=`` line)::

    R[b, p] = req_to_token[row_b, p]     live: row_b != 0 (not padding) and p < seq_len_b
    S[b, p] = mapping[R[b, p]]           (the SWA allocator's full->SWA mapping)
    swa_full_idx_divergence  = #live (S != R and S != 0)
    swa_out_of_window_tokens = #live (S == 0)

plus the cumulative verify entries of the FULL and SWA groups (a device ``[2]`` counter
added to after every plan). The sample is staged at step T and logged at T + 1 with T's
values (:mod:`.delayed`)::

    kv_canary_swa_divergence={"forward_ct":120,"verify_full":10000,"verify_swa":4200,"swa_full_idx_divergence":512,"swa_out_of_window_tokens":8192}

Both metrics are snapshots of one batch, so tests look at the peak over samples
(:func:`assert_swa_divergence_observed`); the totals only grow, so the lag is read on the
last sample.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

from kvcanary.canary.observe.delayed import DelayedDeviceHostHandler, Staged
from kvcanary.canary.wire.constants import PoolKind

logger = logging.getLogger("kvcanary.canary")

SWA_DIVERGENCE_PREFIX = "kv_canary_swa_divergence="
_LINE_RE = re.compile(re.escape(SWA_DIVERGENCE_PREFIX) + r"(\S+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class SwaDivergenceLog:
    """One sample; fields in wire order (the JSON keys)."""

    forward_ct: int  # forward steps when the sample was staged
    verify_full: int  # cumulative FULL-group verify entries
    verify_swa: int  # cumulative SWA-group verify entries
    swa_full_idx_divergence: int  # live tokens whose SWA slot is neither 0 nor the full slot
    swa_out_of_window_tokens: int = 0  # live tokens without an SWA slot (window slid)

    def format(self) -> str:
        return SWA_DIVERGENCE_PREFIX + json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def parse(cls, line: str) -> SwaDivergenceLog | None:
        """The sample in ``line`` (any log prefix), or None. Tolerant: unknown keys are
        ignored, missing ones read 0; undecodable JSON or non-integer values give None."""
        m = _LINE_RE.search(line)
        return None if m is None else cls._from_json(m.group(1))

    @classmethod
    def _from_json(cls, payload: str) -> SwaDivergenceLog | None:
        try:
            data = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        values = {f.name: data.get(f.name, 0) for f in fields(cls)}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
            return None
        return cls(**values)

    @classmethod
    def find_all(cls, text: str) -> list[tuple[SwaDivergenceLog, str]]:
        """Every ``(sample, matched text)`` in ``text``, in order (undecodable ones skipped)."""
        out = []
        for m in _LINE_RE.finditer(text):
            record = cls._from_json(m.group(1))
            if record is not None:
                out.append((record, m.group(0)))
        return out

    @classmethod
    def find_last(cls, text: str) -> tuple[SwaDivergenceLog, str] | None:
        found = cls.find_all(text)
        return found[-1] if found else None


# ---------------------------------------------------------------- device side


class VerifyTotals:
    """Cumulative verify entries of the FULL (index 0) and SWA (index 1) groups, int64 ``[2]``
    on the canary's device; allocated once (fixed address, capture-safe adds). Other group
    kinds (DSV4 compressed) are not counted."""

    INDEX = {PoolKind.FULL: 0, PoolKind.SWA: 1}

    def __init__(self, device: torch.device):
        self.totals = torch.zeros(2, dtype=torch.int64, device=device)
        # CPU: numpy view of the same memory (a torch indexed add costs ~2.5 us per call).
        self._host = self.totals.numpy() if device.type == "cpu" else None

    def host_index(self, kinds: Sequence[PoolKind]) -> tuple[np.ndarray, list[int]] | None:
        """The totals' numpy view and each of ``kinds``' index into it (-1: not counted),
        for compiled callers that add to them directly; None off the CPU."""
        if self._host is None:
            return None
        return self._host, [self.INDEX.get(k, -1) for k in kinds]

    def observe(self, kind: PoolKind, num_entries: int | torch.Tensor) -> None:
        index = self.INDEX.get(kind)
        if index is None:
            return
        if self._host is not None and not isinstance(num_entries, torch.Tensor):
            self._host[index] += num_entries
        else:
            self.totals[index : index + 1] += num_entries


def _live_pairs(
    lut: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(R, S, live)`` of the module doc, ``[bs, max_context_len]``; no host sync."""
    rows = req_pool_indices.long()
    full = req_to_token.index_select(0, rows).long()
    cols = torch.arange(full.shape[1], device=full.device)
    live = (cols[None, :] < seq_lens.long()[:, None]) & (rows != 0)[:, None]
    swa = lut[full.clamp(0, lut.shape[0] - 1)]
    return full, swa, live


def swa_full_idx_divergence(
    lut: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """int32 ``[1]``: live tokens whose SWA slot is non-zero and differs from the full slot."""
    full, swa, live = _live_pairs(lut, req_to_token, req_pool_indices, seq_lens)
    return (live & (swa != full) & (swa != 0)).sum().reshape(1).int()


def swa_out_of_window_tokens(
    lut: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """int32 ``[1]``: live tokens without an SWA slot (mapping 0)."""
    _, swa, live = _live_pairs(lut, req_to_token, req_pool_indices, seq_lens)
    return (live & (swa == 0)).sum().reshape(1).int()


def batch_seq_lens(fb: Any) -> torch.Tensor:
    """Tokens each batch row holds after this forward (prefix + this forward's tokens)."""
    return fb.prefix_lens.long() + fb.extend_seq_lens.long()


class SwaDivergenceReporter:
    """``step(step, fb)`` once per forward step (after the step counter moved)."""

    def __init__(
        self,
        interval: int,
        totals: VerifyTotals,
        handler: DelayedDeviceHostHandler,
        lut: torch.Tensor | None,
        req_to_token: torch.Tensor,
    ):
        if interval < 1:
            raise ValueError(f"--kv-canary-swa-divergence-interval={interval}; allowed: >= 1 here")
        self.interval = interval
        self.totals = totals
        self.handler = handler
        self.lut = lut  # None: no SWA group, both metrics log 0
        self.req_to_token = req_to_token
        self.samples: list[SwaDivergenceLog] = []

    def step(self, step: int, fb: Any) -> None:
        self.handler.step(lambda: self._compute(step, fb), self._log)

    def _compute(self, step: int, fb: Any) -> Staged | None:
        if step <= 0 or step % self.interval:
            return None
        staged: Staged = {"forward_ct": step, "verify_total_count": self.totals.totals}
        if self.lut is not None and fb is not None:
            args = (self.lut, self.req_to_token, fb.req_pool_indices, batch_seq_lens(fb))
            staged["swa_full_idx_divergence"] = swa_full_idx_divergence(*args)
            staged["swa_out_of_window_tokens"] = swa_out_of_window_tokens(*args)
        return staged

    def _log(self, v: Staged) -> None:
        totals = v["verify_total_count"].tolist()
        zero = np.zeros(1, dtype=np.int64)
        record = SwaDivergenceLog(
            forward_ct=v["forward_ct"],
            verify_full=int(totals[0]),
            verify_swa=int(totals[1]),
            swa_full_idx_divergence=int(v.get("swa_full_idx_divergence", zero)[0]),
            swa_out_of_window_tokens=int(v.get("swa_out_of_window_tokens", zero)[0]),
        )
        self.samples.append(record)
        logger.info(record.format())

    def peak(self) -> dict[str, int]:
        """Peak of each metric over the samples logged so far (0 without samples)."""
        return {
            "samples": len(self.samples),
            "swa_full_idx_divergence": max((s.swa_full_idx_divergence for s in self.samples), default=0),
            "swa_out_of_window_tokens": max((s.swa_out_of_window_tokens for s in self.samples), default=0),
        }


# ---------------------------------------------------------------- test helper


def assert_swa_divergence_observed(
    log_source: str | Callable[[], str],
    *,
    min_swa_out_of_window_tokens: int = 1,
    min_swa_full_idx_divergence: int = 1,
    require_verify_lag: bool = True,
    flush_wait_seconds: float = 3.0,
    max_retries: int = 10,
) -> SwaDivergenceLog:
    """Assert the three signals on the samples in a log (returns the last sample):

    * window slid: peak ``swa_out_of_window_tokens`` >= ``min_swa_out_of_window_tokens``;
    * pool reuse: peak ``swa_full_idx_divergence`` >= ``min_swa_full_idx_divergence``;
    * verify lag: on the last sample ``verify_swa < verify_full`` (when required).

    ``log_source`` is the log text, or a callable returning the current text of a live log:
    then it is re-read (after ``flush_wait_seconds``) up to ``max_retries`` times until the
    signals hold, and the last failure is raised. Raises ``AssertionError``.
    """
    live = callable(log_source)
    attempts = max(1, max_retries) if live else 1
    failure = ""
    for attempt in range(attempts):
        if live and attempt:
            time.sleep(flush_wait_seconds)
        text = log_source() if callable(log_source) else log_source
        found = SwaDivergenceLog.find_all(text)
        if not found:
            failure = (
                f"No kv_canary swa_divergence line found in the log after {attempt + 1} "
                f"read(s) (wait={flush_wait_seconds}s each); log tail: {text[-2000:]!r}"
            )
            continue
        failure = _check_signals(found, min_swa_out_of_window_tokens,
                                 min_swa_full_idx_divergence, require_verify_lag)  # fmt: skip
        if not failure:
            return found[-1][0]
    raise AssertionError(failure)


def _check_signals(
    found: list[tuple[SwaDivergenceLog, str]], min_oow: int, min_div: int, require_lag: bool
) -> str:
    samples = [r for r, _ in found]
    last, last_text = found[-1]
    peak_oow = max(s.swa_out_of_window_tokens for s in samples)
    peak_div = max(s.swa_full_idx_divergence for s in samples)
    where = f"({len(samples)} samples; last: {last_text})"
    if peak_oow < min_oow:
        return (
            f"window never slid: peak swa_out_of_window_tokens={peak_oow} < {min_oow} {where}"
        )
    if peak_div < min_div:
        return (
            f"SWA slots never diverged from full slots: peak swa_full_idx_divergence={peak_div} "
            f"< {min_div} {where}"
        )
    if require_lag and not last.verify_swa < last.verify_full:
        return (
            f"no verify lag: verify_swa={last.verify_swa} is not < verify_full="
            f"{last.verify_full} on the last sample {where}"
        )
    return ""
