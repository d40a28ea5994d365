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

``labels``: constant labels on every sample (the vLLM connector's ``rank`` under tensor
parallelism: one collector per worker process, each with its own rank). ``draft``: the
canary of a speculative draft model (kvcanary's engine); with one, every sample but
``kvcanary_canary_enabled`` carries ``pool`` (``target`` | ``draft``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcanary.utils import write_file_atomically

SWA_SIGNALS = ("swa_full_idx_divergence", "swa_out_of_window_tokens")


class CanaryCollector(Collector):
    def __init__(self, canary: Any | None, labels: dict[str, str] | None = None, *,
                 draft: Any | None = None):  # fmt: skip
        self.canary = canary
        self.labels = dict(labels or {})
        self.draft = draft

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        members: list[tuple[tuple[str, ...], Any]] = [((), self.canary)]  # (pool label, canary)
        if self.canary is not None and self.draft is not None:
            names = [*names, "pool"]
            members = [(("target",), self.canary), (("draft",), self.draft)]

        def family(kind: type, name: str, doc: str, labels: tuple[str, ...],
                   rows: Sequence[tuple[tuple[str, ...], float]]) -> Metric:  # fmt: skip
            """One family with the constant labels (and ``pool``) first; ``rows``: (label
            values, value), the pool's values included."""
            out = kind(name, doc, labels=[*names, *labels])
            for label_values, v in rows:
                out.add_metric([*values, *label_values], v)
            return out

        enabled = GaugeMetricFamily("kvcanary_canary_enabled", "1 when a KV canary is installed",
                                    labels=list(self.labels))  # fmt: skip
        if self.canary is None:
            enabled.add_metric(values, 0)
            yield enabled
            return
        enabled.add_metric(values, 1)
        yield enabled
        stats = [(pool, c, c.stats()) for pool, c in members]
        by_tag_reason = [((*pool, tag, reason), n) for pool, c, _ in stats
                         for (tag, reason), n in sorted(Counter(
                             (row.launch_tag, reason) for row in c.reporter.rows
                             for reason in row.fail_reasons).items())]  # fmt: skip
        yield family(CounterMetricFamily, "kvcanary_violations",
                     "Reported canary violation rows by launch tag and fail reason",
                     ("launch_tag", "fail_reason"), by_tag_reason)  # fmt: skip
        yield family(CounterMetricFamily, "kvcanary_violations_recorded",
                     "Violation rows recorded, including any past the ring capacity", (),
                     [(pool, st["violations"]) for pool, _, st in stats])  # fmt: skip
        yield family(CounterMetricFamily, "kvcanary_protected_tokens",
                     "Canary verify entries plus records written", (),
                     [(pool, st["protected_tokens"]) for pool, _, st in stats])  # fmt: skip
        yield family(CounterMetricFamily, "kvcanary_verify_entries",
                     "Canary verify entries by launch tag", ("launch_tag",),
                     [((*pool, tag), n) for pool, _, st in stats
                      for tag, n in sorted(st["verify_entries_by_tag"].items())])  # fmt: skip
        yield family(CounterMetricFamily, "kvcanary_sweep_passes", "Completed radix sweeps", (),
                     [(pool, st["sweep_passes"]) for pool, _, st in stats])  # fmt: skip
        yield family(GaugeMetricFamily, "kvcanary_swa_divergence",
                     "Peak SWA divergence signals (0 when the reporter is off)", ("signal",),
                     [((*pool, signal), st["swa_divergence"].get(signal, 0))
                      for pool, _, st in stats for signal in SWA_SIGNALS])  # fmt: skip


def make_registry(canary: Any | None, labels: dict[str, str] | None = None, *,
                  draft: Any | None = None) -> CollectorRegistry:  # fmt: skip
    registry = CollectorRegistry()
    registry.register(CanaryCollector(canary, labels, draft=draft))
    return registry


def write_metrics_file(canary: Any | None, path: str | Path,
                       labels: dict[str, str] | None = None, *, draft: Any | None = None) -> None:  # fmt: skip
    """Write the text exposition (temp file + rename)."""
    write_file_atomically(path, generate_latest(make_registry(canary, labels, draft=draft)),
                          flag="--metrics-file")  # fmt: skip
