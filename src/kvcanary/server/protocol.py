"""The OpenAI-compatible request/response subset the server speaks.

``parse_completion`` turns a ``/v1/completions`` JSON body into a prompt and
:class:`SamplingParams`, raising :class:`BadRequest` (HTTP 400) that names the field, the
value and what is allowed. Range checks are SamplingParams' own; only the JSON types and
the OpenAI spellings are checked here. Unknown fields are ignored, as OpenAI clients send
many optional ones.

``parse_chat`` does the same for ``/v1/chat/completions``, joining ``messages`` with the
one fixed template of :func:`chat_prompt`.

Extensions to OpenAI's schema: ``top_k``, ``stop_token_ids``, ``ignore_eos`` in the request;
``choices[].token_ids`` in the response. ``temperature`` defaults to SamplingParams' 0
(greedy), not OpenAI's 1.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, fields
from typing import Any

from kvcanary.config import ConfigFieldError, SamplingParams
from kvcanary.engine.engine import Prompt, RequestOutput
from kvcanary.engine.errors import ContextLengthError

_SP_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
# SamplingParams field -> request field, where the OpenAI spelling differs.
_FIELD_NAMES = {"max_new_tokens": "max_tokens"}


class BadRequest(ValueError):
    """An HTTP 400: ``param`` is the offending request field (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def error_body(message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: Prompt
    params: SamplingParams


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _get(body: dict[str, Any], name: str, ok: Any, allowed: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not ok(value):
        raise BadRequest(f"{name}={value!r} is invalid: allowed {allowed}", name)
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
    shown = repr(prompt) if len(repr(prompt)) <= 80 else repr(prompt)[:77] + "..."
    hint = " (batched prompts are not supported: send one request per prompt)" if (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
    ) else ""  # fmt: skip
    raise BadRequest(f"prompt={shown} is invalid: allowed {allowed}{hint}", "prompt")


def _check_common(body: Any, served_model: str) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise BadRequest(f"model={model!r} is invalid: allowed {served_model!r} (or omit it)", "model")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported: allowed false (or omit it)", "stream")
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n={body['n']!r} is invalid: allowed 1 (or omit it)", "n")
    if body.get("stop") not in (None, [], ""):
        raise BadRequest(
            f"stop={body['stop']!r} is not supported: use stop_token_ids (a list of integer token ids)",
            "stop",
        )


def _parse_params(body: dict[str, Any]) -> SamplingParams:
    d = _SP_DEFAULTS
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(map(_is_int, v)),
                    "a list of integer token ids", d["stop_token_ids"])  # fmt: skip
    kwargs = dict(
        max_new_tokens=_get(body, "max_tokens", _is_int, "an integer >= 1", d["max_new_tokens"]),
        temperature=_get(body, "temperature", _is_number, "a number >= 0", d["temperature"]),
        top_p=_get(body, "top_p", _is_number, "a number in (0, 1]", d["top_p"]),
        top_k=_get(body, "top_k", _is_int, "an integer >= 0 (0 = off)", d["top_k"]),
        seed=_get(body, "seed", _is_int, "an integer or null", d["seed"]),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_get(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false",
                        d["ignore_eos"]),
    )  # fmt: skip
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise sampling_error(e) from None


def parse_completion(body: Any, served_model: str) -> CompletionRequest:
    _check_common(body, served_model)
    return CompletionRequest(_parse_prompt(body), _parse_params(body))


CHAT_ROLES = ("system", "user", "assistant")


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The one fixed chat template (built-in models have no template of their own)::

        system: You are terse.\nuser: hi\nassistant:
    """
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def parse_chat(body: Any, served_model: str) -> CompletionRequest:
    _check_common(body, served_model)
    messages = body.get("messages")
    allowed = f"a non-empty list of {{role: one of {CHAT_ROLES}, content: string}} objects"
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages={messages!r} is invalid: allowed {allowed}", "messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)):
            raise BadRequest(f"messages[{i}]={m!r} is invalid: allowed {allowed}", "messages")
    return CompletionRequest(chat_prompt(messages), _parse_params(body))


def sampling_error(e: ValueError) -> BadRequest:
    """SamplingParams' ``field=value is invalid: allowed ...`` in the request's spelling."""
    if not isinstance(e, ConfigFieldError):
        return BadRequest(str(e))
    name = _FIELD_NAMES.get(e.field, e.field)
    return BadRequest(f"{name}={e.value!r} is invalid: allowed {e.allowed}", name)


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


def completion_response(out: RequestOutput, model: str) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "text": out.text,
            "token_ids": list(out.output_ids),
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }],
        "usage": {
            "prompt_tokens": len(out.prompt_ids),
            "completion_tokens": len(out.output_ids),
            "total_tokens": len(out.prompt_ids) + len(out.output_ids),
        },
    }  # fmt: skip


def chat_response(out: RequestOutput, model: str) -> dict[str, Any]:
    body = completion_response(out, model)
    body["id"] = body["id"].replace("cmpl-", "chatcmpl-", 1)
    body["object"] = "chat.completion"
    body["choices"] = [{
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "token_ids": list(out.output_ids),
        "logprobs": None,
        "finish_reason": out.finish_reason,
    }]  # fmt: skip
    return body
