"""Numba on-disk cache keyed by each kernel's import closure, not by its own file.

Numba's ``cache=True`` keys each function's cache index by a stamp of *its own* source file.
A cached function also holds everything it compiled in: other jitted functions it calls
(linked, or inlined with ``inline="always"``), module globals frozen as compile-time constants
(``NO_SLOT``, ``CANARY_CHAIN_ANCHOR``, ...), ``@overload`` registrations. Edit a callee's or a
constant's file and the caller's index is still "fresh": numba keeps serving the old compiled
code until ``__pycache__`` is deleted.

:class:`SourceDigestCacheLocator` fixes that for registered package roots (kvcanary's own,
registered on import; tests register throwaway packages with :func:`register_package`):

* the source stamp of a function defined in module M is a SHA-256 over the relative paths and
  *contents* (not mtimes) of M's static import closure within the package
  (:func:`kvcanary.jit.source_digest.import_closure`: every file M imports, anywhere in its text,
  and so on; ``from P import n`` counts module ``P.n`` when there is one, else ``P``). What a
  kernel can compile in reaches it through those imports (callees, frozen globals,
  intrinsics; kvcanary registers no ``@overload`` of foreign functions), so an edit
  recompiles exactly the kernels whose closure holds the edited file: a canary file, the
  canary's kernels (closures of 1-15 files); a model kernel file, the model's; the CLI,
  none;
* the digest is also part of the cache directory (``<numba's dir>/numba-srcdigest-<module>-
  <16 hex>``), so processes running different source versions at once (another checkout
  state, an editor saving mid-run, concurrent pytest-xdist workers) never share index or data
  files (numba writes the index and the data file separately, and a shared directory between
  two source versions could pair a fresh index with old data). Switching back to an earlier
  source state finds its cache still there: per module, the newest few old digest
  directories are kept and older ones unused for an hour are deleted.

Where the cache lives is numba's usual choice, one level deeper: ``$NUMBA_CACHE_DIR/<dir
key>/numba-srcdigest-*`` when ``NUMBA_CACHE_DIR`` is set, else ``<module dir>/__pycache__/
numba-srcdigest-*`` when writable (a source checkout, an editable or a writable installed
package), else the user cache dir (``~/.cache/numba/<dir key>/numba-srcdigest-*``; read-only
site-packages). Functions outside registered roots, and kvcanary zipped or without ``.py``
sources, get plain numba behaviour. If ``NUMBA_CACHE_LOCATOR_CLASSES`` is set, numba uses only
that list: list ``kvcanary.jit.cache.SourceDigestCacheLocator`` first in it (the classes
after it then choose the base directory), otherwise :func:`install` warns that kvcanary's
kernels are not protected.

Which source state a process's kernels belong to: the whole package's digest is *snapshotted*
when the package starts being imported (``import kvcanary``, done by :mod:`kvcanary.jit.cache_hook`; for other
roots, :func:`register_package`), before any of its modules is read, and compared again at each
decoration (numba builds a function's cache then). If the sources changed in between, modules
imported since may hold edited code, so the in-memory code matches no source state: that
process caches its kernels in a private ``numba-srcdigest-mixed-<pid>-<rand>`` dir that no
other process reads (a log warning says so; it is pruned like old digest dirs).

Caveats, as with plain numba: values computed at import from the environment and frozen into
kernels, and code outside the package (numpy; numba keys on its own version), are not part of
the key. Two processes with the same sources compiling *different signatures* of one function
at the same moment still race on that function's index and data-file numbering, as in plain
numba (unchanged here).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from numba.core import caching, config

from kvcanary.jit.source_digest import (
    STAMP_TAG,
    closure_digest,
    import_closure,
    package_digest,
    snapshot,
    source_files,
)

__all__ = [
    "DIGEST_DIR_PREFIX",
    "PACKAGE_ROOT",
    "SourceDigestCacheLocator",
    "closure_digest",
    "import_closure",
    "install",
    "package_digest",
    "register_package",
    "snapshot",
    "source_files",
]

_CacheImpl: Any = caching.CacheImpl  # numba's locator list lives on this class
log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # src/kvcanary
DIGEST_DIR_PREFIX = "numba-srcdigest-"
MIXED_DIR_PREFIX = DIGEST_DIR_PREFIX + "mixed-"
KEEP_OLD_DIGEST_DIRS = 3  # besides the current one, newest first
PRUNE_UNUSED_FOR_S = 3600.0  # never delete a digest dir written to within this window
_PROCESS_TOKEN = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

_lock = threading.Lock()
_roots: list[str] = []  # realpaths of registered package roots, innermost first
_mixed: set[str] = set()  # roots whose sources changed while this process imported them
_pruned: set[tuple[str, str]] = set()  # (parent dir, module family) pruned once


def register_package(root: str | os.PathLike[str]) -> str:
    """Cache every jitted function defined under ``root`` by the digest of ``root``'s sources,
    snapshotted now: register a package before importing it."""
    real = os.path.realpath(root)
    snapshot(real)
    with _lock:
        if real not in _roots:
            _roots.append(real)
            _roots.sort(key=len, reverse=True)
    return real


def cache_key(root: str, py_file: str) -> tuple[str, tuple[str, ...]]:
    """(cache dir name, index stamp) for functions of ``py_file`` (under ``root``) decorated
    now: the digest of the file's import closure (:func:`closure_digest`), in a dir of its
    own (``numba-srcdigest-<module>-<digest>``).

    Unless the package's sources differ from their snapshot now: then modules imported since
    may hold edited code, and this process's kernels go to a private dir (for good: one
    process, one source state) that no later process reads.
    """
    snap = snapshot(root)
    with _lock:
        mixed = root in _mixed
    if not mixed and package_digest(root) != snap:
        with _lock:
            _mixed.add(root)
        mixed = True
        log.warning(
            "kvcanary: sources under %s changed while this process imported them; its numba "
            "kernels are compiled into a private cache dir (%s%s), not shared",
            root,
            MIXED_DIR_PREFIX,
            _PROCESS_TOKEN,
        )
    if mixed:
        return MIXED_DIR_PREFIX + _PROCESS_TOKEN, (STAMP_TAG, "mixed", _PROCESS_TOKEN)
    digest = closure_digest(root, py_file)
    return f"{DIGEST_DIR_PREFIX}{module_slug(root, py_file)}-{digest[:16]}", (STAMP_TAG, digest)


def module_slug(root: str, py_file: str) -> str:
    """``py_file``'s module name below ``root`` (``canary.fused_rows``; a package's
    ``__init__``: its name), as its cache dirs are named."""
    rel = os.path.relpath(os.path.realpath(py_file), root)[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel) or "__init__"


def _root_of(py_file: str) -> str | None:
    if not os.path.isfile(py_file):  # placeholders, zip members, frozen apps: not ours
        return None
    real = os.path.realpath(py_file)
    for root in list(_roots):
        if real.startswith(root + os.sep):
            return root
    return None


def _resolve_locator(name: str) -> Any:
    """A class named in NUMBA_CACHE_LOCATOR_CLASSES, resolved as numba resolves it."""
    import importlib

    if "." in name:
        module_path, class_name = name.rsplit(".", 1)
        return getattr(importlib.import_module(module_path), class_name)
    return getattr(caching, name)


def _locator_classes_env() -> str:
    """NUMBA_CACHE_LOCATOR_CLASSES as numba read it (it re-reads the environment)."""
    return str(getattr(config, "CACHE_LOCATOR_CLASSES", "") or "")


def _active_locator_classes() -> list[Any]:
    if _locator_classes_env():
        return [_resolve_locator(n.strip()) for n in _locator_classes_env().split(",")]
    return list(_CacheImpl._locator_classes)


def _inner_locator_classes() -> list[Any]:
    """The locators that choose the base directory: those after this one in numba's list."""
    active = _active_locator_classes()
    if SourceDigestCacheLocator in active:
        active = active[active.index(SourceDigestCacheLocator) + 1 :]
    return [c for c in active if c is not SourceDigestCacheLocator]


