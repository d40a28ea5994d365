"""Cross-implementation tests against SGLang's own canary code (``make test-sglang``).

These tests run only in ``.venv-sglang`` (CPU torch 2.13 + ``sglang==0.5.23`` installed with
``--no-deps``, see the Makefile); ``make test`` leaves this directory out with ``--ignore``.
Here they must run: a missing ``sglang`` is a hard error, never a skip.

The import shim (the only one; keep it minimal). Two imports must be neutralised before the
first ``import sglang``, on this CPU-only machine:

* **triton**: ``import sglang`` imports it (``sglang.srt.utils.common``), even for the pure
  torch canary references. Triton is not installed; we install a placeholder built from
  SGLang's *own* non-CUDA triton stub (``sglang/_platform_stubs.py``, which SGLang itself
  only installs on macOS): its meta-path finder mocks every ``triton.*`` submodule, and we set
  the few real attributes it sets (``__version__``: torch 2.13 reads it; ``cdiv``,
  ``next_power_of_2``, ``Config``, ``language.constexpr``, the autotuner exceptions torch's
  inductor imports). Nothing here ever launches a Triton kernel: off CUDA every SGLang canary
  launcher falls back to its torch reference (``sglang.kernels.ops.kv_canary._dispatch``).
* **torchvision**: the SGLang pools (``sglang.srt.mem_cache.memory_pool`` via
  ``sglang.srt.configs`` → ``sglang.srt.multimodal.internvl_utils``) import it at module level;
  the registry's torchvision is a CUDA build that fails at import, so it is not installed.
  transformers first records "torchvision not available" (so it never takes a torchvision
  code path), then ``torchvision.*`` resolves to placeholders of the same kind.

If a real triton / torchvision is importable, the shim leaves it alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_STUBS_NAME = "_kvcanary_sglang_platform_stubs"


def _load_sglang_platform_stubs() -> ModuleType:
    """``sglang/_platform_stubs.py`` loaded by path (stdlib only), without importing sglang."""
    spec = importlib.util.find_spec("sglang")  # a top-level find_spec runs no package code
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "tests/integrations/sglang needs sglang==0.5.23: run `make test-sglang` (it builds "
            ".venv-sglang); `make test` does not collect these tests"
        )
    path = Path(spec.submodule_search_locations[0]) / "_platform_stubs.py"
    stub_spec = importlib.util.spec_from_file_location(_STUBS_NAME, path)
    assert stub_spec is not None and stub_spec.loader is not None
    module = importlib.util.module_from_spec(stub_spec)
    sys.modules[_STUBS_NAME] = module  # its dataclasses look their module up
    stub_spec.loader.exec_module(module)
    return module


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``<root>`` and ``<root>.*`` imports to SGLang's ``_MockModule`` placeholders
    (every attribute a placeholder too; calling one is a pass-through decorator)."""

    def __init__(self, stubs: ModuleType, root: str) -> None:
        self._stubs, self._root = stubs, root

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != self._root and not fullname.startswith(self._root + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._stubs._MockModule(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        pass


def _install_triton_placeholder(stubs: ModuleType) -> None:
    sys.meta_path.insert(0, _PlaceholderFinder(stubs, "triton"))
    triton = importlib.import_module("triton")
    triton.__version__ = "3.0.0"  # what SGLang's stub reports
    triton.cdiv = stubs._cdiv
    triton.next_power_of_2 = stubs._next_power_of_2
    triton.Config = stubs._Config

    class constexpr:  # noqa: N801  (tl.constexpr: an annotation and a value wrapper)
        def __init__(self, value: object = None) -> None:
            self.value = value

    importlib.import_module("triton.language").constexpr = constexpr
    autotuner = importlib.import_module("triton.runtime.autotuner")
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {})
    autotuner.PTXASError = type("PTXASError", (Exception,), {})


def _install_torchvision_placeholder(stubs: ModuleType) -> None:
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()  # cached before the placeholder exists
    sys.meta_path.insert(0, _PlaceholderFinder(stubs, "torchvision"))


def _install_import_shim() -> None:
    stubs = _load_sglang_platform_stubs()
    if importlib.util.find_spec("triton") is None:
        _install_triton_placeholder(stubs)
    if importlib.util.find_spec("torchvision") is None:
        _install_torchvision_placeholder(stubs)


_install_import_shim()


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """How much was compared (the numbers the cross-implementation claim rests on)."""
    xref = sys.modules.get("sglang_xref")
    if xref is None:
        return
    s = xref.STATS
    terminalreporter.write_line(
        f"sglang xref: {s.scenarios} random scenarios, {s.forwards} forwards, {s.plans} plans, "
        f"{s.launches} verify/write launches compared against SGLang "
        f"({s.violation_rows} violation rows, {s.corruptions} injected faults)"
    )
