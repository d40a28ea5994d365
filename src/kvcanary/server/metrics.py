"""The server's Prometheus registry: the canary's collector plus engine gauges/counters.

Every collector here reads engine state, so the registry is only ever rendered inside the
engine loop's thread (``EngineLoop.call``), never concurrently with a step::

    kvcanary_engine_running_requests        requests admitted and not finished
    kvcanary_engine_waiting_requests        requests queued for admission
    kvcanary_engine_prompt_tokens           prompt tokens of finished requests
    kvcanary_engine_generated_tokens        output tokens of finished requests
    kvcanary_engine_steps                   engine steps (forwards) run by the server
    kvcanary_engine_requests_finished{finish_reason}
    kvcanary_engine_leaked_kv_slots{pool}  KV slots abort mode reclaimed that nothing referenced
                                            (a suspected leak: KVManager.quarantine)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcanary.canary.report.metrics import CanaryCollector
from kvcanary.server.engine_loop import EngineLoop


class EngineCollector(Collector):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        running, waiting = self.loop.engine.queue_lengths()
        st = self.loop.stats
        yield GaugeMetricFamily("kvcanary_engine_running_requests", "Requests admitted and not finished",
                                value=running)  # fmt: skip
        yield GaugeMetricFamily("kvcanary_engine_waiting_requests", "Requests queued for admission",
                                value=waiting)  # fmt: skip
        yield CounterMetricFamily("kvcanary_engine_prompt_tokens", "Prompt tokens of finished requests",
                                  value=st.num_prompt_tokens)  # fmt: skip
        yield CounterMetricFamily("kvcanary_engine_generated_tokens", "Output tokens of finished requests",
                                  value=st.num_generated_tokens)  # fmt: skip
        yield CounterMetricFamily("kvcanary_engine_steps", "Engine steps run by the server",
                                  value=st.num_steps)  # fmt: skip
        finished = CounterMetricFamily("kvcanary_engine_requests_finished", "Finished requests by reason",
                                       labels=["finish_reason"])  # fmt: skip
        for reason, n in sorted(st.num_finished_by_reason.items()):
            finished.add_metric([reason], n)
        yield finished
        kv = self.loop.engine.stats
        leaked = CounterMetricFamily("kvcanary_engine_leaked_kv_slots",
                                     "KV slots abort mode reclaimed that nothing referenced (suspected leak)",
                                     labels=["pool"])  # fmt: skip
        leaked.add_metric(["full"], kv.num_leaked_full_slots)
        leaked.add_metric(["swa"], kv.num_leaked_swa_slots)
        yield leaked


def make_server_registry(loop: EngineLoop) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CanaryCollector(loop.engine.canary, draft=loop.engine.draft_canary))
    registry.register(EngineCollector(loop))
    return registry
