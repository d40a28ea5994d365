"""Digest of a package's sources (no numba import: ``import kvcanary`` takes the snapshot).

The key of kvcanary's numba cache (:mod:`kvcanary.numba_cache`): a SHA-256 over the relative
paths and contents of every ``*.py`` file of the package, taken once per process
(:func:`snapshot`) when ``import kvcanary`` starts (:mod:`kvcanary._numba_cache_hook`).
"""

from __future__ import annotations

import hashlib
import os
import threading

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
