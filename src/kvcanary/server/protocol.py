"""The requests the server accepts: OpenAI's completions and chat completions (plain and
streamed), and SGLang's native ``/generate`` (answers: :mod:`kvcanary.server.responses`).

``parse_completion`` / ``parse_chat`` / ``parse_generate`` turn a JSON body into a
:class:`GenerateRequest`, raising :class:`BadRequest` (HTTP 400) that names the field, the
value (as JSON) and what is allowed. Range checks are SamplingParams' own; only the JSON
types and the spellings are checked here. Unknown fields are ignored, as OpenAI clients send
many optional ones.

Chat messages become a prompt through the checkpoint's own chat template when its tokenizer
has one (``Tokenizer.chat_template_ids``), else through the built-in :func:`chat_prompt`.
Message content is a string or a list of ``{"type": "text", "text": ...}`` parts.

Extensions to OpenAI's schema: ``top_k``, ``stop_token_ids``, ``ignore_eos`` in the request;
``choices[].token_ids`` in the response. ``temperature`` defaults to SamplingParams' 0
(greedy), not OpenAI's 1. ``n`` copies of a prompt share its KV (prefix cache); with a
``seed``, copy ``i`` samples with ``seed + i``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from kvcanary.config import MAX_LOGPROBS, ConfigFieldError, SamplingParams
from kvcanary.engine.engine import Prompt
from kvcanary.engine.errors import ContextLengthError
from kvcanary.model.tokenizer import Tokenizer
from kvcanary.utils import show

_SP_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
# SamplingParams field -> request field, where the OpenAI spelling differs.
_FIELD_NAMES = {"max_new_tokens": "max_tokens"}
MAX_N = 16
MAX_STOP = 16


class BadRequest(ValueError):
    """An HTTP 400: ``param`` is the offending request field (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:  # fmt: skip
    """OpenAI's error shape (every error the server answers has it)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    prompt: Prompt
    params: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False

    def copies(self) -> list[SamplingParams]:
        """The ``n`` copies' params (with a seed, copy ``i`` samples with ``seed + i``)."""
        seed = self.params.seed
        return [self.params if seed is None else replace(self.params, seed=seed + i)
                for i in range(self.n)]  # fmt: skip


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _shown(value: Any) -> str:
    text = show(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _get(body: dict[str, Any], name: str, ok: Callable[[Any], bool], allowed: str, default: Any,
         prefix: str = "") -> Any:  # fmt: skip
    value = body.get(name)
    if value is None:
        return default
    if not ok(value):
        raise BadRequest(f"{prefix}{name}={_shown(value)} is invalid: allowed {allowed}", prefix + name)
    return value


def _parse_prompt(body: dict[str, Any]) -> Prompt:
    allowed = "a non-empty string or a non-empty list of integer token ids"
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest(f"prompt is required: allowed {allowed}", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, str) and prompt:
        return prompt
    hint = " (batched prompts are not supported: send one request per prompt)" if (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
    ) else ""  # fmt: skip
    raise BadRequest(f"prompt={_shown(prompt)} is invalid: allowed {allowed}{hint}", "prompt")


def _check_model(body: Any, served_model: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise BadRequest(f"model={show(model)} is invalid: allowed {show(served_model)} (or omit it)",
                         "model")  # fmt: skip
    return body


def _parse_stop(body: dict[str, Any], prefix: str = "") -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP
            and all(isinstance(s, str) and s for s in stops)):  # fmt: skip
        raise BadRequest(f"{prefix}stop={_shown(stop)} is invalid: allowed a non-empty string or a "
                         f"list of at most {MAX_STOP} non-empty strings", prefix + "stop")  # fmt: skip
    return tuple(stops)


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", _is_bool, "true or false", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict),
                   'an object such as {"include_usage": true}', {})  # fmt: skip
    include = _get(options, "include_usage", _is_bool, "true or false", False, "stream_options.")
    return stream, include


def _sampling(kwargs: dict[str, Any], rename: dict[str, str] | None = None, prefix: str = "") -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise sampling_error(e, rename if rename is not None else _FIELD_NAMES, prefix) from None


def _parse_params(body: dict[str, Any], logprobs: int | None) -> SamplingParams:
    d = _SP_DEFAULTS
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(map(_is_int, v)),
                    "a list of integer token ids", d["stop_token_ids"])  # fmt: skip
    max_tokens = _get(body, "max_tokens", _is_int, "an integer >= 1", None)
    if max_tokens is None:  # the newer OpenAI spelling (chat)
        max_tokens = _get(body, "max_completion_tokens", _is_int, "an integer >= 1", d["max_new_tokens"])
    return _sampling(dict(
        max_new_tokens=max_tokens,
        temperature=_get(body, "temperature", _is_number, "a number >= 0", d["temperature"]),
        top_p=_get(body, "top_p", _is_number, "a number in (0, 1]", d["top_p"]),
        top_k=_get(body, "top_k", _is_int, "an integer >= 0 (0 = off)", d["top_k"]),
        seed=_get(body, "seed", _is_int, "an integer or null", d["seed"]),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_get(body, "ignore_eos", _is_bool, "true or false", d["ignore_eos"]),
        logprobs=logprobs,
    ))  # fmt: skip


