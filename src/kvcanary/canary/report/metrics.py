"""Prometheus metrics of a canary, read from its own counters at scrape time.

One collector per canary; a server registers it in its registry, ``kvcanary run
--metrics-file OUT`` writes the text exposition once at the end. Names (counters get
``_total`` in the exposition)::

    kvcanary_canary_enabled                        1 when a canary is installed
    kvcanary_violations{launch_tag,fail_reason}    reported violation rows, per reason bit
    kvcanary_violations_recorded                   rows recorded (including past the ring)
    kvcanary_protected_tokens                      verify entries + records written
    kvcanary_verify_entries{launch_tag}            verify entries per launch tag
    kvcanary_sweep_passes                          completed radix sweeps
    kvcanary_swa_divergence{signal}                peak swa_full_idx_divergence / swa_out_of_window_tokens
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcanary.utils import write_file_atomically

SWA_SIGNALS = ("swa_full_idx_divergence", "swa_out_of_window_tokens")


class CanaryCollector(Collector):
    def __init__(self, canary: Any | None):
        self.canary = canary

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvcanary_canary_enabled", "1 when a KV canary is installed", value=int(self.canary is not None)
        )
        if self.canary is None:
            return
        st = self.canary.stats()
        by_tag_reason = Counter(
            (row.launch_tag, reason) for row in self.canary.reporter.rows for reason in row.fail_reasons
        )
        violations = CounterMetricFamily(
            "kvcanary_violations", "Reported canary violation rows by launch tag and fail reason",
            labels=["launch_tag", "fail_reason"],
        )  # fmt: skip
        for (tag, reason), n in sorted(by_tag_reason.items()):
            violations.add_metric([tag, reason], n)
        yield violations
        yield CounterMetricFamily(
            "kvcanary_violations_recorded", "Violation rows recorded, including any past the ring capacity",
            value=st["violations"],
        )  # fmt: skip
        yield CounterMetricFamily(
            "kvcanary_protected_tokens", "Canary verify entries plus records written", value=st["protected_tokens"]
        )
        verify = CounterMetricFamily(
            "kvcanary_verify_entries", "Canary verify entries by launch tag", labels=["launch_tag"]
        )
        for tag, n in sorted(st["verify_entries_by_tag"].items()):
            verify.add_metric([tag], n)
        yield verify
        yield CounterMetricFamily("kvcanary_sweep_passes", "Completed radix sweeps", value=st["sweep_passes"])
        divergence = GaugeMetricFamily(
            "kvcanary_swa_divergence", "Peak SWA divergence signals (0 when the reporter is off)",
            labels=["signal"],
        )  # fmt: skip
        for signal in SWA_SIGNALS:
            divergence.add_metric([signal], st["swa_divergence"].get(signal, 0))
        yield divergence


def make_registry(canary: Any | None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(CanaryCollector(canary))
    return registry


def write_metrics_file(canary: Any | None, path: str | Path) -> None:
    """Write the text exposition (temp file + rename)."""
    write_file_atomically(path, generate_latest(make_registry(canary)), flag="--metrics-file")
