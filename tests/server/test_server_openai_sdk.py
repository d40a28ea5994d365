"""The server as OpenAI's own Python SDK sees it, over real HTTP on loopback (uvicorn in a
thread): plain and streamed completions and chat equal the offline engine, string stop
sequences, n = 2 sharing the prompt's KV, logprobs, content parts, SGLang's /generate, the
API key, bounded admission, a client that disconnects mid-stream, and every error in
OpenAI's shape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.server import create_app
from kvcanary.server.background import background_server
from kvcanary.server.engine_loop import EngineLoop
from kvcanary.server.protocol import chat_prompt

MODEL = "builtin:tiny-swa"
CFG: dict[str, Any] = dict(model=MODEL, page_size=4, max_total_tokens=4096, max_context_len=256)
KEY = "sk-test-1234"
GREEDY = dict(max_tokens=24, extra_body={"ignore_eos": True})


class Live:
    """A running server: its URL, engine (read only through ``call``) and loop."""

    def __init__(self, url: str, engine: Engine, loop: EngineLoop) -> None:
        self.url, self.engine, self.loop = url, engine, loop

    def call(self, fn: Any) -> Any:
        return self.loop.call(fn).result(30)

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def _live(**kwargs: Any) -> Iterator[Live]:
    engine = Engine(EngineConfig(**{**CFG, **kwargs.pop("engine", {})}))
    app = create_app(engine, **kwargs)
    with background_server(app) as url:
        yield Live(url, engine, app.state.engine_loop)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    yield from _live(api_key=KEY, max_queued_requests=0, max_body_bytes=64 << 10,
                     engine=dict(max_running_requests=4))  # fmt: skip


@pytest.fixture(scope="module")
def offline() -> Engine:
    return Engine(EngineConfig(**CFG))


def _ref(offline: Engine, prompt: Any, max_new_tokens: int = 24) -> Any:
    return offline.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))[0]


def _clean_slice(text: str, length: int = 2) -> tuple[str, int]:
    """A stop string from ``text`` (no replacement chars, first occurrence past the start)."""
    for k in range(3, len(text) - length):
        s = text[k : k + length]
        if "\ufffd" not in s and text.find(s) == k:
            return s, k
    raise AssertionError(f"no usable stop string in {text!r}")


def _idle(live: Live) -> None:
    """Wait until the engine runs nothing; then its memory must check out."""
    deadline = time.monotonic() + 30
    while live.call(lambda: live.engine.queue_lengths()) != (0, 0):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    assert live.call(live.engine.check_integrity)


# ------------------------------------------------------------------ completions and chat
def test_completion_plain_and_streamed_equal_the_engine(live: Live, offline: Engine) -> None:
    ref = _ref(offline, "hello kv canary")
    client = live.client()
    plain = client.completions.create(model=MODEL, prompt="hello kv canary", **GREEDY)
    assert plain.choices[0].text == ref.text and plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 24
    chunks = list(client.completions.create(model=MODEL, prompt="hello kv canary", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 3  # it really streams
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_plain_streamed_and_content_parts(live: Live, offline: Engine) -> None:
    messages: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ref = _ref(offline, chat_prompt(messages))
    client = live.client()
    plain = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == ref.text
    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert client.chat.completions.create(model=MODEL, messages=parts, **GREEDY).choices[0].message.content == ref.text
    two = [messages[0], {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = [messages[0], {"role": "user", "content": "a\nb"}]
    assert (client.chat.completions.create(model=MODEL, messages=two, **GREEDY).choices[0].message.content
            == _ref(offline, chat_prompt(joined)).text)  # fmt: skip


def test_chat_uses_the_checkpoints_own_template(tmp_path: Any) -> None:
    from hf_fixtures import make_tiny_hf_checkpoint
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = make_tiny_hf_checkpoint(tmp_path, "llama")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    tok.save_pretrained(path)
    engine = Engine(EngineConfig(model=str(path), max_total_tokens=2048, max_context_len=256))
    app = create_app(engine)
    want = tok.encode("[system]be brief[user]hi[assistant]", add_special_tokens=False)
    with background_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(
            model=str(path), max_tokens=3, messages=[{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": "hi"}])  # fmt: skip
    assert out.usage is not None and out.usage.prompt_tokens == len(want)
    assert len(want) != len(chat_prompt([{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hi"}]))  # fmt: skip


# ------------------------------------------------------------------ stop, n, logprobs
def test_string_stop_cuts_the_text_and_frees_the_request(live: Live, offline: Engine) -> None:
    ref = _ref(offline, "stop here please", max_new_tokens=40)
    stop, k = _clean_slice(ref.text)
    client = live.client()
    for stops in (stop, ["\x00never", stop]):
        out = client.completions.create(model=MODEL, prompt="stop here please", stop=stops,
                                        max_tokens=40, extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == ref.text[:k]
        assert out.choices[0].finish_reason == "stop"
        assert out.usage is not None and out.usage.completion_tokens < 40
    chunks = list(client.completions.create(model=MODEL, prompt="stop here please", stop=stop, stream=True,
                                            max_tokens=40, extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == ref.text[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"
    _idle(live)


def test_n2_returns_two_choices_sharing_the_prompt_kv(live: Live, offline: Engine) -> None:
    prompt = "a prompt long enough to fill several KV pages for both choices"
    ref = _ref(offline, prompt)
    before = live.call(lambda: live.engine.stats.num_cached_prompt_tokens)
    out = live.client().completions.create(model=MODEL, prompt=prompt, n=2, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [ref.text, ref.text]
    assert out.usage is not None and out.usage.completion_tokens == 48
    assert out.usage.prompt_tokens == len(ref.prompt_ids)
    cached = live.call(lambda: live.engine.stats.num_cached_prompt_tokens) - before
    assert cached >= (len(ref.prompt_ids) - 1) // 4 * 4  # the second copy's prompt came from the cache
    seeded = live.client().completions.create(model=MODEL, prompt=prompt, n=2, temperature=1.0, seed=3,
                                              **GREEDY)  # fmt: skip
    assert seeded.choices[0].text != seeded.choices[1].text  # seed + i: the copies differ
    streamed = list(live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], n=2, stream=True, **GREEDY))
    by_choice = {0: "", 1: ""}
    for c in streamed:
        for ch in c.choices:
            by_choice[ch.index] += ch.delta.content or ""
    assert by_choice[0] == by_choice[1] != ""


def test_logprobs_completion_and_chat(live: Live) -> None:
    client = live.client()
    out = client.completions.create(model=MODEL, prompt="log me", max_tokens=5, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) >= 1 for t in lp.top_logprobs)  # 2 alternatives (fewer if they decode alike)
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()), abs=1e-6)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, logprobs=True, top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(c.top_logprobs) == 3 and c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6)
               for c in content)  # fmt: skip
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


# ------------------------------------------------------------------ SGLang /generate
def test_sglang_generate_text_ids_and_stream(live: Live, offline: Engine) -> None:
    ref = _ref(offline, "native api", max_new_tokens=12)
    headers = {"Authorization": f"Bearer {KEY}"}
    sp = {"max_new_tokens": 12, "ignore_eos": True}
    r = httpx.post(live.url + "/generate", json={"text": "native api", "sampling_params": sp}, headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == ref.text and body["output_ids"] == ref.output_ids
    assert body["meta_info"]["finish_reason"] == {"type": "length"}
    assert body["meta_info"]["prompt_tokens"] == len(ref.prompt_ids)
    r = httpx.post(live.url + "/generate", json={"input_ids": ref.prompt_ids, "sampling_params": sp},
                   headers=headers)  # fmt: skip
    assert r.json()["output_ids"] == ref.output_ids
    events = []
    with httpx.stream("POST", live.url + "/generate", headers=headers,
                      json={"text": "native api", "sampling_params": sp, "stream": True}) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == ref.text and last["output_ids"] == ref.output_ids  # cumulative
    assert len(events) > 3
    r = httpx.post(live.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 0}},
                   headers=headers)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.max_new_tokens"


# ------------------------------------------------------------------ key, admission, disconnect
def test_api_key_accepted_and_refused(live: Live) -> None:
    assert live.client().models.list().data[0].id == MODEL
    for bad in ("wrong", KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            live.client(api_key=bad).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 401
        err = e.value.response.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert set(err) == {"message", "type", "param", "code"}
    assert httpx.post(live.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401  # no header
    assert httpx.get(live.url + "/health").status_code == 200  # open without a key


def test_disconnect_aborts_and_full_server_answers_503(live: Live) -> None:
    _idle(live)
    aborted = live.loop.stats.num_aborted
    decoded = live.call(lambda: live.engine.stats.num_decode_tokens)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "long", "max_tokens": 200, "ignore_eos": True, "stream": True}
    step = live.engine.step

    def slow_step() -> Any:  # 200 tokens take >= 4 s: the streams outlive the checks below
        time.sleep(0.02)
        return step()

    live.engine.step = slow_step  # type: ignore[method-assign]
    try:
        _overload_then_disconnect(live, body, headers)
    finally:
        del live.engine.step  # the class's method again
    _idle(live)
    assert live.loop.stats.num_aborted - aborted == 4
    generated = live.call(lambda: live.engine.stats.num_decode_tokens) - decoded
    assert 4 <= generated < 4 * 200  # they started, and stopped early
    assert live.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).usage is not None


def _overload_then_disconnect(live: Live, body: dict[str, Any], headers: dict[str, str]) -> None:
    with httpx.Client(timeout=60) as c:
        streams = [c.stream("POST", live.url + "/v1/completions", json=body, headers=headers) for _ in range(4)]
        responses = [s.__enter__() for s in streams]
        lines = [resp.iter_lines() for resp in responses]  # kept: a dropped iterator disconnects
        for it in lines:  # every one is decoding: 4 running = --max-running-requests
            assert next(it).startswith("data: ")
        with pytest.raises(openai.APIStatusError) as e:
            live.client().completions.create(model=MODEL, prompt="one too many", max_tokens=2)
        assert e.value.status_code == 503
        assert e.value.response.headers["retry-after"] == "1"
        err = e.value.response.json()["error"]
        assert err["code"] == "server_overloaded" and "--max-queued-requests 0" in err["message"]
        for s in streams:  # the clients go away mid-stream
            s.__exit__(None, None, None)


# ------------------------------------------------------------------ error shapes
def _assert_shape(r: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == type_
    assert err["message"]
    return err


def test_every_error_is_in_openais_shape(live: Live) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.status_code == 400 and e.value.param == "max_tokens"  # type: ignore[attr-defined]
    err = _assert_shape(httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "temperature": True},
                                   headers=h), 400, "invalid_request_error")  # fmt: skip
    assert err["param"] == "temperature" and "temperature=true is invalid" in err["message"]
    _assert_shape(httpx.post(live.url + "/v1/completions", json={"prompt": "hi"}), 401, "authentication_error")
    err = _assert_shape(httpx.get(live.url + "/v1/nope", headers=h), 404, "not_found_error")
    assert "GET /v1/nope" in err["message"]
    r = httpx.get(live.url + "/v1/completions", headers=h)
    err = _assert_shape(r, 405, "invalid_request_error")
    assert r.headers["allow"] == "POST" and "allowed POST" in err["message"]
    big = {"prompt": "x" * (70 << 10)}
    err = _assert_shape(httpx.post(live.url + "/v1/completions", json=big, headers=h), 413,
                        "invalid_request_error")  # fmt: skip
    assert "allowed at most 65536" in err["message"]
    with pytest.raises(openai.NotFoundError):
        live.client().models.retrieve("nope")


def test_422_500_and_503_shapes() -> None:
    engine = Engine(EngineConfig(**CFG))

    def broken_step() -> list[Any]:
        raise RuntimeError("injected engine failure")

    engine.step = broken_step  # type: ignore[method-assign]
    app = create_app(engine)

    @app.get("/v1/typed/{count}")  # a framework-validated parameter
    async def typed(count: int) -> dict[str, int]:
        return {"count": count}

    with background_server(app) as url:
        err = _assert_shape(httpx.get(url + "/v1/typed/abc"), 422, "invalid_request_error")
        assert err["param"] == "count"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 500
        _assert_shape(e.value.response, 500, "server_error")
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
        err = _assert_shape(e.value.response, 503, "server_error")
        assert err["code"] == "engine_unavailable" and "injected engine failure" in err["message"]
