"""The ``KVCANARY_*`` table of docs/CLI.md against the registry in ``kvcanary.envs``.

Both directions: every variable ``envs.py`` defines has a row, every row names a registered
variable, and each row's default and allowed values are the registry's. Any other
``KVCANARY_*`` name in README.md or docs/ must be registered too, or be a test-only knob
read under tests/ (e.g. ``KVCANARY_SGLANG_XREF_SCENARIOS``). The dated records
(docs/DECISIONS.md, docs/COLD_START.md) may name variables that no longer exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcanary import envs

ROOT = Path(__file__).resolve().parents[1]
CLI_DOC = ROOT / "docs" / "CLI.md"
TABLE_HEADING = "## Environment variables"
NAME = re.compile(r"\bKVCANARY_[A-Z0-9_]*[A-Z0-9]\b")
DATED_RECORDS = {"DECISIONS.md", "COLD_START.md"}  # history, not the system as it is


def env_rows(text: str) -> dict[str, tuple[str, str]]:
    """``{name: (default, allowed)}`` of the table under :data:`TABLE_HEADING`: the first
    table after the heading, rows ``| `NAME` | `default` | allowed | ... |``."""
    _, found, after = text.partition(TABLE_HEADING + "\n")
    if not found:
        raise AssertionError(f"{CLI_DOC.name} has no {TABLE_HEADING!r} section")
    lines = after.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start + 2 :]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, default, allowed = (c.strip("`") for c in cells[:3])
        assert name not in rows, f"{name} has two rows"
        rows[name] = (default, allowed)
    return rows


def registry() -> dict[str, envs.EnvVar]:
    """Every ``EnvVar`` ``envs.py`` defines at module level, by variable name."""
    defined = {v.name: v for v in vars(envs).values() if isinstance(v, envs.EnvVar)}
    listed = {v.name for v in envs.ALL_ENV_VARS}
    assert set(defined) == listed, (
        f"envs.ALL_ENV_VARS differs from the module: {set(defined) ^ listed}"
    )
    return defined


def test_every_registered_variable_has_a_row_and_every_row_is_registered() -> None:
    rows = env_rows(CLI_DOC.read_text())
    names = set(registry())
    assert not names - set(rows), f"undocumented in {CLI_DOC.name}: {sorted(names - set(rows))}"
    assert not set(rows) - names, f"documented but not in envs.py: {sorted(set(rows) - names)}"


@pytest.mark.parametrize("var", envs.ALL_ENV_VARS, ids=lambda v: v.name)
def test_row_shows_the_registry_default_and_allowed_values(var: envs.EnvVar) -> None:
    rows = env_rows(CLI_DOC.read_text())
    if var.name not in rows:
        pytest.skip("no row (reported by the test above)")
    default, allowed = rows[var.name]
    assert default == str(var.default), (
        f"{var.name}: the doc says {default!r}, envs.py {var.default!r}"
    )
    assert allowed == var.allowed, f"{var.name}: the doc says {allowed!r}, envs.py {var.allowed!r}"


def test_every_variable_the_docs_mention_exists() -> None:
    names = set(registry())
    test_knobs = {n for p in (ROOT / "tests").rglob("*.py") if p.resolve() != Path(__file__).resolve()
                  for n in NAME.findall(p.read_text())}  # fmt: skip
    docs = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in DATED_RECORDS]
    for doc in [ROOT / "README.md", *docs]:
        unknown = set(NAME.findall(doc.read_text())) - names - test_knobs
        assert not unknown, (
            f"{doc.relative_to(ROOT)} names variables envs.py lacks: {sorted(unknown)}"
        )
