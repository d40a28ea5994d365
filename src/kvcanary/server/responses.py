r"""The answers the server gives, in OpenAI's (completions, chat, their stream chunks'
fields) and SGLang's (``/generate``) shapes, built from finished :class:`RequestOutput`\ s.

``usage`` counts the prompt once for ``n`` choices (as OpenAI does); ``logprobs`` are
rendered per API: the completions API's legacy ``{tokens, token_logprobs, top_logprobs,
text_offset}`` and the chat API's ``{content: [{token, logprob, bytes, top_logprobs}]}``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvcanary.engine.engine import RequestOutput
from kvcanary.engine.request import TokenLogprob

Decode = Callable[[Sequence[int]], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stream_chunker(
    id_prefix: str, object_name: str, model: str, include_usage: bool
) -> Callable[..., dict[str, Any]]:
    """``chunk(choices, **extra)``: one SSE chunk of a stream, all sharing one id and
    creation time; with ``stream_options.include_usage`` every chunk carries ``usage``
    (None until the final one)."""
    cid, now = new_id(id_prefix), int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": cid, "object": object_name, "created": now, "model": model,
               "choices": choices, **extra}  # fmt: skip
        if include_usage:
            out.setdefault("usage", None)
        return out

    return chunk


def usage(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The prompt counts once (as OpenAI counts it for ``n`` choices)."""
    prompt = len(outs[0].prompt_ids)
    completion = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_prompt_tokens}}  # fmt: skip


def completion_logprobs(lps: Sequence[TokenLogprob] | None, decode: Decode,
                        offset: int = 0) -> dict[str, Any] | None:  # fmt: skip
    """The completions API's (legacy) logprobs object; ``offset``: text already sent."""
    if lps is None:
        return None
    tokens = [decode([lp.token]) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{decode([t]): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: Sequence[TokenLogprob] | None, decode: Decode) -> dict[str, Any] | None:
    if lps is None:
        return None

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}  # fmt: skip


def completion_response(outs: Sequence[RequestOutput], model: str, decode: Decode) -> dict[str, Any]:
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": i,
            "text": out.text,
            "token_ids": list(out.output_ids),
            "logprobs": completion_logprobs(out.logprobs, decode),
            "finish_reason": out.finish_reason,
        } for i, out in enumerate(outs)],
        "usage": usage(outs),
    }  # fmt: skip


def chat_response(outs: Sequence[RequestOutput], model: str, decode: Decode) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": i,
            "message": {"role": "assistant", "content": out.text},
            "token_ids": list(out.output_ids),
            "logprobs": chat_logprobs(out.logprobs, decode),
            "finish_reason": out.finish_reason,
        } for i, out in enumerate(outs)],
        "usage": usage(outs),
    }  # fmt: skip


def generate_response(rid: str, text: str, output_ids: Sequence[int], finish_reason: str | None,
                      out: RequestOutput | None = None) -> dict[str, Any]:  # fmt: skip
    """SGLang's ``/generate`` answer for one output; streamed, the text and ids so far (and
    no prompt figures until ``out``, the finished output, is known)."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": {"type": finish_reason} if finish_reason else None,
                            "completion_tokens": len(output_ids)}  # fmt: skip
    if out is not None:
        meta.update(prompt_tokens=len(out.prompt_ids), cached_tokens=out.num_cached_prompt_tokens)
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}
