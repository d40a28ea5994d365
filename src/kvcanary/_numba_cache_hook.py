"""Boot half of :mod:`kvcanary.numba_cache` (no numba import here; ``import kvcanary`` must stay
light, and numba costs ~0.2 s to import).

Imported first thing by ``kvcanary/__init__.py``, so it runs before any other kvcanary module.
It does two things:

* takes the *source snapshot* of kvcanary: the digest of its sources as they are when the
  package starts being imported (:func:`snapshot`). Cached kernels are keyed by it; a later
  digest that differs means the sources changed while this process was importing them, so its
  in-memory code matches no single source state (see :mod:`kvcanary.numba_cache`);
* installs the locator before any kvcanary ``@numba.njit`` decorator runs: now if numba is
  already imported, else by a one-shot ``sys.meta_path`` hook right after numba's own
  ``__init__`` finishes, i.e. before ``import numba`` returns to the module that asked for it,
  hence before its decorators run. Numba builds a function's cache, and picks its locator,
  when the decorator runs (``Dispatcher.enable_caching``), not at the first call.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importlib.abc/machinery cost ~20 ms to import (importlib.resources)
    from importlib.machinery import ModuleSpec

STAMP_TAG = "kvcanary-srcdigest-v1"
PACKAGE_ROOT = os.path.dirname(os.path.realpath(__file__))

_lock = threading.Lock()
_file_hashes: dict[tuple[str, int, int, int, int], bytes] = {}
_snapshots: dict[str, str] = {}  # realpath of a package root -> its digest when first seen


def source_files(root: str | os.PathLike[str]) -> list[str]:
    """The ``*.py`` files a digest covers: all under ``root``, sorted; no ``__pycache__`` or
    hidden folders."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    out.sort()
    return out


def package_digest(root: str | os.PathLike[str]) -> str:
    """SHA-256 hex of the relative paths and contents of :func:`source_files` of ``root``.

    A file is re-read whenever its (mtime, ctime, size, inode) changes; ctime cannot be set
    back, so a same-size rewrite with its mtime restored is seen within one process too.
    """
    real = os.path.realpath(root)
    h = hashlib.sha256(STAMP_TAG.encode())
    for path in source_files(real):
        try:
            st = os.stat(path)
            key = (path, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
            file_hash = _file_hashes.get(key)
            if file_hash is None:
                with open(path, "rb") as f:
                    file_hash = hashlib.sha256(f.read()).digest()
                _file_hashes[key] = file_hash
        except FileNotFoundError:  # deleted while we walked
            continue
        h.update(os.path.relpath(path, real).replace(os.sep, "/").encode())
        h.update(b"\0")
        h.update(file_hash)
    return h.hexdigest()


def snapshot(root: str | os.PathLike[str]) -> str:
    """The digest of ``root`` taken the first time this process asked (idempotent)."""
    real = os.path.realpath(root)
    with _lock:
        digest = _snapshots.get(real)
    if digest is None:
        digest = package_digest(real)
        with _lock:
            digest = _snapshots.setdefault(real, digest)
    return digest


def _install_now() -> None:
    try:
        # Installs on import (idempotent). If kvcanary.numba_cache is itself being imported
        # (it is what imported numba), this returns its partial module and it installs at
        # the end of its own body.
        import kvcanary.numba_cache  # noqa: F401
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
