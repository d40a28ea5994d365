"""TextStream: stop strings matched on detokenised text (across tokens), held-back prefixes
and partial UTF-8, and what is released step by step."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvcanary.model.tokenizer import ByteTokenizer
from kvcanary.server.text_stream import TextStream

DECODE = ByteTokenizer().decode


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _run(text: str, stop: Sequence[str]) -> tuple[list[str], str, bool]:
    """Feed ``text`` one byte (token) at a time; the released pieces, final text, stopped."""
    stream = TextStream(DECODE, stop)
    ids = _ids(text)
    pieces = [stream.update(ids[: i + 1]) for i in range(len(ids))]
    if not stream.stopped:
        pieces.append(stream.finish(ids))
    return pieces, stream.text, stream.stopped


# (text, stop strings, final text, stopped)
CASES = [
    ("hello world", (), "hello world", False),
    ("hello world", ("wor",), "hello ", True),
    ("hello world", ("xyz", "lo w"), "hel", True),
    ("hello world", ("o",), "hell", True),  # the earliest match wins
    ("aab", ("ab",), "a", True),  # a held prefix that fails ("aa") is released in part
    ("hello", ("lox",), "hello", False),  # held "lo" released at the end
    ("héllo wörld", ("ö",), "héllo w", True),  # multi-byte stop string, split across tokens
    ("日本語テキスト", ("語テ",), "日本", True),
]


@pytest.mark.parametrize("text,stop,final,stopped", CASES)
def test_stop_strings_on_decoded_text(text: str, stop: tuple[str, ...], final: str, stopped: bool) -> None:
    pieces, out, did_stop = _run(text, stop)
    assert out == final and did_stop == stopped
    assert "".join(pieces) == final  # the stream released exactly the final text, in order


def test_held_back_while_a_stop_string_may_still_match() -> None:
    stream = TextStream(DECODE, ("END",))
    assert stream.update(_ids("abcE")) == "abc"  # "E" might start "END"
    assert stream.update(_ids("abcEN")) == ""
    assert stream.update(_ids("abcENx")) == "ENx"  # it did not: released
    assert stream.update(_ids("abcENxEND")) == "" and stream.stopped
    assert stream.text == "abcENx"
    assert stream.update(_ids("abcENxENDmore")) == ""  # nothing after a stop


def test_partial_utf8_is_held_until_complete() -> None:
    stream = TextStream(DECODE)
    ids = _ids("né")
    assert stream.update(ids[:2]) == "n"  # half of "é" decodes to U+FFFD: held
    assert stream.update(ids) == "é"


def test_a_stop_string_in_the_final_tokens_still_cuts() -> None:
    stream = TextStream(DECODE, ("xy",))
    assert stream.update(_ids("abx")) == "ab"
    assert stream.finish(_ids("abxyz")) == "" and stream.stopped and stream.text == "ab"
