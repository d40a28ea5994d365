"""Tokenizers: byte-level round trip, a checkpoint's own tokenizer, and the ids-only stand-in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hf_fixtures import EOS_ID, make_tiny_hf_checkpoint
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.model import (
    ByteTokenizer,
    HFTokenizer,
    IdsOnlyTokenizer,
    TokenizerUnavailableError,
    load_model,
)


@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_specials_and_invalid_utf8() -> None:
    tok = ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (
        256,
        257,
        258,
        259,
    )
    assert tok.eos_token_ids == (257,)
    assert tok.decode([256, *b"hi", 257, 258]) == "hi"  # specials are dropped
    assert tok.decode([0xC3]) == "\ufffd"  # truncated UTF-8 is replaced, not raised


def test_preset_tokenizer_matches_vocab() -> None:
    _, tokenizer, config = load_model("builtin:tiny-mha")
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.vocab_size == config.vocab_size
    assert config.eos_token_ids == tokenizer.eos_token_ids


def test_checkpoint_without_tokenizer_accepts_ids_only(tmp_path: Path) -> None:
    _, tokenizer, _ = load_model(str(make_tiny_hf_checkpoint(tmp_path, "mistral")))
    assert isinstance(tokenizer, IdsOnlyTokenizer)
    assert tokenizer.eos_token_ids == (EOS_ID,)
    assert tokenizer.decode([3, 14]) == "<3><14>"
    with pytest.raises(
        TokenizerUnavailableError, match=r"has no tokenizer files .*pass token ids instead"
    ):
        tokenizer.encode("hello")


def test_checkpoint_tokenizer_is_loaded(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = make_tiny_hf_checkpoint(tmp_path, "llama")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(path)

    _, tokenizer, _ = load_model(str(path))
    assert isinstance(tokenizer, HFTokenizer)
    text = "héllo wörld"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_ids == (EOS_ID, 256)  # config's eos, then the tokenizer's
    assert tokenizer.vocab_size == 257


def test_without_transformers_text_fails_only_when_encoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_tiny_hf_checkpoint(tmp_path, "mistral")
    (path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    _, tokenizer, _ = load_model(str(path))
    assert isinstance(tokenizer, IdsOnlyTokenizer)
    with pytest.raises(TokenizerUnavailableError, match=r"transformers is not importable"):
        tokenizer.encode("hello")
