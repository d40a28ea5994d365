"""kvcanary.numba_cache: numba's on-disk cache must never serve code compiled from old sources.

Plain numba keys a function's cache by its own file, so a cached caller keeps the old code of
a jitted callee in another file after that file is edited. The toy-package tests show the bug
with plain numba and its absence with :class:`SourceDigestCacheLocator`, each run in a fresh
interpreter (the cache only matters across processes).
``test_kvcanary_kernels_use_source_digest_locator`` checks the locator is the one numba uses for
every cached kvcanary kernel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import kvcanary
from kvcanary.numba_cache import (
    DIGEST_DIR_PREFIX,
    KEEP_OLD_DIGEST_DIRS,
    MIXED_DIR_PREFIX,
    PRUNE_UNUSED_FOR_S,
    _prune_old_digest_dirs,
    package_digest,
)

SRC_DIR = str(Path(kvcanary.__file__).resolve().parents[1])

# Runs in a fresh interpreter: imports the toy package (plain numba, or with the toy package
# registered with kvcanary's locator) and calls the cached caller a.f() -> 10 * b.value().
TOY_DRIVER = """
import json, sys
root, mode = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
if mode.startswith("digest"):
    from kvcanary.numba_cache import register_package
    register_package(root + "/toypkg")  # snapshots the sources
if mode == "digest-edit-midway":  # as an editor saving while this process imports
    import os
    b = root + "/toypkg/b.py"
    st = os.stat(b)
    with open(b) as fh:
        text = fh.read()
    with open(b, "w") as fh:
        fh.write(text.replace("return 1", "return 3"))
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
from toypkg.a import f
result = int(f())
print(json.dumps({
    "result": result,
    "hits": sum(f.stats.cache_hits.values()),
    "misses": sum(f.stats.cache_misses.values()),
    "locator": type(f._cache._impl.locator).__name__,
    "cache_path": f._cache.cache_path,
    "kvcanary_imported": "kvcanary" in sys.modules,
}))
"""

TOY_B = """\
import numba


@numba.njit(cache=True)
def value():
    return 1
"""

TOY_A = """\
import numba

from toypkg.b import value


@numba.njit(cache=True)
def f():
    return value() * 10
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _toy_package(tmp_path: Path) -> Path:
    pkg = tmp_path / "toypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(TOY_A)
    (pkg / "b.py").write_text(TOY_B)
    return pkg


def _edit_keeping_size_and_mtime(path: Path, old: str, new: str) -> None:
    """Content-only edit: same size, mtime put back (only a content key can notice it)."""
    assert len(old) == len(new)
    st = path.stat()
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_plain_numba_serves_stale_callee_after_edit(tmp_path: Path) -> None:
    """The bug this module exists for (so the next test would catch its return)."""
    pkg = _toy_package(tmp_path)
    first = _run(TOY_DRIVER, str(tmp_path), "plain")
    assert first["result"] == 10 and first["misses"] == 1
    assert first["locator"] == "InTreeCacheLocator" and not first["kvcanary_imported"]

    _edit_keeping_size_and_mtime(pkg / "b.py", "return 1", "return 2")
    stale = _run(TOY_DRIVER, str(tmp_path), "plain")
    assert stale["result"] == 10, "numba now rebuilds callers of edited callees: update docs"
    assert stale["hits"] == 1  # a.f() came from its cache, with b.value() == 1 compiled in


def test_source_digest_locator_recompiles_after_callee_edit(tmp_path: Path) -> None:
    pkg = _toy_package(tmp_path)
    first = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert first["locator"] == "SourceDigestCacheLocator"
    assert (first["result"], first["hits"], first["misses"]) == (10, 0, 1)
    assert first["cache_path"] == str(
        pkg / "__pycache__" / (DIGEST_DIR_PREFIX + package_digest(pkg)[:16])
    )
    cached = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert (cached["result"], cached["hits"], cached["misses"]) == (10, 1, 0)  # still caches

    _edit_keeping_size_and_mtime(pkg / "b.py", "return 1", "return 2")
    fresh = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert (fresh["result"], fresh["hits"], fresh["misses"]) == (20, 0, 1)
    assert fresh["cache_path"] != first["cache_path"]
    cached = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert (cached["result"], cached["hits"], cached["misses"]) == (20, 1, 0)

    _edit_keeping_size_and_mtime(pkg / "b.py", "return 2", "return 1")  # back: still cached
    back = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert (back["result"], back["hits"], back["cache_path"]) == (10, 1, first["cache_path"])