def _prune_old_digest_dirs(parent: str, keep: str) -> None:
    """Delete, once per process, parent and module, the module's digest dirs beyond the newest
    KEEP_OLD_DIGEST_DIRS others, and mixed dirs and dirs of an older naming (one digest for
    the whole package), when unused for PRUNE_UNUSED_FOR_S (a dir's mtime moves whenever
    numba writes a file into it). ``keep``: the module's current dir; other modules' dirs in
    ``parent`` are theirs to prune."""
    family = keep[: keep.rfind("-") + 1]  # numba-srcdigest-<module>-
    with _lock:
        if (parent, family) in _pruned:
            return
        _pruned.add((parent, family))
    digests: list[tuple[float, str]] = []
    stale: list[tuple[float, str]] = []
    try:
        for entry in os.scandir(parent):
            name = entry.name
            if not name.startswith(DIGEST_DIR_PREFIX) or name == keep:
                continue
            if not entry.is_dir(follow_symlinks=False):
                continue
            mtime = entry.stat(follow_symlinks=False).st_mtime
            if name.startswith(MIXED_DIR_PREFIX) or _is_hex16(name[len(DIGEST_DIR_PREFIX):]):
                stale.append((mtime, entry.path))
            elif name.startswith(family) and _is_hex16(name[len(family):]):
                digests.append((mtime, entry.path))
    except OSError:
        return
    digests.sort(reverse=True)
    now = time.time()
    for mtime, path in digests[KEEP_OLD_DIGEST_DIRS:] + stale:
        if now - mtime > PRUNE_UNUSED_FOR_S:
            shutil.rmtree(path, ignore_errors=True)


