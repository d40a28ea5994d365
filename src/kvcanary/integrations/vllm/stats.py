"""The canary's counters on vLLM's own ``/metrics``, through vLLM's KV connector stats.

vLLM 0.32 carries a connector's counters from its workers to the process that serves
``/metrics`` (the API server; with the default multiprocess engine the canary runs in
another process, whose own ``prometheus_client`` registry no scrape reads)::

    worker      KVCanaryConnector.get_kv_connector_stats()   after each step's wait_for_save
                    StatsCursor.take: the counts since the last report (KVCanaryStats),
                    or None (nothing to send this step)
                tensor-parallel workers: vLLM sums them (KVOutputAggregator, .aggregate)
    engine core Scheduler.make_stats -> SchedulerStats.kv_connector_stats (a plain dict)
    API server  PrometheusStatLogger.record -> KVCanaryPromMetrics.observe: counters += counts
                LoggingStatLogger -> "KV Transfer metrics: ..." (KVCanaryStats.reduce)

The same path serves a single-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and
``PROMETHEUS_MULTIPROC_DIR`` (the API server's counters are then multiprocess values). It
runs while vLLM logs stats (``vllm serve``'s default; ``--disable-log-stats`` and an
offline ``LLM`` turn it off).

Data (counts since the last report; ``launch_tag`` / ``fail_reason`` as in the log lines)::

    steps                int                 canary steps (forwards checked)
    protected_tokens     int                 verify entries + records written
    verify_entries       {launch_tag: int}
    violations_recorded  int                 violation rows recorded (ring), reported or not
    violations           {launch_tag: {fail_reason: int}}   reported rows, per reason bit
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from kvcanary.integrations.vllm.worker import VllmCanaryWorker

SCALARS = ("steps", "protected_tokens", "violations_recorded")
REPORT_EVERY_S = 1.0  # at most this long between two reports while steps run


def _empty() -> dict[str, Any]:
    return {"steps": 0, "protected_tokens": 0, "verify_entries": {}, "violations_recorded": 0,
            "violations": {}}  # fmt: skip


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key in SCALARS:
        into[key] += other.get(key, 0)
    for tag, n in other.get("verify_entries", {}).items():
        into["verify_entries"][tag] = into["verify_entries"].get(tag, 0) + n
    for tag, reasons in other.get("violations", {}).items():
        mine = into["violations"].setdefault(tag, {})
        for reason, n in reasons.items():
            mine[reason] = mine.get(reason, 0) + n


@dataclass
class KVCanaryStats(KVConnectorStats):
    """The canary's counts since the last report (module doc: the keys of ``data``)."""

    data: dict[str, Any] = field(default_factory=dict)  # (vLLM's field, typed for mypy)

    def __post_init__(self) -> None:
        self.data = {**_empty(), **self.data}

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        _add(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {"kv_canary_steps": self.data["steps"],
                "protected_tokens": self.data["protected_tokens"],
                "violations": self.data["violations_recorded"]}  # fmt: skip

    def is_empty(self) -> bool:
        d = self.data
        return not (any(d[k] for k in SCALARS) or d["verify_entries"] or d["violations"])


class StatsCursor:
    """What a :class:`VllmCanaryWorker` counted since the last :meth:`take`.

    A report goes out in the step a violation row is reported, and otherwise once
    ``interval`` steps or :data:`REPORT_EVERY_S` seconds passed since the last one; between
    them :meth:`take` costs a clock read and the row counts (the counters are host reads
    of the canary's tensors)."""

    def __init__(self, interval: int):
        self.interval = max(1, interval)
        self._last = _empty()
        self._last_steps = 0
        self._last_s = time.monotonic()
        self._rows_seen: list[int] = []  # per group: reported rows already counted

    def take(self, worker: VllmCanaryWorker) -> KVCanaryStats | None:
        num_rows = [len(m.reporter.rows) for m in worker.managers]
        if (num_rows == self._rows_seen
                and worker.num_steps - self._last_steps < self.interval
                and time.monotonic() - self._last_s < REPORT_EVERY_S):  # fmt: skip
            return None
        now = _empty()
        now["steps"] = worker.num_steps
        for manager in worker.managers:
            st = manager.stats()
            now["protected_tokens"] += st["protected_tokens"]
            now["violations_recorded"] += st["violations"]
            _add(now, {"verify_entries": st["verify_entries_by_tag"]})
        delta = {k: now[k] - self._last[k] for k in SCALARS}
        delta["verify_entries"] = {t: n - self._last["verify_entries"].get(t, 0)
                                   for t, n in now["verify_entries"].items()
                                   if n != self._last["verify_entries"].get(t, 0)}  # fmt: skip
        violations: dict[str, dict[str, int]] = {}
        seen = self._rows_seen + [0] * (len(num_rows) - len(self._rows_seen))
        for manager, start in zip(worker.managers, seen, strict=True):
            for row in manager.reporter.rows[start:]:
                for reason in row.fail_reasons:
                    tag = violations.setdefault(row.launch_tag, {})
                    tag[reason] = tag.get(reason, 0) + 1
        delta["violations"] = violations
        self._last, self._last_steps, self._last_s = now, worker.num_steps, time.monotonic()
        self._rows_seen = num_rows
        stats = KVCanaryStats(data=delta)
        return None if stats.is_empty() else stats


class KVCanaryPromMetrics(KVConnectorPromMetrics):
    """The canary's counters among vLLM's ``vllm:*`` metrics (labels ``model_name``,
    ``engine``; the exposition adds ``_total``). Same meaning as the ``kvcanary_*`` names of
    ``summary_path``'s ``.prom`` file, counted since the API server started."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls
        self.steps = counter(name="vllm:kvcanary_steps", labelnames=labelnames,
                             documentation="Steps the KV canary checked")  # fmt: skip
        self.protected_tokens = counter(
            name="vllm:kvcanary_protected_tokens", labelnames=labelnames,
            documentation="KV canary verify entries plus records written",
        )  # fmt: skip
        self.verify_entries = counter(
            name="vllm:kvcanary_verify_entries", labelnames=[*labelnames, "launch_tag"],
            documentation="KV canary verify entries by launch tag",
        )  # fmt: skip
        self.violations_recorded = counter(
            name="vllm:kvcanary_violations_recorded", labelnames=labelnames,
            documentation="KV canary violation rows recorded, including any past the ring capacity",
        )  # fmt: skip
        self.violations = counter(
            name="vllm:kvcanary_violations", labelnames=[*labelnames, "launch_tag", "fail_reason"],
            documentation="Reported KV canary violation rows by launch tag and fail reason",
        )  # fmt: skip
        for labels in per_engine_labelvalues.values():  # present (0) before any report
            for metric in (self.steps, self.protected_tokens, self.violations_recorded):
                metric.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        data = KVCanaryStats(data=dict(transfer_stats_data)).data
        self.steps.labels(*labels).inc(data["steps"])
        self.protected_tokens.labels(*labels).inc(data["protected_tokens"])
        self.violations_recorded.labels(*labels).inc(data["violations_recorded"])
        for tag, n in data["verify_entries"].items():
            self.verify_entries.labels(*labels, tag).inc(n)
        for tag, reasons in data["violations"].items():
            for reason, n in reasons.items():
                self.violations.labels(*labels, tag, reason).inc(n)
