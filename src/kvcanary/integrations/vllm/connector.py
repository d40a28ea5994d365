"""``KVCanaryConnector``: the KV-cache canary as a vLLM (v1) KV connector.

Select it with ``kv_transfer_config={"kv_connector": "KVCanaryConnector", "kv_role":
"kv_both", "kv_connector_extra_config": {...}}`` (the ``vllm.general_plugins`` entry point
registers the name; without the plugin add ``"kv_connector_module_path":
"kvcanary.integrations.vllm.connector"``). Options: :mod:`.options`; docs/VLLM.md.

Where each canary call runs (vLLM 0.32, one step)::

    scheduler: build_connector_meta(scheduler_output)
        -> StepMeta: per scheduled request its computed / scheduled counts, the token ids
           the worker has not seen yet, and the slot of its first new token per group
    worker:    bind_connector_metadata(meta)           tokens into the worker's mirror, then
                                                       HEAD verify / write, every group
                                                       (vLLM binds inside the forward
                                                       context: its attention metadata)
               [the forward: every layer stores its K/V and reads the cache; no layer
                calls the connector: has_connector_metadata() is False once HEAD ran]
               wait_for_save()                         TAIL verify / write (real KV), reports
               get_block_ids_with_load_errors()        abort mode: the violating blocks

A host that binds outside the forward context gets HEAD at the first layer's
``wait_for_layer_load`` instead (after layer 0 stored its K/V: HEAD verifies records
only, so nothing it sees changes). A violation is reported in the step it is found,
before the sampled tokens leave the engine (``raise``: the step fails).

External loads. Beside a connector that loads KV (vLLM's ``MultiConnector``: an offload
tier, P/D disaggregation), a request may start on tokens no forward of this engine
computed. vLLM tells only the loading connector how many (``update_state_after_alloc``
gets 0 here), so the scheduler side infers them: ``get_num_new_matched_tokens`` receives
the local hit L (block-aligned), and a request scheduled with K > L computed tokens loaded
``[L, K)`` (a sync load, in this very step), or, allocated but left waiting
(``WAITING_FOR_REMOTE_KVS``), loads ``[L, num_computed_tokens)`` asynchronously. vLLM's
connectors carry no records, so the loaded slots are *sealed*: the worker writes their
records (HEAD before this step's HEAD, TAIL with the fingerprint of the loaded bytes
before this step's TAIL) when the load has completed, trusting the loader: a sync load in
its step, an async one in the step the request is first scheduled after it, up to the
first position of a block the loader reported failed (``invalid_block_ids``,
``failed_recving``, seen in ``update_connector_output``). An async load's slots are cleared
when it starts; a sync load's slots in blocks reported failed are cleared before the next
step: a failed block is never trusted, any later read of it is reported.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import types
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.forward_context import get_forward_context, is_forward_context_available

from kvcanary.integrations.vllm.meta import GroupSpec, StepMeta
from kvcanary.integrations.vllm.namespace import namespace, salt_of, salted
from kvcanary.integrations.vllm.options import parse_options, rank_summary_path
from kvcanary.integrations.vllm.stats import KVCanaryPromMetrics, KVCanaryStats, StatsCursor

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvcanary.integrations.vllm.warmup import WorkerWarmup
    from kvcanary.integrations.vllm.worker import VllmCanaryWorker

logger = logging.getLogger("kvcanary.canary")


class KVCanaryConnectorMetadata(KVConnectorMetadata):
    def __init__(self, step: StepMeta):
        self.step = step


@dataclass
class ExternalLoad:
    """An asynchronous load another connector runs: positions ``[start, end)`` into the
    request's blocks ``block_ids`` (per group, as allocated); ``failed_from``: the first
    position of a block the loader reported failed (``end`` while none)."""

    start: int
    end: int
    block_ids: tuple[list[int], ...]
    failed_from: int


def cpu_attn_isa(vllm_config: VllmConfig | None, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU attention picks for a group (it decides how the group's KV is
    laid out: vllm/v1/attention/backends/cpu_attn.py, ``_get_attn_isa``, given what its
    metadata builder gives it); "" off the CPU platform, "unknown" where it cannot be told
    (no config, or a vLLM without that function)."""
    if vllm_config is None:
        return "unknown"
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return ""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(vllm_config.model_config.dtype, block_size, head_size,
                                 vllm_config.cache_config.cache_dtype))  # fmt: skip
    except (ImportError, AttributeError, TypeError, NotImplementedError):
        return "unknown"


