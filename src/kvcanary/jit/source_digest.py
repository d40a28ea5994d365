"""Digests of a package's sources (no numba import: ``import kvcanary`` takes the snapshot).

The keys of kvcanary's numba cache (:mod:`kvcanary.jit.cache`):

* :func:`package_digest`: a SHA-256 over the relative paths and contents of every ``*.py``
  file of the package, taken once per process (:func:`snapshot`) when ``import kvcanary``
  starts (:mod:`kvcanary.jit.cache_hook`): did the sources change while this process
  imported them?
* :func:`closure_digest`: the same over the files of one module's static import closure
  within the package (the modules it imports, theirs, and so on; :func:`import_closure`):
  what a kernel defined in that module can have compiled in.
"""

from __future__ import annotations

import ast
import hashlib
import os
import threading

STAMP_TAG = "kvcanary-srcdigest-v1"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # src/kvcanary

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
            file_hash = _file_hash(path)
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


_imports: dict[tuple[str, bytes], frozenset[str]] = {}  # (file, its content hash) -> imported files


def _file_hash(path: str) -> bytes:
    """SHA-256 of ``path``'s contents, re-read whenever its (mtime, ctime, size, inode)
    changes."""
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
    file_hash = _file_hashes.get(key)
    if file_hash is None:
        with open(path, "rb") as f:
            file_hash = hashlib.sha256(f.read()).digest()
        _file_hashes[key] = file_hash
    return file_hash


def _module_file(root: str, dotted: str) -> str | None:
    """The file of module ``dotted`` (``<package>.a.b``) under ``root``, or None (not ours,
    or no such file)."""
    parts = dotted.split(".")
    if parts[0] != os.path.basename(root):
        return None
    base = os.path.join(root, *parts[1:])
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _direct_imports(root: str, path: str) -> frozenset[str]:
    """The files under ``root`` that ``path`` imports anywhere in its text (module level,
    in functions, under ``TYPE_CHECKING``: more than runs is safe). ``from P import n``
    counts ``P.n`` when that is a module (not ``P``'s ``__init__``), else ``P``."""
    key = (path, _file_hash(path))
    found = _imports.get(key)
    if found is not None:
        return found
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), path)
    name = _module_name(root, path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out: set[str] = set()

    def add(dotted: str) -> None:
        target = _module_file(root, dotted)
        if target is not None:
            out.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            whole = False
            for alias in node.names:
                sub = _module_file(root, f"{module}.{alias.name}")
                if sub is not None:
                    out.add(sub)
                else:
                    whole = True
            if whole:
                add(module)
    found = frozenset(out)
    _imports[key] = found
    return found


def import_closure(root: str | os.PathLike[str], py_file: str | os.PathLike[str]) -> list[str]:
    """``py_file`` and every file under ``root`` it imports, directly or through others
    (static: read from the sources, not from what ran), sorted."""
    real_root = os.path.realpath(root)
    seen: set[str] = set()
    todo = [os.path.realpath(py_file)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            todo.extend(_direct_imports(real_root, path) - seen)
        except (FileNotFoundError, SyntaxError):  # deleted, or mid-edit: hashed as it is
            continue
    return sorted(seen)


def closure_digest(root: str | os.PathLike[str], py_file: str | os.PathLike[str]) -> str:
    """SHA-256 hex of the relative paths and contents of :func:`import_closure`."""
    real = os.path.realpath(root)
    h = hashlib.sha256(STAMP_TAG.encode() + b"\0closure")
    with _lock:
        for path in import_closure(real, py_file):
            try:
                file_hash = _file_hash(path)
            except FileNotFoundError:
                continue
            h.update(os.path.relpath(path, real).replace(os.sep, "/").encode())
            h.update(b"\0")
            h.update(file_hash)
    return h.hexdigest()

