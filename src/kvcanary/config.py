"""Frozen configuration dataclasses: the one source of truth for defaults.

The CLI reads its defaults from these classes. Every invalid value raises
``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvcanary.canary.config import CanaryConfig
from kvcanary.utils import show

__all__ = ["CanaryConfig", "EngineConfig", "SamplingParams", "SpeculativeConfig"]

DTYPES = ("float32", "bfloat16", "float16")
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
SPECULATIVE_METHODS = ("none", "ngram", "draft")
# `kvcanary serve`: requests that may wait beyond max_running_requests (more get HTTP 503).
DEFAULT_MAX_QUEUED_REQUESTS = 256


class ConfigFieldError(ValueError):
    """An invalid field value: ``field``, ``value`` and what is ``allowed`` (the message
    reads ``field=value is invalid: allowed ...``)."""

    def __init__(self, field: str, value: Any, allowed: str):
        super().__init__(f"{field}={show(value)} is invalid: allowed {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigFieldError(field, value, allowed)


def _flag(flag: str, help: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A field's metadata: its command-line flag (see :func:`kvcanary.engine.args.add_dataclass_flags`)."""
    return {"flag": flag, "help": help, "choices": choices}


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (greedy-exact): each decode step a proposer drafts up to
    ``num_speculative_tokens`` tokens per greedy request, one target forward verifies them
    all and keeps the longest prefix that matches its own argmax plus one token of its own
    (``kvcanary.engine.speculative``). Errors name the flag and the field."""

    method: str = field(default="none", metadata=_flag(
        "--speculative-method", choices=SPECULATIVE_METHODS,
        help="speculative decoding of greedy requests: none; ngram (prompt lookup: the tokens "
             "that followed the latest earlier occurrence of the sequence's last n tokens); "
             "draft (a smaller model, --speculative-draft-model) (default: %(default)s)"))  # fmt: skip
    num_speculative_tokens: int = field(default=4, metadata=_flag(
        "--num-speculative-tokens",
        help="draft tokens proposed per request and step (K) (default: %(default)s)"))
    # 3 / 5: short suffixes match by chance and every wrong draft costs a verify step
    # (benchmarks/HISTORY.md, 2026-12-06); vLLM's prompt lookup defaults to 5 / 5.
    ngram_min: int = field(default=3, metadata=_flag(
        "--speculative-ngram-min",
        help="ngram: shortest suffix looked up (default: %(default)s)"))
    ngram_max: int = field(default=5, metadata=_flag(
        "--speculative-ngram-max",
        help="ngram: longest suffix looked up, tried first (default: %(default)s)"))
    draft_model: str = field(default="", metadata=_flag(
        "--speculative-draft-model",
        help="draft: a builtin preset or HF model directory sharing the target's vocab size "
             "(default: none)"))  # fmt: skip

    def __post_init__(self) -> None:
        _spec_check(self.method in SPECULATIVE_METHODS, "method", self.method,
                    f"one of {show(SPECULATIVE_METHODS)}")  # fmt: skip
        for name, low in (("num_speculative_tokens", 1), ("ngram_min", 1), ("ngram_max", 1)):
            value = getattr(self, name)
            _spec_check(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                        name, value, f"an integer >= {low}")  # fmt: skip
        _spec_check(self.ngram_max >= self.ngram_min, "ngram_max", self.ngram_max,
                    f"an integer >= ngram_min ({self.ngram_min})")  # fmt: skip
        _spec_check(isinstance(self.draft_model, str), "draft_model", self.draft_model,
                    "a builtin preset or a HF model directory")  # fmt: skip
        if self.method == "draft":
            _spec_check(bool(self.draft_model), "draft_model", self.draft_model,
                        "a builtin preset or a HF model directory while the method is \"draft\"")  # fmt: skip
        elif self.draft_model:
            _spec_check(False, "draft_model", self.draft_model,
                        f"only \"\" while the method is {show(self.method)} (pick \"draft\")")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def _spec_check(ok: bool, name: str, value: Any, allowed: str) -> None:
    """A :class:`SpeculativeConfig` error naming the flag and the field
    (``--speculative-method (speculative.method)='x' is invalid: allowed ...``)."""
    if not ok:
        flag = next(f for f in fields(SpeculativeConfig) if f.name == name).metadata["flag"]
        raise ConfigFieldError(f"{flag} (speculative.{name})", value, allowed)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "builtin:tiny-swa"
    page_size: int = 4
    # Tokens in the full KV pool (the logical index space). The SWA pool holds
    # floor_page(max_total_tokens * swa_full_tokens_ratio) tokens.
    max_total_tokens: int = 16384
    swa_full_tokens_ratio: float = 0.25
    max_running_requests: int = 64
    max_context_len: int | None = None  # None: the model's max_position_embeddings
    chunked_prefill_size: int = 512  # tokens per extend forward; <= 0 disables chunking
    enable_prefix_cache: bool = True
    # Retracted requests keep their KV in host memory and reload it on resume
    # (instead of recomputing it).
    enable_host_offload: bool = False
    # Decode batch-size buckets of the graph runner; () disables it (plain eager decode).
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # Deterministic sampler for tests: next token = splitmix64(rid ^ position) % vocab.
    token_oracle: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    # The KV canary: what it checks and does on a violation (default: mode "none", nothing
    # is installed); see kvcanary.canary.config.CanaryConfig.
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    # Speculative decoding of greedy requests (default: method "none", off).
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and bool(self.model), "model", self.model,
               "\"builtin:tiny-mha\", \"builtin:tiny-swa\", \"builtin:tiny-swa-all\", \"builtin:tiny-dsv4\", "
               "\"builtin:qwen3-0.6b-shape\" or a HF model directory")
        _check(self.page_size >= 1, "page_size", self.page_size, "an integer >= 1")
        _check(self.max_total_tokens >= 2 * self.page_size, "max_total_tokens",
               self.max_total_tokens, f">= 2 * page_size ({2 * self.page_size})")
        _check(0.0 < self.swa_full_tokens_ratio <= 1.0, "swa_full_tokens_ratio",
               self.swa_full_tokens_ratio, "a number in (0, 1]")
        _check(self.max_running_requests >= 1, "max_running_requests",
               self.max_running_requests, "an integer >= 1")
        _check(self.max_context_len is None or self.max_context_len >= 2, "max_context_len",
               self.max_context_len, "None or an integer >= 2")
        _check(all(b >= 1 for b in self.graph_batch_sizes)
               and list(self.graph_batch_sizes) == sorted(set(self.graph_batch_sizes)),
               "graph_batch_sizes", self.graph_batch_sizes,
               "strictly increasing positive integers, or () to disable")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {show(DTYPES)}")
        _check(isinstance(self.canary, CanaryConfig), "canary", self.canary,
               "a kvcanary.canary.config.CanaryConfig")
        _check(isinstance(self.speculative, SpeculativeConfig), "speculative", self.speculative,
               "a kvcanary.config.SpeculativeConfig")
        _check(isinstance(self.device, str) and bool(self.device), "device", self.device,
               "a torch device string such as 'cpu' or 'cuda:0'")

    @classmethod
    def field_default(cls, name: str) -> Any:
        f = next(f for f in fields(cls) if f.name == name)
        if f.default is MISSING and callable(f.default_factory):
            return f.default_factory()
        return f.default


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator seed (sampling only)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities of each sampled token plus its `logprobs` most likely alternatives
    # (None: not computed, no cost).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "a number >= 0")
        _check(self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 = off)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a number in (0, 1]")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               self.logprobs, f"null or an integer in [0, {MAX_LOGPROBS}]")  # fmt: skip
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
