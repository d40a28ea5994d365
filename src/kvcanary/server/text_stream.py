"""Incremental detokenisation with stop strings: what a request's output text may show so far.

Stop strings are matched on the detokenised text (a stop string may span tokens, and a
token may hold more than one character). After each step the whole output is decoded again
and the new, *safe* part is released::

    decoded  "The answer is 42.\\n\\nQ"      stop = ("\\n\\nQ:",)
    sent     "The answer is 42."
    held     "\\n\\nQ"   (a prefix of a stop string: released only if the next tokens break it)

A trailing U+FFFD (a UTF-8 sequence cut between tokens) is held back as well. When a stop
string appears, the text ends just before it and the request is over (the caller aborts it
in the engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # released so far
        self.stopped = False  # a stop string matched: ``text`` is final

    def update(self, output_ids: Sequence[int]) -> str:
        """Release what ``output_ids`` (the whole output so far) adds; sets ``stopped``."""
        return self._advance(output_ids, final=False)

    def finish(self, output_ids: Sequence[int]) -> str:
        """The request ended (stop token, length, abort): release everything left (unless a
        stop string already ended it; a stop string in the tail still cuts it)."""
        return self._advance(output_ids, final=True)

    def _advance(self, output_ids: Sequence[int], final: bool) -> str:
        """Decode, cut at the first stop string; otherwise hold back a possible stop-string
        prefix, unless ``final``."""
        if self.stopped:
            return ""
        decoded = self._decode(output_ids)
        cut = self._stop_at(decoded)
        if cut is not None:
            self.stopped = True
            return self._release(decoded[:cut])
        return self._release(decoded if final else decoded[: len(decoded) - self._held(decoded)])

    def _release(self, upto: str) -> str:
        if not upto.startswith(self.text) or len(upto) <= len(self.text):
            return ""  # a decoder that rewrote earlier text: wait until it extends what was sent
        delta, self.text = upto[len(self.text) :], upto
        return delta

    def _stop_at(self, decoded: str) -> int | None:
        # Only text after what was released can hold a new match (a match inside released
        # text would have been found earlier; the held tail is re-searched).
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := decoded.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held(self, decoded: str) -> int:
        """Characters at the end of ``decoded`` that must wait: a partial UTF-8 sequence, or
        the longest tail that begins some stop string."""
        n = len(decoded) - len(decoded.rstrip(REPLACEMENT_CHAR))
        body = decoded[: len(decoded) - n]
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(body)), longest, -1):
                if body.endswith(s[:k]):
                    longest = k
                    break
        return n + longest
