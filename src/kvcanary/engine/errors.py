"""Engine errors a caller must react to, by type (the server maps types, never text).

Both subclass the built-in type they replaced, so ``except ValueError`` / ``except
RuntimeError`` callers keep working.
"""

from __future__ import annotations


class ContextLengthError(ValueError):
    """A request's prompt + ``max_new_tokens`` exceeds the engine's context length."""

    def __init__(self, message: str, *, prompt_len: int, max_new_tokens: int, limit: int):
        super().__init__(message)
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.limit = limit


class RequestTooLargeError(ValueError):
    """A request fits the context length but not the KV pools, even running alone."""


class KVPoolTooSmallError(RuntimeError):
    """The KV pools cannot hold one request even alone: no retry fixes it, only a larger
    ``max_total_tokens`` / ``swa_full_tokens_ratio`` or a shorter request."""
