"""kvcanary.jit.cache: numba's on-disk cache must never serve code compiled from old sources.

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
from kvcanary.jit.cache import (
    DIGEST_DIR_PREFIX,
    KEEP_OLD_DIGEST_DIRS,
    MIXED_DIR_PREFIX,
    PRUNE_UNUSED_FOR_S,
    _prune_old_digest_dirs,
    closure_digest,
    import_closure,
    module_slug,
    package_digest,
)

SRC_DIR = str(Path(kvcanary.__file__).resolve().parents[1])


def _dir(pkg: Path, module: str) -> str:
    """The cache dir name of toy module ``module``'s kernels: its import closure's digest."""
    return f"{DIGEST_DIR_PREFIX}{module}-{closure_digest(pkg, pkg / (module + '.py'))[:16]}"

# Runs in a fresh interpreter: imports the toy package (plain numba, or with the toy package
# registered with kvcanary's locator) and calls the cached caller a.f() -> 10 * b.value().
TOY_DRIVER = """
import json, sys
root, mode = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
if mode.startswith("digest"):
    from kvcanary.jit.cache import register_package
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
    assert first["cache_path"] == str(pkg / "__pycache__" / _dir(pkg, "a"))
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
    snapshot_dir = _dir(pkg, "a")
    midway = _run(TOY_DRIVER, str(tmp_path), "digest-edit-midway")
    assert midway["result"] == 30  # the process imported the edited b.py
    assert Path(midway["cache_path"]).name.startswith(MIXED_DIR_PREFIX)
    assert not (pkg / "__pycache__" / snapshot_dir).exists()  # nothing under the old key
    after = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert (after["result"], after["hits"], after["misses"]) == (30, 0, 1)
    assert Path(after["cache_path"]).name == _dir(pkg, "a")


def test_numba_cache_dir_and_user_cache_fallback(tmp_path: Path) -> None:
    pkg = _toy_package(tmp_path)
    digest_dir = _dir(pkg, "a")
    cache_dir = tmp_path / "numba_cache_dir"
    out = _run(TOY_DRIVER, str(tmp_path), "digest", env=_env(NUMBA_CACHE_DIR=str(cache_dir)))
    path = Path(out["cache_path"])
    assert path.name == digest_dir and path.parent.parent == cache_dir
    py = "py{}{}".format(*sys.version_info[:2])
    assert sorted(p.name for p in path.glob("*.nbi")) == [f"a.f-6.{py}.nbi"]
    assert [p.name for p in (path.parent / _dir(pkg, "b")).glob("*.nbi")] == [f"b.value-4.{py}.nbi"]
    assert not (pkg / "__pycache__" / digest_dir).exists()

    # No writable in-tree __pycache__ (a file in its way: read-only even for root): numba's
    # user-wide cache dir, still keyed by the digest.
    (tmp_path / "other").mkdir()
    pkg2 = _toy_package(tmp_path / "other")
    (pkg2 / "__pycache__").write_text("not a folder")
    xdg = tmp_path / "xdg"
    out = _run(TOY_DRIVER, str(tmp_path / "other"), "digest", env=_env(XDG_CACHE_HOME=str(xdg)))
    path = Path(out["cache_path"])
    assert out["result"] == 10 and path.name == _dir(pkg2, "a")
    assert path.is_relative_to(xdg / "numba") and len(list(path.glob("*.nbi"))) == 1