def group_specs(kv_cache_config: KVCacheConfig,
                vllm_config: VllmConfig | None = None) -> list[GroupSpec]:  # fmt: skip
    """The canary's view of vLLM's KV cache groups (attention groups only)."""
    specs = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size"):
            raise NotImplementedError(
                f"kv-canary (vLLM): KV cache group {i} is {type(spec).__name__}; the canary "
                "covers attention KV caches (full and sliding window) only"
            )
        window = getattr(spec, "sliding_window", None)
        if type(spec).__name__ not in ("SlidingWindowSpec",):
            window = None  # a full-attention spec may carry the model's window (non-HMA)
        block_size, head_size = int(spec.block_size), int(spec.head_size)
        specs.append(GroupSpec(i, tuple(group.layer_names), block_size,
                               int(spec.num_kv_heads), head_size,
                               None if window is None else int(window),
                               cpu_attn_isa(vllm_config, block_size, head_size)))  # fmt: skip
    return specs


def check_speculative(vllm_config: VllmConfig) -> None:
    """Refuse the speculative decoding the canary does not cover (docs/VLLM.md,
    "Speculative decoding"): only vLLM's n-gram proposer (``method`` "ngram": drafts are
    token ids, no forward of their own), with synchronous scheduling. A drafter model
    (``draft_model``, EAGLE, MTP, ...) runs forwards of its own into the KV cache, which
    the canary's per-step view does not model; under async scheduling the model runner
    corrects a request's computed count for rejected drafts after the scheduler planned the
    step (``correct_spec_decode_token_counts``), so the metadata's counts are not the
    forward's. One line, naming the option and what is allowed."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return
    method = getattr(spec, "method", None)
    if method != "ngram":
        raise NotImplementedError(
            f"kv-canary (vLLM): speculative_config method {method!r} is not covered; the "
            "canary covers speculative decoding with method 'ngram' only (drafters that "
            "run a model write KV the canary does not track)"
        )
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise NotImplementedError(
            "kv-canary (vLLM): speculative_config method 'ngram' with async_scheduling=True "
            "is not covered; use async_scheduling=False (vLLM's default for 'ngram')"
        )


class KVCanaryConnector(KVConnectorBase_V1, SupportsHMA):
    """The canary as a KV connector: it loads and saves nothing, it checks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):  # fmt: skip
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.options = parse_options(extra)
        check_speculative(vllm_config)
        self.specs = group_specs(kv_cache_config, vllm_config) if kv_cache_config is not None else []
        if self.options.canary.mode == "abort" and len(self.specs) > 1:
            # vllm/v1/core/sched/scheduler.py, Scheduler._handle_invalid_blocks: block-level
            # load errors raise RuntimeError when the model has several KV cache groups.
            raise NotImplementedError(
                "kv-canary (vLLM): mode 'abort' reports violating blocks through "
                "get_block_ids_with_load_errors, which vLLM 0.32 supports only for models "
                f"with one KV cache group (this one has {len(self.specs)}: sliding-window "
                "layers); use mode 'log' or 'raise'"
            )
        self.worker: VllmCanaryWorker | None = None
        # This worker's rank among the engine's workers (vLLM's global worker rank: the TP
        # rank without pipeline parallelism) and their number; set at register_kv_caches.
        self.rank, self.world_size = 0, 1
        self.summary_path = self.options.summary_path  # this rank's (rank_summary_path)
        self._num_written = 0  # violation rows in the last summary written
        self.warmup: WorkerWarmup | None = None  # the kernels' compile at start-up
        self._stats = StatsCursor(self.options.canary.stats_interval or 100)  # vLLM /metrics
        # The group whose slots identify a batch row's request (as VllmCanaryWorker's).
        self._key_group = next((s.index for s in self.specs if s.sliding_window is None), 0)
        self._first_layers = [s.layer_names[0] for s in self.specs]  # (their attn metadata)
        self._head_done = False
        # The scheduler side's KV cache manager and its key group's req_to_blocks (None:
        # not found), looked up once (_key_group_blocks)
        self._blocks_of: tuple[Any, Any] | None = None
        # Wall seconds spent in the canary's hooks (bench: where the time goes): worker
        # "bind" / "head" / "tail", scheduler "meta".
        self.seconds: defaultdict[str, float] = defaultdict(float)
        # Scheduler side: live requests and how many of their token ids were sent.
        self._requests: dict[str, Request] = {}
        # ... and the list of each one's token ids (vLLM's Request.all_token_ids: the same
        # list for the request's life, which vLLM appends to)
        self._known: dict[str, Any] = {}
        self._sent: dict[str, int] = {}
        self._finished: list[str] = []
        # Finished requests' token ids of positions sent as not known (async scheduling):
        # (request id, first position, token ids), for the next metadata.
        self._final: list[tuple[str, int, list[int]]] = []
        # Tenant isolation (.namespace): each live request's salt, made when first seen.
        self._salts: dict[str, int] | None = {} if self.options.tenant_isolation else None
        # External loads (module doc): the local hit each request's last lookup reported,
        # the requests allocated since the last step, the async loads in flight, the sync
        # loads sealed in the last two steps (meta number, [(start, end, block ids)]), the
        # slots (per group) the next step clears.
        self._lookups: dict[str, int] = {}
        self._allocated: list[Request] = []
        self._loads: dict[str, ExternalLoad] = {}
        self._sealed: list[tuple[int, list[tuple[int, int, tuple[list[int], ...]]]]] = []
        self._invalid: list[list[int]] = [[] for _ in self.specs]
        self._num_metas = 0
        self._partial_hits_warned = False
        self._token_check = self.options.canary.verify_tokens

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvcanary.integrations.vllm.warmup import warm_worker  # numba: see .meta
        from kvcanary.integrations.vllm.worker import VllmCanaryWorker

        # Compile every kernel the canary calls now, at worker start-up, not in the first
        # forward (numba's on-disk cache makes it a load after the first run).
        forward_ids = self._forward_input_ids() if self._token_check else None
        logger.info("kv-canary (vLLM): compiling the canary's kernels (first run, cached afterwards)")
        warm = warm_worker(self.options.canary, self.specs, kv_caches, forward_ids)
        logger.info(
            "kv-canary (vLLM): kernels ready in %.1f s (%d compiled in %.1f s, the rest from "
            "the cache)%s", warm.wall_s, warm.num_compiled, warm.compile_s,
            f"; warm-up skipped: {warm.skipped}" if warm.skipped else "",
        )  # fmt: skip
        self.warmup = warm
        self.worker = VllmCanaryWorker(self.options.canary, self.specs, kv_caches)
        self.worker.forward_input_ids = forward_ids
        parallel = self._vllm_config.parallel_config
        self.rank, self.world_size = int(parallel.rank), int(parallel.world_size)
        labels = None
        if self.world_size > 1:  # name the rank in reports, summary files and samples
            labels = {"rank": str(self.rank)}
            for manager in self.worker.managers:
                manager.reporter.context = f" rank={self.rank}"
            if self.options.summary_path:
                self.summary_path = rank_summary_path(self.options.summary_path, self.rank,
                                                      self.world_size)  # fmt: skip
        logger.info(
            "kv-canary (vLLM): installed%s on %d KV cache group(s) %s, %d blocks, config=%s",
            f" (rank {self.rank} of {self.world_size})" if self.world_size > 1 else "",
            len(self.specs),
            [(s.kind.name, s.block_size, s.sliding_window, len(s.layer_names)) for s in self.specs],
            self.worker.num_blocks, self.options.canary,
        )  # fmt: skip
        from prometheus_client import REGISTRY

        from kvcanary.canary.report.metrics import CanaryCollector
        from kvcanary.integrations.vllm.worker import MetricsView

        self._metrics = MetricsView(self.worker)
        self._metric_labels = labels
        collector = CanaryCollector(self._metrics, labels)
        try:  # this process's default registry (an in-process engine's /metrics)
            REGISTRY.register(collector)
            self._registered: Any = collector
        except ValueError:  # a previous engine of this process registered the same names
            self._registered = None

    def _forward_input_ids(self) -> torch.Tensor | None:
        """The buffer vLLM's model runner feeds its forward's input ids from, for the worker
        (``GPUModelRunner.input_ids``, a persistent buffer, filled before the step binds the
        connector's metadata; with async scheduling the previous step's sampled ids are
        copied into it on the device), so that every record carries the id the forward
        took, and the token check compares it with the scheduler's: a forward that took
        another id fails ``verify_token`` at the slot's next read. The connector API does
        not hand the buffer over: it is found on the call stack of ``register_kv_caches``
        (the model runner's ``initialize_kv_cache``). Not with tenant isolation (records
        carry salted token ids); not found (a warning says so): the records carry the
        scheduler's ids, and those of positions planned before their token is known (async
        scheduling) -1 until it arrives."""
        if self._salts is not None:
            return None
        frame: types.FrameType | None = sys._getframe(1)
        for _ in range(12):
            if frame is None:
                break
            runner = frame.f_locals.get("self")
            buf = getattr(getattr(runner, "input_ids", None), "gpu", None)
            is_runner = hasattr(runner, "execute_model")
            if is_runner and isinstance(buf, torch.Tensor) and buf.dim() == 1:
                return buf
            frame = frame.f_back
        logger.warning(
            "kv-canary (vLLM): the model runner's input ids were not found; the records "
            "carry the scheduler's token ids (the forward's own input is not checked)"
        )
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata, then HEAD: vLLM binds inside the step's forward context
        (``KVConnectorModelRunnerMixin._get_kv_connector_output``), so HEAD runs here,
        before the forward, on the context's attention metadata. Without a forward context
        or attention metadata (a step without a forward) HEAD waits for the first layer's
        ``wait_for_layer_load``."""
        super().bind_connector_metadata(connector_metadata)
        self._head_done = False
        if self.worker is not None and isinstance(connector_metadata, KVCanaryConnectorMetadata):
            t0 = time.perf_counter()
            self.worker.on_meta(connector_metadata.step)
            self.seconds["bind"] += time.perf_counter() - t0
            if is_forward_context_available():
                attn = get_forward_context().attn_metadata
                if attn is not None:
                    self._head(attn)

    def has_connector_metadata(self) -> bool:
        """vLLM's attention layers ask this before each layer's ``wait_for_layer_load`` /
        ``save_kv_layer`` (``maybe_transfer_kv_layer``; nothing else in vLLM reads it): True
        until HEAD ran in this step, so once bind ran HEAD no layer calls the connector."""
        return not self._head_done and self._connector_metadata is not None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # nothing to load (on CPU vLLM calls this after the forward)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._head_done or self.worker is None:
            return
        self._head(get_forward_context().attn_metadata)  # (bind ran no HEAD)

    def _head(self, attn: Any) -> None:
        """HEAD of the step whose forward context holds ``attn`` (its attention metadata)."""
        assert self.worker is not None
        self._head_done = True
        if isinstance(attn, list):  # speculative decoding: [0] is the target model's
            attn = attn[0]
        if isinstance(attn, dict):  # (map: no comprehension's frame)
            metadata = list(map(attn.__getitem__, self._first_layers))
        else:
            metadata = [attn] * len(self.specs)
        t0 = time.perf_counter()
        self.worker.before_forward(metadata)
        self.seconds["head"] += time.perf_counter() - t0

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return None  # TAIL runs once every layer stored its K/V: wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None or not self._head_done:
            return
        self._head_done = False
        try:
            t0 = time.perf_counter()
            self.worker.after_forward()
            self.seconds["tail"] += time.perf_counter() - t0
        finally:
            if self.summary_path and self._summary_due():
                self.write_summary()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.worker is None else self.worker.take_invalid_blocks()

    def get_kv_connector_stats(self) -> KVCanaryStats | None:
        """The canary's counts since the last report, on their way to vLLM's ``/metrics``
        (:mod:`.stats`)."""
        return None if self.worker is None else self._stats.take(self.worker)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVCanaryStats:
        return KVCanaryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVCanaryPromMetrics:  # fmt: skip
        return KVCanaryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.flush()
            if self.summary_path:
                self.write_summary()
            if getattr(self, "_registered", None) is not None:
                from prometheus_client import REGISTRY

                REGISTRY.unregister(self._registered)
                self._registered = None

    def summary(self) -> dict[str, Any]:
        """Counters and every reported violation row (JSON-ready)."""
        if self.worker is None:
            return {"installed": False}
        stats = self.worker.stats()
        return {
            "installed": True,
            "rank": self.rank,
            "world_size": self.world_size,
            "groups": [{"index": s.index, "kind": s.kind.name, "block_size": s.block_size,
                        "sliding_window": s.sliding_window, "layers": list(s.layer_names)}
                       for s in self.specs],  # fmt: skip
            "stats": stats,
            "violations": [row._asdict() for row in self.worker.violations],
        }

    def write_summary(self) -> None:
        """This rank's summary at :attr:`summary_path`, its Prometheus text at ``+ ".prom"``."""
        path = self.summary_path
        if not path:
            return
        self._num_written = self._num_reported()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.summary(), f, indent=1, default=str)
        os.replace(tmp, path)
        if self.worker is not None:  # the Prometheus text exposition beside it
            from kvcanary.canary.report.metrics import write_metrics_file

            write_metrics_file(self._metrics, f"{path}.prom", self._metric_labels)

    def _summary_due(self) -> bool:
        """Every ``stats_interval`` steps (100 when 0), and in a step whose violation rows
        at least double those the file holds (the first row at once): vLLM's multiprocess
        shutdown may kill a worker before its shutdown hook writes (at once under ``vllm
        serve``'s default ``--shutdown-timeout 0``, after 5 s for an offline ``LLM``'s
        engine core). (Doubling, not every new row: a fault read every step would rewrite
        the whole, growing, file every step.)"""
        if self.worker is None:
            return False
        interval = max(1, self.options.canary.stats_interval or 100)
        reported = self._num_reported()
        return self.worker.num_steps % interval == 0 or reported >= max(1, 2 * self._num_written)

    def _num_reported(self) -> int:
        """Violation rows reported so far (every group)."""
        return 0 if self.worker is None else sum(len(m.reporter.rows) for m in self.worker.managers)

    # ================================================================ scheduler side
    def on_new_request(self, request: Request) -> None:
        self._track(request, replace=True)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:  # fmt: skip
        self._track(request)
        self._lookups[request.request_id] = num_computed_tokens  # the local hit (block-aligned)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:  # fmt: skip
        # (num_external_tokens: 0 here under MultiConnector, which tells only the connector
        # that loads; the loads are inferred in build_connector_meta, module doc)
        self._track(request)
        self._allocated.append(request)

    def _track(self, request: Request, replace: bool = False) -> None:
        """Request ``request`` is live (``replace``: it replaces one of the same id)."""
        rid = request.request_id
        if replace or rid not in self._requests:
            self._requests[rid] = request
            known = request.all_token_ids  # (vLLM's ConstantList: read its list, `_x`)
            self._known[rid] = getattr(known, "_x", known)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Loads that failed (module doc): a sync load sealed in the last two steps has its
        slots in reported blocks cleared in the next step; an async load in flight is
        sealed only up to its first position in a reported block (a request whose whole
        load failed: nothing)."""
        invalid_ids = connector_output.invalid_block_ids
        failed_ids = getattr(connector_output, "failed_recving", None)
        if not invalid_ids and not failed_ids:  # the usual step
            return
        invalid, failed = set(invalid_ids or ()), set(failed_ids or ())
        if invalid:
            for _, seals in self._sealed:
                for start, end, block_ids in seals:
                    self._clear(self._slots(block_ids, start, end, only=invalid))
        for rid, load in self._loads.items():
            if rid in failed:
                load.failed_from = load.start
                continue
            for g, spec in enumerate(self.specs):
                bs, ids = spec.block_size, load.block_ids[g]
                for i in range(load.start // bs, min(len(ids), -(-load.failed_from // bs))):
                    if ids[i] in invalid:
                        load.failed_from = max(load.start, min(load.failed_from, i * bs))
                        break

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        t0 = time.perf_counter()
        meta = self._build_meta(scheduler_output)
        self.seconds["meta"] += time.perf_counter() - t0
        return meta

    def _build_meta(self, scheduler_output: SchedulerOutput) -> KVCanaryConnectorMetadata:
        so = scheduler_output
        cached, new_reqs, scheduled = (so.scheduled_cached_reqs, so.scheduled_new_reqs,
                                       so.num_scheduled_tokens)  # fmt: skip
        # Each scheduled request and its num_computed_tokens: vLLM lists every scheduled
        # request once, in the cached requests or the new (or resumed) ones.
        req_ids, counts = [*cached.req_ids], cached.num_computed_tokens
        if new_reqs:  # requests seen for the first time (or resumed)
            for r in new_reqs:
                self._sent.pop(r.req_id, None)
                req_ids.append(r.req_id)
            counts = [*counts, *(r.num_computed_tokens for r in new_reqs)]
        if len(req_ids) != len(scheduled):  # one in neither list (not vLLM 0.32's scheduler)
            computed, requests = dict(zip(req_ids, counts, strict=False)), self._requests
            req_ids = list(scheduled)
            counts = [computed[rid] if rid in computed else
                      requests[rid].num_computed_tokens if rid in requests else 0
                      for rid in req_ids]  # fmt: skip
        finished = so.finished_req_ids
        step = StepMeta(req_ids=req_ids, finished=[*finished, *self._finished])
        if self._finished:
            self._finished = []
        if self._final:
            for rid, start, final in self._final:
                step.final(rid, start, final)
            self._final = []
        for rid in finished:
            self._sent.pop(rid, None)
        manager = self._kv_cache_manager
        blocks_of = self._blocks_of
        if blocks_of is None or blocks_of[0] is not manager:
            blocks_of = self._blocks_of = (manager, self._key_group_blocks(manager))
        req_blocks = blocks_of[1]
        g = self._key_group
        bs = self.specs[g].block_size if self.specs else 1
        sent, salts = self._sent, self._salts
        drafts_of = so.scheduled_spec_decode_tokens  # speculative decoding (ngram)
        # (StepMeta.add's work done here, its bound methods kept: a call per request costs
        # ~0.5 us)
        add_cols, add_tokens = step.cols.extend, step.tokens.extend
        get_known, get_sent = self._known.get, sent.get
        get_blocks = None if req_blocks is None else req_blocks.get
        for rid, k in zip(req_ids, counts, strict=True):
            num_scheduled = scheduled[rid]
            known = get_known(rid)  # (None: a request this side was not told of)
            end = k + num_scheduled
            start = get_sent(rid, 0)
            count = 0
            if known is not None and end > start:
                if end <= len(known) and salts is None:  # the usual step: committed ids
                    add_tokens(known[start:end])
                    count = end - start
                    sent[rid] = end
                else:
                    count = self._send_uncommitted(step, rid, known, start, end,
                                                   drafts_of.get(rid))  # fmt: skip
            slot = -1  # the key group's slot of position k (-1: none, the null block)
            i = k // bs
            if get_blocks is not None:  # without listing every block of every group
                blocks = get_blocks(rid, ())
                if i < len(blocks) and (b := blocks[i].block_id):
                    slot = b * bs + k % bs
            elif manager is not None and self.specs:
                block_ids = manager.get_block_ids(rid)[g]
                if i < len(block_ids) and (b := block_ids[i]):
                    slot = b * bs + k % bs
            add_cols((k, num_scheduled, start, count, slot))  # StepMeta's COL_* order
        step.pack()
        self._external_loads(so, step)
        return KVCanaryConnectorMetadata(step)

    def _send_uncommitted(self, step: StepMeta, rid: str, known: Any, start: int, end: int,
                          drafts: list[int] | None) -> int:  # fmt: skip
        """Sends the token ids of positions ``[start, end)`` of a step that goes beyond the
        request's committed token ids (:meth:`_uncommitted`) or whose ids are salted
        (tenant isolation, :mod:`.namespace`); returns how many."""
        have = len(known)
        mine = list(known[start:end])
        if end > have:  # beyond the request's committed token ids
            mine += self._uncommitted(drafts, max(start, have), end)
        self._sent[rid] = min(end, have)
        salts = self._salts
        if salts is not None:
            salt = salts.get(rid)
            if salt is None:
                salt = salts[rid] = salt_of(namespace(self._requests[rid]))
            mine = salted(mine, salt)
        step.tokens.extend(mine)
        return len(mine)

    @staticmethod
    def _uncommitted(drafts: list[int] | None, first: int, end: int) -> list[int]:
        """The token ids of positions ``[first, end)`` that the request has not committed:
        the draft tokens speculative decoding scheduled (``drafts``, the step's last
        ``len(drafts)`` positions), -1 for any other position (not known to the scheduler
        yet: async scheduling). A draft's record carries its token; an accepted draft's
        committed token, sent in a later step, is checked against it, and a rejected
        draft's position is computed again (its record rewritten) before any read."""
        if not drafts:
            return [-1] * (end - first)
        d0 = end - len(drafts)  # the first draft's position
        return [-1] * max(0, d0 - first) + list(drafts[max(0, first - d0) :])

    def _external_loads(self, so: SchedulerOutput, step: StepMeta) -> None:
        """The loads of this step (module doc): sync loads sealed, async loads that start
        (their slots cleared) or completed (sealed), the slots cleared before this step."""
        allocated, self._allocated = self._allocated, []
        self._num_metas += 1
        if self._sealed:
            self._sealed = [s for s in self._sealed if s[0] >= self._num_metas - 1]
        manager = self._kv_cache_manager
        if manager is None or not self.specs:
            return
        if not (allocated or self._loads or any(self._invalid)):  # the usual step: no load
            return
        scheduled = so.num_scheduled_tokens
        cached = so.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        computed.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs)
        if allocated and not self._partial_hits_off(manager):
            allocated = []
        sealed = []
        for request in allocated:
            rid = request.request_id
            local = self._lookups.pop(rid, None)
            if local is None or rid not in self._requests:
                continue
            if rid in scheduled:  # a sync load: in this very step
                k = computed.get(rid, request.num_computed_tokens)
                if k > local:
                    block_ids = manager.get_block_ids(rid)
                    step.seal(rid, local, k, self._slots(block_ids, local, k))
                    sealed.append((local, k, block_ids))
            elif (request.num_computed_tokens > local
                  and getattr(request.status, "name", "") == "WAITING_FOR_REMOTE_KVS"):  # fmt: skip
                end = request.num_computed_tokens
                block_ids = manager.get_block_ids(rid)
                self._loads[rid] = ExternalLoad(local, end, block_ids, end)
                self._clear(self._slots(block_ids, local, end))
        if sealed:
            self._sealed.append((self._num_metas, sealed))
        for rid in [r for r in self._loads if r in scheduled]:  # async loads that completed
            load = self._loads.pop(rid)
            end = min(load.failed_from, computed.get(rid, 0))
            if end > load.start:
                step.seal(rid, load.start, end, self._slots(load.block_ids, load.start, end))
        if any(self._invalid):
            step.invalid_slots, self._invalid = self._invalid, [[] for _ in self.specs]

    def _partial_hits_off(self, manager: Any) -> bool:
        """With vLLM's partial-block prefix hits a local hit may end inside a block, beyond
        the block-aligned hit the lookup reports: a load cannot be told from it, so no load
        is inferred (a warning, once)."""
        if not getattr(getattr(manager, "coordinator", None), "enable_partial_hash_hits", False):
            return True
        if not self._partial_hits_warned:
            self._partial_hits_warned = True
            logger.warning(
                "kv-canary (vLLM): partial-block prefix hits are on; KV loaded by another "
                "connector is not sealed, and reads of it are reported"
            )
        return False

    def _slots(self, block_ids: tuple[list[int], ...], start: int, end: int,
               only: set[int] | None = None) -> list[list[int]]:  # fmt: skip
        """Per group the slots of positions ``[start, end)`` in ``block_ids`` (-1: no block;
        ``only``: -1 too outside these block ids)."""
        out = []
        for spec, ids in zip(self.specs, block_ids, strict=True):
            bs, row = spec.block_size, []
            for p in range(start, end):
                b = ids[p // bs] if p // bs < len(ids) else 0
                row.append(b * bs + p % bs if b and (only is None or b in only) else -1)
            out.append(row)
        return out

    def _clear(self, slots: list[list[int]]) -> None:
        """Clear these slots' records (per group; -1 skipped) before the next step."""
        for mine, theirs in zip(self._invalid, slots, strict=True):
            mine.extend(s for s in theirs if s >= 0)

    def _key_group_blocks(self, manager: Any) -> Any:
        """The key group's ``req_to_blocks`` (request id -> its blocks) of vLLM's KV cache
        manager, where it has one (vLLM 0.32: ``coordinator.single_type_managers[g]``); None
        otherwise (``get_block_ids``, which lists every group's block ids, per request)."""
        if manager is None or not self.specs:
            return None
        try:
            blocks = manager.coordinator.single_type_managers[self._key_group].req_to_blocks
        except (AttributeError, IndexError, TypeError):
            return None
        return blocks if hasattr(blocks, "get") else None

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        self._forget(request)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        self._forget(request)
        return False, None

    def _forget(self, request: Request) -> None:
        rid = request.request_id
        start = self._sent.get(rid)
        if start is not None:  # positions it computed with the token not known yet
            known = request.all_token_ids
            end = min(request.num_computed_tokens, len(known))
            if end > start:
                tokens = list(known[start:end])
                salt = None if self._salts is None else self._salts.get(rid)
                self._final.append((rid, start, tokens if salt is None else salted(tokens, salt)))
        self._requests.pop(rid, None)
        self._known.pop(rid, None)
        self._sent.pop(rid, None)
        self._lookups.pop(rid, None)
        self._loads.pop(rid, None)
        if self._salts is not None:
            self._salts.pop(rid, None)
        self._finished.append(rid)
