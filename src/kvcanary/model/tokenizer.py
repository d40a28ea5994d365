"""Tokenizers behind one small interface: ``encode``, ``decode``, ``eos_token_ids``, ``vocab_size``.

* :class:`ByteTokenizer` -- presets: UTF-8 bytes are ids 0..255, specials follow.
* :class:`HFTokenizer` -- a checkpoint directory's own tokenizer via transformers.
* :class:`IdsOnlyTokenizer` -- a checkpoint without tokenizer files (or without
  transformers): token-id prompts still work; encoding text raises
  :class:`TokenizerUnavailableError` saying why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class TokenizerUnavailableError(RuntimeError):
    """Text was given to a model that has no usable tokenizer."""


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_template_ids(self, messages: list[dict[str, str]]) -> list[int] | None:
        """``messages`` (``{"role", "content"}``) rendered by the checkpoint's own chat
        template with the assistant's turn opened, as token ids; None: it has no template."""
        ...


class ByteTokenizer:
    """Byte-level tokenizer: ``encode`` adds no specials; ``decode`` drops them.

    ::

        ids 0..255  the UTF-8 bytes     256 BOS     257 EOS     258 PAD
    """

    num_bytes = 256
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258

    @property
    def vocab_size(self) -> int:
        return self.num_bytes + 3

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < self.num_bytes).decode("utf-8", errors="replace")

    def chat_template_ids(self, messages: list[dict[str, str]]) -> list[int] | None:
        return None


class HFTokenizer:
    """A transformers tokenizer; ``encode`` uses its default special tokens (e.g. BOS),
    ``decode`` skips special tokens."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self._tok = hf_tokenizer
        ids = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.append(int(hf_tokenizer.eos_token_id))
        self._eos_token_ids = tuple(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def chat_template_ids(self, messages: list[dict[str, str]]) -> list[int] | None:
        if not self._tok.chat_template:
            return None
        out = self._tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5: a dict
        return [int(t) for t in ids]


class IdsOnlyTokenizer:
    """Stand-in when no tokenizer can be loaded. ``decode`` renders ids as ``<id>``."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], reason: str) -> None:
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self.reason = reason

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    def encode(self, text: str) -> list[int]:
        raise TokenizerUnavailableError(
            f"cannot encode text: {self.reason}; pass token ids instead"
        )

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def chat_template_ids(self, messages: list[dict[str, str]]) -> list[int] | None:
        return None


def load_hf_tokenizer(model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> Tokenizer:
    """The directory's own tokenizer, or an :class:`IdsOnlyTokenizer` explaining why not."""
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        reason = f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
        return IdsOnlyTokenizer(vocab_size, eos_token_ids, reason)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        reason = f"transformers is not importable ({exc}); install kvcanary[hf]"
        return IdsOnlyTokenizer(vocab_size, eos_token_ids, reason)
    return HFTokenizer(AutoTokenizer.from_pretrained(str(model_dir)), eos_token_ids)