def test_sources_edited_while_importing_are_never_cached_for_others(tmp_path: Path) -> None:
    pkg = _toy_package(tmp_path)
    snapshot_dir = DIGEST_DIR_PREFIX + package_digest(pkg)[:16]
    midway = _run(TOY_DRIVER, str(tmp_path), "digest-edit-midway")
    assert midway["result"] == 30  # the process imported the edited b.py
    assert Path(midway["cache_path"]).name.startswith(MIXED_DIR_PREFIX)
    assert not (pkg / "__pycache__" / snapshot_dir).exists()  # nothing under the old key
    after = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert (after["result"], after["hits"], after["misses"]) == (30, 0, 1)
    assert Path(after["cache_path"]).name == DIGEST_DIR_PREFIX + package_digest(pkg)[:16]


def test_numba_cache_dir_and_user_cache_fallback(tmp_path: Path) -> None:
    pkg = _toy_package(tmp_path)
    digest_dir = DIGEST_DIR_PREFIX + package_digest(pkg)[:16]
    cache_dir = tmp_path / "numba_cache_dir"
    out = _run(TOY_DRIVER, str(tmp_path), "digest", env=_env(NUMBA_CACHE_DIR=str(cache_dir)))
    path = Path(out["cache_path"])
    assert path.name == digest_dir and path.parent.parent == cache_dir
    py = "py{}{}".format(*sys.version_info[:2])
    assert sorted(p.name for p in path.glob("*.nbi")) == [f"a.f-6.{py}.nbi", f"b.value-4.{py}.nbi"]
    assert not (pkg / "__pycache__" / digest_dir).exists()

    # No writable in-tree __pycache__ (a file in its way: read-only even for root): numba's
    # user-wide cache dir, still keyed by the digest.
    (tmp_path / "other").mkdir()
    pkg2 = _toy_package(tmp_path / "other")
    (pkg2 / "__pycache__").write_text("not a folder")
    xdg = tmp_path / "xdg"
    out = _run(TOY_DRIVER, str(tmp_path / "other"), "digest", env=_env(XDG_CACHE_HOME=str(xdg)))
    path = Path(out["cache_path"])
    assert out["result"] == 10 and path.name == DIGEST_DIR_PREFIX + package_digest(pkg2)[:16]
    assert path.is_relative_to(xdg / "numba") and len(list(path.glob("*.nbi"))) == 2


# A fresh interpreter imports every kvcanary module that uses numba and reports each cached
# dispatcher's locator, then compiles one kernel and lists its cache folder.
KVCANARY_DRIVER = """
import importlib, json, re, sys
from pathlib import Path
if sys.argv[1] == "numba-first":
    import numba
import kvcanary
numba_after_import_kvcanary = "numba" in sys.modules
from kvcanary._numba_cache_hook import PACKAGE_ROOT, snapshot
digest_at_import = snapshot(PACKAGE_ROOT)
root = Path(kvcanary.__file__).resolve().parent
modules = []
for p in sorted(root.rglob("*.py")):
    if "__pycache__" in p.parts or p.name == "numba_cache.py":
        continue
    if re.search(r"^\\s*(import numba|from numba)", p.read_text(), re.M):
        parts = p.relative_to(root.parent).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
from numba.core.caching import FunctionCache
from numba.core.registry import CPUDispatcher
kernels = {}
for name in modules:
    mod = importlib.import_module(name)
    for obj in vars(mod).values():
        if isinstance(obj, CPUDispatcher) and obj.py_func.__module__ == name:
            cache = obj._cache
            key = name + "." + obj.py_func.__qualname__
            kernels[key] = (
                [type(cache._impl.locator).__name__, cache.cache_path]
                if isinstance(cache, FunctionCache) else [type(cache).__name__, None]
            )
import numpy as np
from kvcanary.canary.hashing import splitmix64_nb
from kvcanary.numba_cache import package_digest
splitmix64_nb(np.uint64(1))
digest_at_end = package_digest(root)
print(json.dumps({
    "numba_after_import_kvcanary": numba_after_import_kvcanary,
    "modules": modules, "kernels": kernels,
    "digest_at_import": digest_at_import, "digest_at_end": digest_at_end,
    "splitmix_dir": splitmix64_nb._cache.cache_path,
    "splitmix_files": sorted(p.name for p in Path(splitmix64_nb._cache.cache_path).iterdir()),
}))
"""