def _is_hex16(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


class SourceDigestCacheLocator(caching._CacheLocator):
    """Numba cache locator for functions under a registered package root: numba's own
    locators pick the base directory; this one adds ``numba-srcdigest-<digest>`` to it and
    stamps the index with the full package digest."""

    def __init__(
        self, inner: Any, py_file: str, root: str, dir_name: str, stamp: tuple[str, ...]
    ) -> None:
        self._inner = inner
        self._py_file = py_file  # numba reads it for warnings
        self._root = root
        self._dir_name = dir_name
        self._stamp = stamp
        self._base_path = inner.get_cache_path()
        self._cache_path = os.path.join(self._base_path, dir_name)

    @property
    def package_root(self) -> str:
        return self._root

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> tuple[str, ...]:
        return self._stamp

    def get_disambiguator(self) -> str:
        return str(self._inner.get_disambiguator())

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> SourceDigestCacheLocator | None:
        root = _root_of(py_file)
        if root is None:
            return None
        dir_name, stamp = cache_key(root, py_file)
        for inner_cls in _inner_locator_classes():
            inner = inner_cls.from_function(py_func, py_file)
            if inner is None:
                continue
            self = cls(inner, py_file, root, dir_name, stamp)
            try:
                self.ensure_cache_path()
            except OSError as exc:
                warnings.warn(
                    f"kvcanary: cannot use numba cache dir {self._cache_path} ({exc}); "
                    "trying numba's next location",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            _prune_old_digest_dirs(self._base_path, self._dir_name)
            return self
        return None  # no writable base dir: numba's own locators fail too ("no locator")


def install() -> None:
    """Register kvcanary's own root and put the locator first in numba's list (idempotent).
    Runs on import of this module, which ``import kvcanary`` arranges before numba is used."""
    register_package(PACKAGE_ROOT)  # its snapshot: taken by the boot half on `import kvcanary`
    with _lock:
        classes = _CacheImpl._locator_classes
        if SourceDigestCacheLocator not in classes:
            _CacheImpl._locator_classes = [SourceDigestCacheLocator, *classes]
    env = _locator_classes_env()
    if env and "SourceDigestCacheLocator" not in env:
        warnings.warn(
            "NUMBA_CACHE_LOCATOR_CLASSES is set without "
            "kvcanary.jit.cache.SourceDigestCacheLocator: kvcanary's numba kernels use "
            "numba's per-file cache, which can serve stale code after an edit",
            RuntimeWarning,
            stacklevel=2,
        )


install()
