"""Boot half of :mod:`kvcanary.jit.cache` (no numba import here; ``import kvcanary`` must stay
light, and numba costs ~0.2 s to import).

Imported first thing by ``kvcanary/__init__.py``, so it runs before any other kvcanary module.
It does two things:

* takes the *source snapshot* of kvcanary: the digest of its sources as they are when the
  package starts being imported (:func:`snapshot`). Cached kernels are keyed by their
  modules' import closures as long as the package's digest still equals it; a later digest
  that differs means the sources changed while this process was importing them, so its
  in-memory code matches no single source state (see :mod:`kvcanary.jit.cache`);
* installs the locator before any kvcanary ``@numba.njit`` decorator runs: now if numba is
  already imported, else by a one-shot ``sys.meta_path`` hook right after numba's own
  ``__init__`` finishes, i.e. before ``import numba`` returns to the module that asked for it,
  hence before its decorators run. Numba builds a function's cache, and picks its locator,
  when the decorator runs (``Dispatcher.enable_caching``), not at the first call.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from kvcanary.jit.source_digest import PACKAGE_ROOT, snapshot

if TYPE_CHECKING:  # importlib.abc/machinery cost ~20 ms to import (importlib.resources)
    from importlib.machinery import ModuleSpec

def _install_now() -> None:
    try:
        # Installs on import (idempotent). If kvcanary.jit.cache is itself being imported
        # (it is what imported numba), this returns its partial module and it installs at
        # the end of its own body.
        import kvcanary.jit.cache  # noqa: F401
    except Exception as exc:  # never break `import numba`; but say so loudly
        warnings.warn(
            f"kvcanary: could not install the source-digest numba cache locator ({exc!r}); "
            "numba's per-file cache may serve stale compiled code after a kvcanary edit "
            "(delete the __pycache__ folders to be safe)",
            RuntimeWarning,
            stacklevel=2,
        )


class _NumbaImportHook:
    """One-shot finder: lets the other finders locate ``numba`` and wraps the found loader's
    ``exec_module`` (on that loader instance only, so ``numba.__loader__`` stays genuine) to
    install the locator once numba's ``__init__`` has run. (A meta path finder only needs
    ``find_spec``; not subclassing ``importlib.abc.MetaPathFinder`` keeps the import cheap.)"""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != "numba":
            return None
        _remove_hook()
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        orig_exec = getattr(loader, "exec_module", None)
        if loader is None or orig_exec is None:
            return spec  # cannot hook this loader; tests/canary/test_numba_cache.py fails

        def exec_module(module: ModuleType) -> None:
            try:
                orig_exec(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # back to the class's method
            _install_now()

        try:
            loader.exec_module = exec_module
        except AttributeError:  # an unpatchable loader: tests/canary/test_numba_cache.py fails
            return spec
        return spec


_hook = _NumbaImportHook()


def _remove_hook() -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_hook)


def ensure_installed() -> None:
    """Install the locator now if numba is imported, else arm the import hook."""
    if "numba" in sys.modules:
        _install_now()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


snapshot(PACKAGE_ROOT)
ensure_installed()
