"""Exceptions the canary raises at run time."""

from __future__ import annotations


class KVCanaryViolation(RuntimeError):
    """Raised in ``raise`` mode after every new violation row has been logged.

    The message is the logged reports joined by newlines; each report's first line is the
    frozen ``kv_canary violation: ...`` line (SGLang raises a plain ``RuntimeError`` with the
    same text, so ``except RuntimeError`` handlers keep working).
    """


class KVCanaryHealthError(RuntimeError):
    """Raised by the kernel-run-counter health check: a launch tag the canary expected to
    run since the previous check did not run (the canary path is not executing)."""
