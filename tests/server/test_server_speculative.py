"""The server with speculative decoding on (ngram; a draft model with its own canary), as
OpenAI's Python SDK sees it over real HTTP on loopback: completions (plain and streamed),
chat and concurrent requests equal plain greedy decoding of the offline engine, the
canaries stay silent, and /metrics carries the draft canary's samples."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.config import CanaryConfig, SpeculativeConfig
from kvcanary.server import create_app
from kvcanary.server.background import background_server
from kvcanary.server.protocol import chat_prompt

MODEL = "builtin:tiny-swa"
CFG: dict[str, Any] = dict(model=MODEL, page_size=4, max_total_tokens=4096, max_context_len=256,
                           max_running_requests=4)  # fmt: skip
GREEDY = dict(max_tokens=32, extra_body={"ignore_eos": True})
SPECS = {
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    "draft": SpeculativeConfig(method="draft", num_speculative_tokens=3,
                               draft_model="builtin:tiny-mha"),  # fmt: skip
}
PROMPTS = ["hello kv canary " * 3, "the cat sat on the mat and the cat sat on the",
           "abc abc abc abc", "speculative decoding keeps greedy outputs"]  # fmt: skip


@pytest.fixture(scope="module")
def offline() -> Engine:
    return Engine(EngineConfig(**CFG))


@pytest.fixture(scope="module", params=list(SPECS))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Engine, Any]]:
    engine = Engine(EngineConfig(**CFG, speculative=SPECS[request.param],
                                 canary=CanaryConfig(mode="log", verify_tokens=True)))  # fmt: skip
    app = create_app(engine)
    with background_server(app) as url:
        yield url, engine, app.state.engine_loop


def _ref(offline: Engine, prompt: Any) -> str:
    return offline.generate(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True))[0].text


def test_outputs_equal_plain_greedy_decoding_and_the_canaries_stay_silent(
    served: tuple[str, Engine, Any], offline: Engine,
) -> None:  # fmt: skip
    url, engine, loop = served

    def call(fn: Any) -> Any:  # on the engine loop's thread
        return loop.call(fn).result(30)

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    refs = [_ref(offline, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: one batch of verifies
        texts = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, **GREEDY)
                              .choices[0].text, PROMPTS))  # fmt: skip
    assert texts == refs
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == refs[1]
    messages: list[Any] = [{"role": "user", "content": "abc abc abc"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert chat.choices[0].message.content == _ref(offline, chat_prompt(messages))
    deadline = time.monotonic() + 30
    while call(engine.queue_lengths) != (0, 0):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    st = engine.stats
    assert st.spec_num_proposed > st.spec_num_accepted >= 0  # drafts made, some rejected
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               for s in f.samples}  # fmt: skip
    assert metrics[("kvcanary_canary_enabled", ())] == 1
    pools = {dict(labels).get("pool") for (name, labels) in metrics
             if name == "kvcanary_verify_entries_total"}  # fmt: skip
    if engine.draft_canary is not None:
        assert pools == {"target", "draft"}
        assert metrics[("kvcanary_violations_recorded_total", (("pool", "draft"),))] == 0
        assert engine.draft_canary.stats()["verify_entries"] > 0
    else:
        assert pools == {None}
    assert all(len(c.violations) == 0 for c in engine.canaries)
    assert call(engine.check_integrity)
