"""The vLLM connector's per-rank summary paths (:func:`rank_summary_path`): rank 0 and a
single worker keep the configured path, rank r > 0 gets ``.rank<r>`` before the extension,
so no two workers of an engine write one file."""

from __future__ import annotations

import pytest

from kvcanary.integrations.vllm.options import rank_summary_path


@pytest.mark.parametrize(
    ("path", "rank", "world_size", "expected"),
    [
        ("/tmp/kv-canary.json", 0, 1, "/tmp/kv-canary.json"),
        ("/tmp/kv-canary.json", 0, 2, "/tmp/kv-canary.json"),
        ("/tmp/kv-canary.json", 1, 2, "/tmp/kv-canary.rank1.json"),
        ("/tmp/kv-canary.json", 11, 16, "/tmp/kv-canary.rank11.json"),
        ("/tmp/summary", 1, 2, "/tmp/summary.rank1"),
        ("/a.b/summary", 3, 4, "/a.b/summary.rank3"),
        ("run.v2.json", 1, 2, "run.v2.rank1.json"),
    ],
)
def test_rank_summary_path(path: str, rank: int, world_size: int, expected: str) -> None:
    assert rank_summary_path(path, rank, world_size) == expected


def test_rank_summary_paths_of_an_engine_are_distinct() -> None:
    paths = [rank_summary_path("/tmp/kv-canary.json", r, 8) for r in range(8)]
    assert len(set(paths)) == 8 and paths[0] == "/tmp/kv-canary.json"
