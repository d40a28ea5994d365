"""The messages one logger emits at WARNING and above, whatever its ``propagate`` (vLLM's
"vllm" logger does not propagate once an engine configured logging, so pytest's caplog on
the root logger misses its lines)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class LogLines(logging.Handler):
    """Each record's message, in order (``lines``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def log_lines(name: str) -> Iterator[LogLines]:
    """A :class:`LogLines` on logger ``name`` for the block."""
    handler = LogLines()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