def _parse_common(body: dict[str, Any], prompt: Prompt, logprobs: int | None) -> GenerateRequest:
    stream, include_usage = _parse_stream(body)
    n = _get(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]", 1)
    return GenerateRequest(prompt, _parse_params(body, logprobs), n, _parse_stop(body), stream,
                           include_usage)  # fmt: skip


def parse_completion(body: Any, served_model: str) -> GenerateRequest:
    body = _check_model(body, served_model)
    logprobs = _get(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                    f"null or an integer in [0, {MAX_LOGPROBS}]", None)  # fmt: skip
    return _parse_common(body, _parse_prompt(body), logprobs)


CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The built-in chat template (for models without one of their own)::

        system: You are terse.\\nuser: hi\\nassistant:
    """
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _message_text(i: int, m: Any) -> dict[str, str]:
    """``messages[i]`` as ``{role, content: str}``: text parts joined by newlines."""
    allowed = f"an object with role one of {show(CHAT_ROLES)} and content a string or a list of text parts"
    if not (isinstance(m, dict) and m.get("role") in CHAT_ROLES):
        raise BadRequest(f"messages[{i}]={_shown(m)} is invalid: allowed {allowed}", "messages")
    content = m.get("content")
    if isinstance(content, str):
        return {"role": m["role"], "content": content}
    if not isinstance(content, list) or not content:
        raise BadRequest(f"messages[{i}].content={_shown(content)} is invalid: allowed a string or "
                         'a non-empty list of {"type": "text", "text": "..."} parts', "messages")  # fmt: skip
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else None
            raise BadRequest(
                f"messages[{i}].content[{j}]={_shown(part)} is invalid: allowed text parts "
                f'{{"type": "text", "text": "..."}}' + (f" ({show(kind)} parts are not supported)"
                                                       if isinstance(kind, str) else ""), "messages",
            )  # fmt: skip
        texts.append(part["text"])
    return {"role": m["role"], "content": "\n".join(texts)}


def render_chat(messages: list[dict[str, str]], tokenizer: Tokenizer) -> Prompt:
    """The checkpoint's chat template (token ids) when it has one, else :func:`chat_prompt`."""
    templated = [{"role": "system" if m["role"] == "developer" else m["role"],
                  "content": m["content"]} for m in messages]  # fmt: skip
    ids = tokenizer.chat_template_ids(templated)
    return ids if ids is not None else chat_prompt(messages)