# A fresh interpreter imports every kvcanary module that uses numba and reports each cached
# dispatcher's locator, then compiles one kernel and lists its cache folder.
KVCANARY_DRIVER = """
import importlib, json, re, sys
from pathlib import Path
if sys.argv[1] == "numba-first":
    import numba
import kvcanary
numba_after_import_kvcanary = "numba" in sys.modules
from kvcanary.jit.cache_hook import PACKAGE_ROOT, snapshot
digest_at_import = snapshot(PACKAGE_ROOT)
root = Path(kvcanary.__file__).resolve().parent
modules = []
for p in sorted(root.rglob("*.py")):
    if "__pycache__" in p.parts or p.name == "jit/cache.py":
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
from kvcanary.canary.wire.hashing import splitmix64_nb
from kvcanary.jit.cache import package_digest
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
        assert "kvcanary.canary.kernels.numba_kernels" in out["modules"] and len(out["modules"]) >= 5
        kernels = out["kernels"]
        assert "kvcanary.canary.kernels.numba_kernels._verify_kernel" in kernels and len(kernels) >= 15
        root = Path(kvcanary.__file__).resolve().parent
        for name, (locator, path) in kernels.items():
            assert locator == "SourceDigestCacheLocator", name
            module = name.rsplit(".", 1)[0] if name.count(".") > 1 else name
            file = _kernel_file(root, module, name)
            expected = f"{DIGEST_DIR_PREFIX}{module_slug(str(root), str(file))}-"
            assert Path(path).name == expected + closure_digest(root, file)[:16], name
            assert Path(path).is_relative_to(cache_dir), name
        hashing = root / "canary" / "wire" / "hashing.py"
        assert Path(out["splitmix_dir"]).name == (
            f"{DIGEST_DIR_PREFIX}canary.wire.hashing-{closure_digest(root, hashing)[:16]}")
        assert any(
            re.fullmatch(r"hashing\.splitmix64_nb-\d+\.py\d+\.nbi", f)
            for f in out["splitmix_files"]
        )


def _kernel_file(root: Path, module: str, kernel: str) -> Path:
    """The file defining ``kernel`` (``kvcanary.a.b.f`` or ``kvcanary.a.b.C.f``)."""
    parts = kernel.split(".")[1:]
    for n in range(len(parts) - 1, 0, -1):
        path = root.joinpath(*parts[:n]).with_suffix(".py")
        if path.is_file():
            return path
    raise AssertionError(f"no file for {kernel} ({module})")


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
    mod = DIGEST_DIR_PREFIX + "canary.mod-"
    hexes = iter(f"{i:016x}" for i in range(100))
    ages = {"cur": 10 * PRUNE_UNUSED_FOR_S, "old0": 2 * PRUNE_UNUSED_FOR_S}
    ages["old1"] = 3 * PRUNE_UNUSED_FOR_S
    ages.update({f"recent{i}": 1.0 + i for i in range(KEEP_OLD_DIGEST_DIRS + 1)})
    names = {label: mod + next(hexes) for label in ages}
    # Other dirs in the same parent: another module's (its own to prune, however old), a
    # process's private dirs, and the older whole-package naming (stale once unused).
    others = {"other-module": (DIGEST_DIR_PREFIX + "canary.other-" + next(hexes), 9 * PRUNE_UNUSED_FOR_S),
              "mixed-old": (MIXED_DIR_PREFIX + "1-old", 2 * PRUNE_UNUSED_FOR_S),
              "mixed-recent": (MIXED_DIR_PREFIX + "2-recent", 5.0),
              "package-old": (DIGEST_DIR_PREFIX + next(hexes), 2 * PRUNE_UNUSED_FOR_S),
              "package-recent": (DIGEST_DIR_PREFIX + next(hexes), 5.0)}  # fmt: skip
    dirs = {**{k: (v, ages[k]) for k, v in names.items()}, **others}
    for name, age in dirs.values():
        d = tmp_path / name
        d.mkdir()
        os.utime(d, (now - age, now - age))
    (tmp_path / "unrelated").mkdir()
    _prune_old_digest_dirs(str(tmp_path), names["cur"])
    left = {p.name for p in tmp_path.iterdir()}
    # old0/old1: beyond the newest KEEP_OLD_DIGEST_DIRS others of the module and unused for
    # long; the last recent one is beyond that count too but recently written (maybe by a
    # running process).
    gone = {"old0", "old1", "mixed-old", "package-old"}
    assert left == {"unrelated"} | {name for k, (name, _) in dirs.items() if k not in gone}


def test_a_kernels_cache_key_is_its_import_closure(tmp_path: Path) -> None:
    """a imports b (relatively, and through ``from pkg import module``); c stands apart:
    editing c leaves a's and b's keys, editing b changes a's too."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import pkg.c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("V = 1\n")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    return b.V\n")
    (pkg / "c.py").write_text("W = 1\n")
    a, b, c = pkg / "a.py", pkg / "sub" / "b.py", pkg / "c.py"
    assert import_closure(pkg, a) == sorted([str(a), str(b)])
    before = {m: closure_digest(pkg, m) for m in (a, b, c)}
    _edit_keeping_size_and_mtime(c, "W = 1", "W = 2")
    assert closure_digest(pkg, a) == before[a] and closure_digest(pkg, b) == before[b]
    assert closure_digest(pkg, c) != before[c]
    _edit_keeping_size_and_mtime(b, "V = 1", "V = 2")
    assert closure_digest(pkg, a) != before[a] and closure_digest(pkg, b) != before[b]
    (pkg / "a.py").write_text("from pkg.sub import b\nimport pkg.c\n")
    assert import_closure(pkg, a) == sorted([str(a), str(b), str(c)])


def test_an_edit_outside_a_kernels_closure_keeps_it_cached(tmp_path: Path) -> None:
    pkg = _toy_package(tmp_path)
    (pkg / "c.py").write_text("UNUSED = 1\n")
    first = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert (first["result"], first["misses"]) == (10, 1)
    _edit_keeping_size_and_mtime(pkg / "c.py", "UNUSED = 1", "UNUSED = 2")
    again = _run(TOY_DRIVER, str(tmp_path), "digest")
    assert (again["result"], again["hits"], again["misses"]) == (10, 1, 0)
    assert again["cache_path"] == first["cache_path"]
