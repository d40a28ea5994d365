"""The OpenAI-compatible server on builtin:tiny-swa: outputs equal the offline engine's,
concurrent requests all complete, every bad input is a 400 naming its field (and the
server keeps serving), engine failures are 500s, /metrics carries the canary's counters."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from engine_utils import make_prompts
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.cli.command import main
from kvcanary.server import create_app
from kvcanary.server.protocol import chat_prompt

CFG: dict[str, Any] = dict(model="builtin:tiny-swa", page_size=4, max_total_tokens=4096,
                           max_context_len=256)  # fmt: skip
MODEL = CFG["model"]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = Engine(EngineConfig(**CFG, canary=CanaryConfig(mode="log")))
    with TestClient(create_app(engine)) as c:
        yield c


@pytest.fixture(scope="module")
def offline() -> Engine:
    return Engine(EngineConfig(**CFG))


def _complete(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_greedy_text_completion_equals_engine_generate(client: TestClient, offline: Engine) -> None:
    body = _complete(client, model=MODEL, prompt="hello kv canary", max_tokens=12)
    ref = offline.generate("hello kv canary", SamplingParams(max_new_tokens=12))[0]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["token_ids"] == ref.output_ids
    assert choice["text"] == ref.text
    assert choice["finish_reason"] == ref.finish_reason
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_ids),
                             "completion_tokens": len(ref.output_ids),
                             "total_tokens": len(ref.prompt_ids) + len(ref.output_ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def test_server_token_id_prompt_and_extensions(client: TestClient, offline: Engine) -> None:
    prompt = make_prompts(1, 20, 20, seed=5)[0]
    body = _complete(client, prompt=prompt, max_tokens=10, ignore_eos=True)
    ref = offline.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert body["choices"][0]["token_ids"] == ref.output_ids
    assert body["usage"]["prompt_tokens"] == 20
    # stop_token_ids: stop at the greedy output's third token.
    stop = ref.output_ids[2]
    body = _complete(client, prompt=prompt, max_tokens=10, stop_token_ids=[stop])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == ref.output_ids[: ref.output_ids.index(stop) + 1]
    # Seeded sampling is reproducible.
    sampled = [_complete(client, prompt=prompt, max_tokens=8, temperature=1.0, top_k=20, top_p=0.9,
                         seed=7)["choices"][0]["token_ids"] for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1] and len(sampled[0]) == 8


def test_server_concurrent_requests_equal_batched_offline_run(client: TestClient, offline: Engine) -> None:
    prompts = make_prompts(6, 10, 40, seed=3)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    expected = [o.output_ids for o in offline.generate(prompts, params)]
    results: dict[int, Any] = {}

    def worker(i: int) -> None:
        if i == len(prompts):  # a bad request among the good ones loses nothing for them
            results[i] = client.post("/v1/completions", json={"prompt": [1, 10_000], "max_tokens": 4})
        else:
            results[i] = client.post("/v1/completions",
                                     json={"prompt": prompts[i], "max_tokens": 16, "ignore_eos": True})

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts) + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[len(prompts)].status_code == 400
    for i, want in enumerate(expected):
        assert results[i].status_code == 200, results[i].text
        assert results[i].json()["choices"][0]["token_ids"] == want


BAD_INPUTS: list[tuple[Any, str | None, str]] = [
    ({}, "prompt", "prompt is required"),
    ({"prompt": 5}, "prompt", "prompt=5 is invalid"),
    ({"prompt": ""}, "prompt", "non-empty string"),
    ({"prompt": []}, "prompt", "non-empty list"),
    ({"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
    ({"prompt": [1, 2, 999]}, "prompt", "[999] out of range: allowed [0, 259)"),
    ({"prompt": "x" * 300}, "prompt", "allowed prompt tokens + max_tokens <= 256"),
    ({"prompt": "x" * 250, "max_tokens": 10}, "prompt", "max_tokens (10) exceeds max_context_len=256"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens=0 is invalid: allowed an integer >= 1"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", 'max_tokens="5" is invalid'),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens", "allowed an integer >= 1"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature=-1 is invalid: allowed a number >= 0"),
    ({"prompt": "hi", "temperature": True}, "temperature", "temperature=true is invalid"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p=0 is invalid: allowed a number in (0, 1]"),
    ({"prompt": "hi", "top_k": -3}, "top_k", "top_k=-3 is invalid"),
    ({"prompt": "hi", "seed": "s"}, "seed", 'seed="s" is invalid'),
    ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos", "allowed true or false"),
    ({"prompt": "hi", "stop_token_ids": [1, "a"]}, "stop_token_ids", "a list of integer token ids"),
    ({"prompt": "hi", "stop": ["\n", ""]}, "stop", "a list of at most 16 non-empty strings"),
    ({"prompt": "hi", "stop": 5}, "stop", "stop=5 is invalid"),
    ({"prompt": "hi", "stream": "yes"}, "stream", 'stream="yes" is invalid: allowed true or false'),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "stream_options.include_usage=1 is invalid"),
    ({"prompt": "hi", "n": 0}, "n", "n=0 is invalid: allowed an integer in [1, 16]"),
    ({"prompt": "hi", "n": 17}, "n", "n=17 is invalid"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs=21 is invalid: allowed null or an integer in [0, 20]"),
    ({"prompt": "hi", "logprobs": True}, "logprobs", "logprobs=true is invalid"),
    ({"prompt": "hi", "model": "gpt-4"}, "model", f'allowed "{MODEL}"'),
    ([1, 2], None, "must be a JSON object"),
    (b"{not json", None, "not valid JSON"),
]


@pytest.mark.parametrize("body,param,needle", BAD_INPUTS, ids=[f"bad{i}" for i in range(len(BAD_INPUTS))])
def test_server_bad_input_is_400_naming_the_field(client: TestClient, body: Any, param: str | None,
                                                  needle: str) -> None:  # fmt: skip
    if isinstance(body, bytes):
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert needle in err["message"]
    # The server keeps serving.
    assert _complete(client, prompt="ok", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_server_chat_completion(client: TestClient, offline: Engine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = offline.generate(chat_prompt(messages), SamplingParams(max_new_tokens=6))[0]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert body["choices"][0]["token_ids"] == ref.output_ids
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_server_health_models_and_metrics(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    _complete(client, prompt="metrics please", max_tokens=4)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "kvcanary_canary_enabled 1" in r.text
    samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples
               if not s.labels}  # fmt: skip
    assert samples["kvcanary_protected_tokens_total"] > 0
    assert samples["kvcanary_violations_recorded_total"] == 0
    assert samples["kvcanary_engine_generated_tokens_total"] >= 4
    assert samples["kvcanary_engine_running_requests"] == 0
    assert samples["kvcanary_engine_waiting_requests"] == 0


def test_server_engine_failure_is_500_and_health_503() -> None:
    engine = Engine(EngineConfig(**CFG))

    def broken_step() -> list[Any]:
        raise RuntimeError("injected engine failure")

    engine.step = broken_step  # type: ignore[method-assign]
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert "injected engine failure" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "hi"})  # the loop is down: unavailable
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert "injected engine failure" in r.json()["error"]["message"]
        assert c.get("/metrics").status_code == 200


def test_server_cli_rejects_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port=70000 is invalid" in capsys.readouterr().err


CHAT_BAD: list[tuple[Any, str, str]] = [
    ({"messages": []}, "messages", "messages=[] is invalid"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", 'messages[0]={"role": "robot"'),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content=5 is invalid"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", '("image_url" parts are not supported)'),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     'top_logprobs=2 is invalid without logprobs: allowed with "logprobs": true'),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs", "top_logprobs=30 is invalid"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_tokens", "max_tokens=0 is invalid"),
]


@pytest.mark.parametrize("body,param,needle", CHAT_BAD, ids=[f"chat{i}" for i in range(len(CHAT_BAD))])
def test_server_bad_chat_input_is_400_naming_the_field(client: TestClient, body: Any, param: str,
                                                       needle: str) -> None:  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


GENERATE_BAD: list[tuple[Any, str, str]] = [
    ({}, "text", "give exactly one of text"),
    ({"text": "a", "input_ids": [1]}, "text", "give exactly one of text"),
    ({"text": ""}, "text", 'text="" is invalid'),
    ({"input_ids": [1, "a"]}, "input_ids", "input_ids=[1, \"a\"] is invalid"),
    ({"text": "a", "sampling_params": []}, "sampling_params", "sampling_params=[] is invalid"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature",
     "sampling_params.temperature=-1 is invalid"),
    ({"text": "a", "sampling_params": {"stop": [1]}}, "sampling_params.stop", "sampling_params.stop=[1]"),
    ({"text": "a", "stream": 1}, "stream", "stream=1 is invalid"),
]


@pytest.mark.parametrize("body,param,needle", GENERATE_BAD, ids=[f"gen{i}" for i in range(len(GENERATE_BAD))])
def test_server_bad_generate_input_is_400_naming_the_field(client: TestClient, body: Any, param: str,
                                                           needle: str) -> None:  # fmt: skip
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_server_stream_rejected_prompt_is_a_400_before_streaming(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "x" * 300, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "allowed prompt tokens + max_tokens <= 256" in r.json()["error"]["message"]


def test_server_answers_while_warming_up_and_serves_once_warm() -> None:
    """Until the warm-up returns: /health says "starting", a servable request gets a 503
    with Retry-After (it never waits on a compile), a bad one its 400 at once; after it,
    the same requests are served."""
    release, started = threading.Event(), threading.Event()

    def warmup() -> None:
        started.set()
        assert release.wait(60)

    engine = Engine(EngineConfig(**CFG))
    with TestClient(create_app(engine, warmup=warmup)) as c:
        assert started.wait(10)
        health = c.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "starting"})
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "server_starting"
        bad = c.post("/v1/completions", json={"prompt": [1, 10**9], "max_tokens": 4})
        assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
        too_long = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 10**4})
        assert too_long.status_code == 400 and "max_context_len=256" in too_long.text
        assert engine.queue_lengths() == (0, 0)  # nothing was queued
        release.set()
        for _ in range(200):
            if c.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert c.get("/health").json() == {"status": "ok"}
        body = _complete(c, prompt=[1, 2, 3], max_tokens=4, ignore_eos=True)
        assert len(body["choices"][0]["token_ids"]) == 4
        assert c.post("/v1/completions", json={"prompt": [1, 10**9]}).status_code == 400


def test_server_starts_even_when_the_warm_up_fails() -> None:
    def warmup() -> None:
        raise RuntimeError("injected warm-up failure")

    with TestClient(create_app(Engine(EngineConfig(**CFG)), warmup=warmup)) as c:
        for _ in range(200):
            if c.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert c.get("/health").json() == {"status": "ok"}
        body = _complete(c, prompt=[4, 5], max_tokens=3, ignore_eos=True)
        assert len(body["choices"][0]["token_ids"]) == 3
