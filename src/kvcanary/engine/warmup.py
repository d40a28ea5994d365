"""Compile ahead: every numba kernel a configuration's forwards call, before its first request.

Numba compiles a kernel at its first call (or loads it from the on-disk cache,
:mod:`kvcanary.jit.cache`). Left to itself that first call is inside the first request's
forward, where a cold compile costs a minute or more. :func:`warm_engine` moves it ahead:
it builds a throwaway engine from the caller's configuration (the same model, pool kinds,
page size, canary modes) with small pools and runs a tiny workload through it that takes
every path a real workload takes (chunked prefill in real-sized chunks, a prefix-cache hit, batched decode,
window eviction, a sampled request). Kernels whose serial or threaded variant is picked by
the work's size are compiled in both (:func:`kvcanary.jit.parallel.compiling_both`), so a
larger batch later finds its variant compiled too.

A compile shows on stderr as a progress bar that moves with every kernel numba compiles
(``compiling kernels (first run, cached afterwards): 12 kernel [00:11, rope._rope_w8]``);
with a warm cache nothing compiles and nothing is printed. Users: ``kvcanary run`` and
``kvcanary serve`` (before the first request is admitted), ``kvcanary warmup`` (on demand, e.g.
in a container build), and the vLLM connector's worker (:mod:`kvcanary.integrations.vllm`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from tqdm import tqdm

from kvcanary.canary.config import CanaryConfig
from kvcanary.config import EngineConfig, SamplingParams

log = logging.getLogger(__name__)

_LARGE_CHUNK = 256  # tokens: past every size threshold of the CPU kernels at any model width
COMPILE_DESC = "compiling kernels (first run, cached afterwards)"
_PACKAGE = "kvcanary."


class KernelCompile(NamedTuple):
    name: str  # module.qualname, module without the "kvcanary." prefix
    seconds: float  # wall time of the compile, its callees' compiles included


@dataclasses.dataclass
class CompileLog:
    """The kvcanary kernels numba compiled (not loaded from the cache) while it watched."""

    compiles: list[KernelCompile] = dataclasses.field(default_factory=list)
    helper_compiles: int = 0  # kernels a helper process compiled meanwhile (warm_engine)
    progress: bool = False
    desc: str = COMPILE_DESC
    _bar: tqdm[Any] | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def num_compiled(self) -> int:
        return len(self.compiles)

    @property
    def compile_s(self) -> float:
        return sum(c.seconds for c in self.compiles)

    def names(self) -> list[str]:
        return [c.name for c in self.compiles]

    def show(self, name: str, done: bool) -> None:
        """The bar (opened at the first compile): now compiling ``name``, or one more
        kernel ``done``."""
        if not self.progress:
            return
        with self._lock:
            if self._bar is None:
                self._bar = tqdm(desc=self.desc, unit="kernel", file=sys.stderr, dynamic_ncols=True)
            if done:
                self._bar.update(1)
            else:
                self._bar.set_postfix_str(name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1])

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


def _kernel_name(ev: Any) -> str | None:
    """``module.qualname`` of a compile event's function when it is kvcanary's own."""
    py_func = getattr(ev.data.get("dispatcher"), "py_func", None)
    module = getattr(py_func, "__module__", "") or ""
    if py_func is None or not module.startswith(_PACKAGE):
        return None
    return f"{module[len(_PACKAGE):]}.{py_func.__qualname__}"


@contextlib.contextmanager
def watch_compiles(progress: bool = False, desc: str = COMPILE_DESC,
                   on_first: Callable[[], None] | None = None) -> Iterator[CompileLog]:  # fmt: skip
    """Record every kvcanary kernel numba compiles inside the block (outermost compiles: a
    kernel's callees compile inside it and count with it). ``progress``: a bar on stderr,
    opened at the first compile, that counts the kernels and names the one compiling now.
    ``on_first``: called when the first kvcanary kernel starts compiling (a cold cache)."""
    from numba.core import event

    out = CompileLog(progress=progress, desc=desc)
    stack: list[tuple[str | None, float]] = []

    class _Listener(event.Listener):
        def on_start(self, ev: Any) -> None:
            nonlocal on_first
            name = _kernel_name(ev)
            stack.append((name, time.perf_counter()))
            if name is None:
                return
            if on_first is not None:
                first, on_first = on_first, None
                first()
            out.show(name, done=False)

        def on_end(self, ev: Any) -> None:
            name, t0 = stack.pop()
            if stack or name is None:
                return
            out.compiles.append(KernelCompile(name, time.perf_counter() - t0))
            out.show(name, done=True)

    try:
        with event.install_listener("numba:compile", _Listener()):
            yield out
    finally:
        out.close()


def loaded_kernels() -> set[tuple[str, Any]]:
    """Every (kvcanary kernel ``module.qualname``, signature) this process has compiled or
    loaded from the cache. (A compile event misses a cache load; tests compare these sets
    before and after a workload to prove a warm-up missed no kernel, warm cache or not.)"""
    from numba.core.dispatcher import Dispatcher

    out: set[tuple[str, Any]] = set()
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(_PACKAGE):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, Dispatcher):
                name = f"{obj.py_func.__module__}.{obj.py_func.__qualname__}"
                out.update((name, sig) for sig in obj.overloads)
    return out


def eager_canary(canary: CanaryConfig) -> CanaryConfig:
    """``canary`` with its periodic passes (sweep, SWA divergence) due every step, so a
    short warm-up runs (and compiles) them too."""
    if not canary.enabled:
        return canary
    return dataclasses.replace(
        canary,
        sweep_interval=1 if canary.sweep_interval > 0 else canary.sweep_interval,
        swa_divergence_interval=(
            1 if canary.swa_divergence_interval > 0 else canary.swa_divergence_interval
        ),
    )


class WarmupReport(NamedTuple):
    wall_s: float  # the whole warm-up: engine build, forwards, compiles
    compiles: CompileLog
    skipped: str | None  # why nothing ran (the configuration cannot take the tiny workload)


def warmup_config(config: EngineConfig) -> tuple[EngineConfig, int, int]:
    """(the throwaway engine's config, prompt length, new tokens a request) for ``config``:
    its model, page size, pool kinds and canary modes, with pools sized for the tiny
    workload, chunks of a few pages (so a prompt takes several), and the canary's periodic
    passes due every step."""
    from kvcanary.model.loader import load_model_config

    mc = load_model_config(config.model)
    page = config.page_size
    window = max((mc.window_of(i) or 0 for i in mc.swa_layer_ids), default=0)
    # Chunks as large as a real prefill's (up to _LARGE_CHUNK tokens): a kernel picked by the
    # input's size (norm_cpu past _MAX_ELEMENTS without threads: the torch norm, then rope
    # on a contiguous input) takes the large path too.
    chunk = config.chunked_prefill_size
    if chunk > 0:
        chunk = min(chunk, max(4 * page, _LARGE_CHUNK))
    limit = config.max_context_len or mc.max_position_embeddings
    # Longer than the window plus a page (window eviction in prefill and decode), two chunks
    # at least, within the context length.
    new_tokens = max(2 * page + 1, 4)
    prompt_len = max(window + 2 * page + 3, max(chunk, page) + page + 1)
    prompt_len = max(2, min(prompt_len, limit - new_tokens))
    per_request = prompt_len + new_tokens + 2 * page
    num_full = 4 * per_request
    ratio = config.swa_full_tokens_ratio
    if window and ratio > 0:
        num_full = max(num_full, int(4 * (window + max(chunk, page) + 3 * page) / ratio) + page)
    canary = eager_canary(config.canary)
    warm = dataclasses.replace(
        config,
        max_total_tokens=min(config.max_total_tokens, num_full)
        if config.max_total_tokens > 0
        else num_full,
        max_running_requests=min(config.max_running_requests, 4),
        chunked_prefill_size=chunk,
        canary=canary,
    )
    return warm, prompt_len, new_tokens


@contextlib.contextmanager
def sharing_compiles(lock_dir: str) -> Iterator[None]:
    """Inside the block, this process compiles a cached kvcanary kernel (for a signature it
    does not hold yet) only under an exclusive file lock named by the kernel and signature in
    ``lock_dir``: when another process sharing ``lock_dir`` (the warm-up's helper) is
    compiling the same, this one waits for it and then loads its result from numba's on-disk
    cache instead of compiling it a second time. Locks are taken caller before callee along
    an acyclic call graph, so two processes never wait on each other; a wait gives up after
    :data:`_SHARE_WAIT_S` and compiles anyway."""
    import fcntl

    from numba.core import sigutils
    from numba.core.caching import FunctionCache
    from numba.core.dispatcher import Dispatcher

    original = Dispatcher.compile

    def compile(self: Any, sig: Any) -> Any:
        py_func = getattr(self, "py_func", None)
        module = getattr(py_func, "__module__", "") or ""
        if py_func is None or not module.startswith(_PACKAGE) or not isinstance(self._cache, FunctionCache):
            return original(self, sig)
        args, _ = sigutils.normalize_signature(sig)  # type: ignore[no-untyped-call]
        if tuple(args) in self.overloads:
            return original(self, sig)
        with open(os.path.join(lock_dir, share_lock_name(py_func, tuple(args))), "a+b") as f:
            deadline = time.monotonic() + _SHARE_WAIT_S
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return original(self, sig)
                    time.sleep(0.02)
            try:
                return original(self, sig)  # a load when the other process compiled it
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    Dispatcher.compile = compile  # type: ignore[method-assign]
    try:
        yield
    finally:
        Dispatcher.compile = original  # type: ignore[method-assign]


_SHARE_WAIT_S = 600.0


def share_lock_name(py_func: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """The lock file, in :func:`sharing_compiles`'s directory, of one kernel and signature."""
    name = f"{py_func.__module__}.{py_func.__qualname__}{args}"
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def warm_engine(config: EngineConfig, progress: bool = True, helper: bool = True,
                lock_dir: str | None = None) -> WarmupReport:  # fmt: skip
    """Compile (or load from the cache) every kernel ``config``'s engine calls, by running a
    tiny workload through a throwaway engine built from it (module doc). Never fails the
    caller for the workload's sake: a configuration whose pools cannot take it is reported in
    ``skipped`` (its kernels then compile at first use, as without a warm-up).

    ``helper``: at the first compile (a cold cache), on a machine with two cores or more and
    with the canary on, a second process warms the same configuration without the canary
    (the model's kernels) into the shared on-disk cache while this one compiles the canary's
    first; this one then loads most of the model's kernels instead of compiling them. The
    helper is stopped when this warm-up ends (everything it would still add is loaded).
    The two share their compiles (:func:`sharing_compiles`): a kernel one of them is
    compiling, the other waits for and loads. ``lock_dir``: the helper's side of that."""
    from kvcanary import envs
    from kvcanary.engine.engine import Engine
    from kvcanary.engine.errors import KVPoolTooSmallError
    from kvcanary.jit import parallel as numba_parallel

    t0 = time.perf_counter()
    warm, prompt_len, new_tokens = warmup_config(config)
    envs.KVCANARY_WARMUP_HELPER.get()  # a bad value fails here, not mid-compile
    helpers: list[_Helper] = []
    use_helper = (helper and warm.canary.enabled and len(os.sched_getaffinity(0)) > 1
                  and envs.KVCANARY_WARMUP_HELPER.get() == "auto")  # fmt: skip
    scope = contextlib.ExitStack()
    if use_helper:
        lock_dir = scope.enter_context(tempfile.TemporaryDirectory(prefix="kvcanary-compile-"))
    if lock_dir is not None:
        scope.enter_context(sharing_compiles(lock_dir))

    def start_helper() -> None:
        if use_helper and lock_dir is not None:
            no_canary = dataclasses.replace(config, canary=CanaryConfig())
            helpers.append(_Helper(no_canary, lock_dir, compiles))

    compiles: CompileLog
    try:
        with scope, watch_compiles(progress, on_first=start_helper) as compiles, \
                numba_parallel.compiling_both():  # fmt: skip
            try:
                engine = Engine(warm)
            except (ValueError, KVPoolTooSmallError) as exc:
                return WarmupReport(time.perf_counter() - t0, compiles, f"{exc}")
            vocab = engine.runner.vocab_size
            prefix = [(7 * i + 3) % vocab for i in range(prompt_len)]
            prompts = [prefix[:-1] + [(prefix[-1] + k) % vocab] for k in range(3)]
            greedy = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
            sampled = dataclasses.replace(greedy, temperature=0.8, top_k=8, top_p=0.9, seed=1)
            try:
                engine.generate(prompts[:1], greedy)  # prefill in chunks, decode at batch 1
                engine.generate(prompts[1:], [greedy, sampled])  # prefix hits, batched decode
            except (ValueError, KVPoolTooSmallError) as exc:
                return WarmupReport(time.perf_counter() - t0, compiles, f"{exc}")
    finally:
        for h in helpers:
            h.stop()
    report = WarmupReport(time.perf_counter() - t0, compiles, None)
    if compiles.num_compiled:
        log.info("compiled %d kernels in %.1f s (cached for later runs)",
                 compiles.num_compiled, compiles.compile_s)  # fmt: skip
    return report


class _Helper:
    """A ``python -m kvcanary.engine.warmup`` process warming ``config`` (sent pickled on stdin,
    with the ``lock_dir`` of :func:`sharing_compiles`); it prints each kernel it compiled,
    shown on ``log``'s bar and counted in it."""

    def __init__(self, config: EngineConfig, lock_dir: str, log: CompileLog) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvcanary.engine.warmup"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(pickle.dumps((config, lock_dir)))
        self.proc.stdin.close()
        self.log = log
        self.reader = threading.Thread(target=self._read, name="kvcanary-warmup-helper", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, name = line.decode(errors="replace").strip().partition(" ")
            if kind in ("start", "done") and name:
                if kind == "done":
                    self.log.helper_compiles += 1
                self.log.show(name, done=kind == "done")

    def stop(self) -> None:
        """Kill it if still running: numba writes each cache file whole (a temp file, then
        a rename), so a killed helper leaves no partial entry."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.reader.join(timeout=5)


@contextlib.contextmanager
def print_compiles() -> Iterator[None]:
    """Print ``start <kernel>`` / ``done <kernel>`` on stdout as kvcanary kernels compile
    inside the block (outermost compiles): a helper's report to :class:`_Helper`."""
    from numba.core import event

    depth = [0]

    class _Printer(event.Listener):
        def on_start(self, ev: Any) -> None:
            depth[0] += 1
            name = _kernel_name(ev)
            if depth[0] == 1 and name is not None:
                print("start", name, flush=True)

        def on_end(self, ev: Any) -> None:
            depth[0] -= 1
            name = _kernel_name(ev)
            if depth[0] == 0 and name is not None:
                print("done", name, flush=True)

    with event.install_listener("numba:compile", _Printer()):
        yield


def _helper_main() -> None:
    """``python -m kvcanary.engine.warmup``: warm the pickled (EngineConfig, lock dir) read from
    stdin, reporting its compiles (:func:`print_compiles`)."""
    config, lock_dir = pickle.loads(sys.stdin.buffer.read())
    with print_compiles():
        warm_engine(config, progress=False, helper=False, lock_dir=lock_dir)


if __name__ == "__main__":
    _helper_main()
