"""The canary is host-agnostic: nothing under ``kvcanary/canary`` imports the engine, the
memory system, the model, a host integration, the server or a front end; it may use only
itself and the package's leaf utilities (env registry, small helpers, the numba
infrastructure). Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcanary.canary

CANARY = Path(kvcanary.canary.__file__).parent
ALLOWED = ("kvcanary.canary", "kvcanary.envs", "kvcanary.utils",
           "kvcanary.jit", "kvcanary.numba_")  # fmt: skip


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every kvcanary import in ``path``; ``from kvcanary import
    x`` counts as ``kvcanary.x``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            if node.module == "kvcanary":
                out += [(node.lineno, f"kvcanary.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return [(line, m) for line, m in out if m == "kvcanary" or m.startswith("kvcanary.")]


def violations(root: Path) -> list[str]:
    return [f"{p.relative_to(root.parent)}:{line} imports {module}"
            for p in sorted(root.rglob("*.py"))
            for line, module in sorted(imports_of(p))
            if not module.startswith(ALLOWED)]  # fmt: skip


def test_canary_imports_no_engine_memory_model_or_host() -> None:
    assert violations(CANARY) == []


def test_the_rule_catches_a_function_level_import_of_the_memory_system(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pkg = tmp_path / "canary"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "plan" / "x.py").write_text(
        "from kvcanary.canary.wire import constants\n"
        "def f():\n    from kvcanary.memory.mha_pool import MHAKVPool\n"
        "from kvcanary import engine\n"
    )
    assert violations(pkg) == ["canary/plan/x.py:3 imports kvcanary.memory.mha_pool",
                               "canary/plan/x.py:4 imports kvcanary.engine"]  # fmt: skip


def test_the_front_door_exports_resolve_lazily() -> None:
    for name in kvcanary.canary.__all__:
        assert getattr(kvcanary.canary, name).__name__ == name