def parse_chat(body: Any, served_model: str, tokenizer: Tokenizer) -> GenerateRequest:
    body = _check_model(body, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages={_shown(messages)} is invalid: allowed a non-empty list of "
                         "{role, content} objects", "messages")  # fmt: skip
    texts = [_message_text(i, m) for i, m in enumerate(messages)]
    want = _get(body, "logprobs", _is_bool, "true or false", False)
    top = _get(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
               f"null or an integer in [0, {MAX_LOGPROBS}]", None)  # fmt: skip
    if top is not None and not want:
        raise BadRequest(f"top_logprobs={top} is invalid without logprobs: allowed with "
                         '"logprobs": true', "top_logprobs")  # fmt: skip
    return _parse_common(body, render_chat(texts, tokenizer), (top or 0) if want else None)


_GENERATE_SP = {"max_new_tokens": "max_new_tokens"}


def parse_generate(body: Any) -> GenerateRequest:
    """SGLang's ``POST /generate``: ``text`` or ``input_ids``, ``sampling_params``
    (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``stop_token_ids``,
    ``ignore_eos``, ``n``), ``stream``."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of text (a non-empty string) and input_ids (a non-empty "
                         "list of integer token ids)", "text")  # fmt: skip
    if text is not None and not (isinstance(text, str) and text):
        raise BadRequest(f"text={_shown(text)} is invalid: allowed a non-empty string", "text")
    if ids is not None and not (isinstance(ids, list) and ids and all(map(_is_int, ids))):
        raise BadRequest(f"input_ids={_shown(ids)} is invalid: allowed a non-empty list of integer "
                         "token ids", "input_ids")  # fmt: skip
    sp = _get(body, "sampling_params", lambda v: isinstance(v, dict), "an object", {})
    p, d = "sampling_params.", _SP_DEFAULTS
    stop_ids = _get(sp, "stop_token_ids", lambda v: isinstance(v, list) and all(map(_is_int, v)),
                    "a list of integer token ids", d["stop_token_ids"], p)  # fmt: skip
    params = _sampling(dict(
        max_new_tokens=_get(sp, "max_new_tokens", _is_int, "an integer >= 1", d["max_new_tokens"], p),
        temperature=_get(sp, "temperature", _is_number, "a number >= 0", d["temperature"], p),
        top_p=_get(sp, "top_p", _is_number, "a number in (0, 1]", d["top_p"], p),
        top_k=_get(sp, "top_k", _is_int, "an integer >= 0 (0 = off)", d["top_k"], p),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_get(sp, "ignore_eos", _is_bool, "true or false", d["ignore_eos"], p),
    ), _GENERATE_SP, p)  # fmt: skip
    n = _get(sp, "n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]", 1, p)
    stream = _get(body, "stream", _is_bool, "true or false", False)
    prompt: Prompt = text if isinstance(text, str) else [int(t) for t in ids or ()]
    return GenerateRequest(prompt, params, n, _parse_stop(sp, p), stream)


def sampling_error(e: ValueError, rename: dict[str, str] | None = None, prefix: str = "") -> BadRequest:
    """SamplingParams' ``field=value is invalid: allowed ...`` in the request's spelling."""
    if not isinstance(e, ConfigFieldError):
        return BadRequest(str(e))
    name = prefix + (rename if rename is not None else _FIELD_NAMES).get(e.field, e.field)
    return BadRequest(f"{name}={show(e.value)} is invalid: allowed {e.allowed}", name)


def engine_error(e: Exception) -> BadRequest:
    """An ``Engine.add_request`` rejection, mapped by type: all concern the prompt, or the
    prompt and max_tokens together (:class:`ContextLengthError`, in the request's terms)."""
    if isinstance(e, ContextLengthError):
        return BadRequest(
            f"prompt ({e.prompt_len}) + max_tokens ({e.max_new_tokens}) exceeds "
            f"max_context_len={e.limit}: allowed prompt tokens + max_tokens <= {e.limit}",
            "prompt",
        )
    return BadRequest(str(e), "prompt")
