"""Summaries: a readable table for the terminal and the same dict as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tabulate import tabulate

from kvcanary.utils import write_file_atomically


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def render_table(title: str, rows: dict[str, Any]) -> str:
    body = tabulate([(k, _fmt(v)) for k, v in rows.items()], headers=["metric", "value"],
                    tablefmt="simple", colalign=("left", "right"))
    return f"{title}\n{body}"


def render_matrix(title: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f"{title}\n(no rows)"
    table = [[_fmt(r.get(k, "")) for k in rows[0]] for r in rows]
    return f"{title}\n{tabulate(table, headers=list(rows[0]), tablefmt='simple')}"


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    write_file_atomically(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


def emit(title: str, summary: dict[str, Any], json_path: str | None) -> None:
    """Print ``summary`` as a table and, with ``--json OUT``, write it as JSON."""
    print(render_table(title, summary))
    if json_path:
        write_json(json_path, summary)