def _run_kvcanary_driver(order: str, cache_dir: Path) -> dict[str, Any]:
    """Retried while kvcanary's sources change under it (a shared checkout being edited)."""
    for _ in range(5):
        out = _run(KVCANARY_DRIVER, order, env=_env(NUMBA_CACHE_DIR=str(cache_dir)))
        if out["digest_at_import"] == out["digest_at_end"]:
            return out
        time.sleep(1.0)
    pytest.skip("kvcanary's sources kept changing during the check")


def test_kvcanary_kernels_use_source_digest_locator(tmp_path: Path) -> None:
    for order in ("kvcanary-first", "numba-first"):
        cache_dir = tmp_path / order
        out = _run_kvcanary_driver(order, cache_dir)
        if order == "kvcanary-first":  # the import hook path; numba is not loaded eagerly
            assert not out["numba_after_import_kvcanary"], "import kvcanary now loads numba"
        assert "kvcanary.canary.kernels_numba" in out["modules"] and len(out["modules"]) >= 5
        kernels = out["kernels"]
        assert "kvcanary.canary.kernels_numba._verify_kernel" in kernels and len(kernels) >= 15
        digest_dir = DIGEST_DIR_PREFIX + out["digest_at_import"][:16]
        for name, (locator, path) in kernels.items():
            assert locator == "SourceDigestCacheLocator", name
            assert Path(path).name == digest_dir and Path(path).is_relative_to(cache_dir), name
        assert Path(out["splitmix_dir"]).name == digest_dir
        assert any(
            re.fullmatch(r"hashing\.splitmix64_nb-\d+\.py\d+\.nbi", f)
            for f in out["splitmix_files"]
        )


def test_digest_is_content_keyed_over_the_whole_package(tmp_path: Path) -> None:
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "consts.py").write_text("K = 1\n")
    d0 = package_digest(pkg)
    _edit_keeping_size_and_mtime(pkg / "sub" / "consts.py", "K = 1", "K = 2")  # same process
    d1 = package_digest(pkg)
    assert d1 != d0
    (pkg / "sub" / "__pycache__").mkdir()
    (pkg / "sub" / "__pycache__" / "x.py").write_text("junk")
    (pkg / "notes.txt").write_text("not python")
    assert package_digest(pkg) == d1
    (pkg / "sub" / "consts.py").rename(pkg / "sub" / "consts2.py")
    assert package_digest(pkg) not in (d0, d1)


def test_old_digest_dirs_are_pruned(tmp_path: Path) -> None:
    now = time.time()
    ages = {"cur": 10 * PRUNE_UNUSED_FOR_S, "old0": 2 * PRUNE_UNUSED_FOR_S}
    ages["old1"] = 3 * PRUNE_UNUSED_FOR_S
    ages.update({f"recent{i}": 1.0 + i for i in range(KEEP_OLD_DIGEST_DIRS + 1)})
    ages.update({"mixed-1-old": 2 * PRUNE_UNUSED_FOR_S, "mixed-2-recent": 5.0})
    for name, age in ages.items():
        d = tmp_path / (DIGEST_DIR_PREFIX + name)
        d.mkdir()
        os.utime(d, (now - age, now - age))
    (tmp_path / "unrelated").mkdir()
    _prune_old_digest_dirs(str(tmp_path), DIGEST_DIR_PREFIX + "cur")
    left = sorted(p.name.removeprefix(DIGEST_DIR_PREFIX) for p in tmp_path.iterdir())
    # old0/old1: beyond the newest KEEP_OLD_DIGEST_DIRS others and unused for long; the last
    # recent one is beyond that count too but recently written (maybe by a running process).
    # Mixed dirs (one process's private cache) go once unused for long.
    recent = [f"recent{i}" for i in range(KEEP_OLD_DIGEST_DIRS + 1)]
    assert left == sorted(["cur", "unrelated", "mixed-2-recent", *recent])
