"""`tinyvllm serve`'s API through the official `openai` client, against a server on a free
loopback port over a tiny random Llama: models, completions, chat (streamed and whole),
usage, n, stop strings, logprobs, tokenize, metrics, auth, error statuses, disconnects."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
# The HTTP client the openai package is built on (httpx, or httpx2 in newer releases).
try:
    import httpx
except ImportError:
    httpx = pytest.importorskip("httpx2")

from server_helpers import ServerThread, wait_engine_clean  # noqa: E402

from tinyvllm.engine.async_llm import AsyncLLM  # noqa: E402
from tinyvllm.server.app import build_app  # noqa: E402
from tinyvllm.server.serving import ServerState  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def engine(tiny_models: Any, one_torch_thread: None) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(str(tiny_models["llama"]), dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


def _state(engine: AsyncLLM, api_key: str | None = None) -> ServerState:
    return ServerState(
        engine=engine,
        model_names=[MODEL],
        model_path=engine.engine.config.model.model_path,
        api_key=api_key,
    )


@pytest.fixture(scope="module")
def server(engine: AsyncLLM) -> Iterator[ServerThread]:
    with ServerThread(build_app(_state(engine))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def _engine_clean_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        wait_engine_clean(request.getfixturevalue("engine").engine)


def test_models_lists_the_served_name(client: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_completion_text_and_usage(client: Any, engine: AsyncLLM) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, **GREEDY)
    prompt_ids = engine.get_tokenizer().encode("Once upon a time")
    assert out.object == "text_completion"
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(prompt_ids) + 7
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text


def test_chat_stream_reassembles_to_the_whole_answer(client: Any) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    # The usage chunk comes last, with no choices, and matches the whole answer's.
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens == 12


def test_streamed_n_logprobs_and_usage(client: Any) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
    whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            **kwargs, logprobs=True, top_logprobs=2, stream=True, **GREEDY
        )
    )
    streamed = [
        t.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert streamed == [t.token for t in whole.choices[0].logprobs.content]
    sampled = client.chat.completions.create(
        **kwargs, n=2, temperature=1.0, seed=5, stream=True, extra_body={"ignore_eos": True}
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in sampled:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["length", "length"] and all(texts)
    events = list(
        client.completions.create(
            model=MODEL,
            prompt=["one", "two"],
            max_tokens=3,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 6
    by_index = ["", ""]
    for e in events[:-1]:
        by_index[e.choices[0].index] += e.choices[0].text
    assert by_index[0].startswith("one") and by_index[1].startswith("two")


def test_max_completion_tokens_wins_over_max_tokens(client: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=3, **GREEDY
    )
    assert out.usage.completion_tokens == 3


def test_n_two_gives_two_choices(client: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    # Completions number choices prompt by prompt.
    out = client.completions.create(
        model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=2, temperature=1.0, seed=1
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]


def test_stop_string_cuts_the_text(client: Any) -> None:
    full = client.completions.create(model=MODEL, prompt="The sea", max_tokens=24, **GREEDY)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {text!r}"
    cut = client.completions.create(
        model=MODEL, prompt="The sea", max_tokens=24, stop=[stop], **GREEDY
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs(client: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for tok in content:
        assert len(tok.top_logprobs) == 3
        values = [t.logprob for t in tok.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert tok.logprob == pytest.approx(values[0]) and tok.logprob <= 0


def test_completion_logprobs(client: Any) -> None:
    out = client.completions.create(
        model=MODEL, prompt="The sea", max_tokens=4, logprobs=2, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text


def test_echo_token_ids_and_prompt_logprobs(client: Any, engine: AsyncLLM) -> None:
    ids = engine.get_tokenizer().encode("The sea is wide")
    out = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=2,
        echo=True,
        extra_body={"prompt_logprobs": 1, "ignore_eos": True},
        temperature=0.0,
    )
    choice = out.choices[0]
    assert choice.text.startswith(engine.get_tokenizer().decode(ids))
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for tok, entry in zip(ids[1:], prompt_logprobs[1:], strict=True):
        assert str(tok) in entry and entry[str(tok)]["logprob"] <= 0


def test_tokenize_detokenize_version_health(server: ServerThread, engine: AsyncLLM) -> None:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "hello sea"}).json()
    assert ids["tokens"] == engine.get_tokenizer().encode("hello sea")
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()
    assert text["prompt"] == engine.get_tokenizer().decode(ids["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > ids["count"]
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_exposition(client: Any, server: ServerThread, engine: AsyncLLM) -> None:
    client.completions.create(model=MODEL, prompt="x y z", max_tokens=3, **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-z_]+="[^"]*",?)*\})? \S+$')
    samples = {}
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or sample.match(line), line
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    label = f'{{model_name="{MODEL}"}}'
    stats = engine.get_stats()
    assert samples[f"tinyvllm:generation_tokens_total{label}"] == stats.total_generation_tokens
    assert samples[f"tinyvllm:prompt_tokens_total{label}"] == stats.total_prompt_tokens > 0
    assert samples[f"tinyvllm:num_requests_running{label}"] == 0
    assert f"tinyvllm:prefix_cache_hits_total{label}" in samples
    assert f"tinyvllm:kv_cache_usage_perc{label}" in samples
    count = samples[f"tinyvllm:time_to_first_token_seconds_count{label}"]
    assert count >= 1
    assert (
        samples[f'tinyvllm:time_to_first_token_seconds_bucket{{model_name="{MODEL}",le="+Inf"}}']
        == count
    )
    assert samples[f"tinyvllm:inter_token_latency_seconds_count{label}"] >= 2
    assert "# TYPE tinyvllm:inter_token_latency_seconds histogram" in text


def test_api_key(engine: AsyncLLM) -> None:
    with ServerThread(build_app(_state(engine, api_key="s3cret"))) as server:
        base = server.url + "/v1"
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=base, api_key=key or "x", max_retries=0)
            if not key:
                bad = bad.with_options(default_headers={"Authorization": ""})
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        good = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == MODEL


def test_server_chat_template(engine: AsyncLLM) -> None:
    state = _state(engine)
    state.chat_template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    with ServerThread(build_app(state)) as server:
        body = {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}
        out = httpx.post(server.url + "/tokenize", json=body).json()
    assert out["tokens"] == engine.get_tokenizer().encode("<hi>", add_special_tokens=False)


@pytest.mark.parametrize(
    "template",
    [
        "{{ 1 / 0 }}",  # Python errors inside template code, not only Jinja's own
        "{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
        "{{ raise_exception('roles must alternate') }}",
        "{% for m in messages %}{{ m.content | int(1, 2, 3) }}{% endfor %}",
    ],
)
def test_failing_chat_template_is_a_400_sparing_others(client: Any, template: str) -> None:
    """A request whose template fails on rendering gets a 400 in OpenAI's shape while a
    request streaming at the same time finishes with the text it gives alone."""
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, **GREEDY}
    alone = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(**kwargs, stream=True)
    texts = [c.choices[0].delta.content or "" for c in itertools.islice(stream, 3)]
    with pytest.raises(openai.BadRequestError, match="chat template failed") as failed:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"chat_template": template}
        )
    assert failed.value.body["param"] == "messages"
    texts += [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(texts) == alone


def _error(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_error_statuses(client: Any, server: ServerThread) -> None:
    url = server.url + "/v1/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in _error(bad_json)["message"]
    unknown = httpx.post(url, json={"messages": MESSAGES, "temprature": 0.5})
    assert unknown.status_code == 400 and "temprature" in _error(unknown)["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt=list(range(5, 5 + MAX_MODEL_LEN + 10)))
    message = too_long.value.body["message"]
    assert str(MAX_MODEL_LEN + 10) in message and str(MAX_MODEL_LEN) in message
    with pytest.raises(openai.BadRequestError) as bad_top_p:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_p=2.0)
    assert bad_top_p.value.body["param"] == "top_p" and "top_p" in bad_top_p.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    with pytest.raises(openai.BadRequestError) as bad_top:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=21
        )
    assert bad_top.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=0)
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="text-only and cannot take image"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model=MODEL, input="hello")
    # A streaming request the engine refuses still gets its status before any event.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=MODEL, prompt=list(range(5, 5 + MAX_MODEL_LEN + 10)), stream=True
        )
    # The server keeps serving after all that.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices


def _pause_engine(engine: AsyncLLM, seconds: float) -> None:
    """Hold the engine thread between steps, so a request cannot finish before the client
    has hung up (the tiny model makes hundreds of tokens in a fraction of a second)."""
    engine._call(lambda _: time.sleep(seconds))


def _settle(engine: AsyncLLM) -> None:
    """Wait until the engine thread has applied every command posted so far (a no-op call
    queued behind them has run), then until it is clean."""
    engine._call(lambda _: None).result(timeout=30)
    wait_engine_clean(engine.engine, timeout=10)


def _check_stream_disconnect(
    url: str, engine: AsyncLLM, headers: dict[str, str], prompts: list[str] | None = None
) -> None:
    prompts = prompts or ["a long story"]
    max_tokens = MAX_MODEL_LEN - 10
    body = {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    before = engine.get_stats()
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        _pause_engine(engine, 0.5)
    _settle(engine)
    after = engine.get_stats()
    assert after.num_finished_requests == before.num_finished_requests + len(prompts)
    # Aborted within a step or two of the hang-up, far from their max_tokens.
    generated = after.total_generation_tokens - before.total_generation_tokens
    assert generated < len(prompts) * max_tokens // 2


def test_stream_disconnect_aborts_at_once(server: ServerThread, engine: AsyncLLM) -> None:
    _check_stream_disconnect(server.url, engine, {})


def test_batched_stream_disconnect_aborts_every_prompt(
    server: ServerThread, engine: AsyncLLM
) -> None:
    _check_stream_disconnect(server.url, engine, {}, ["one story", "another story", "a third"])


def test_stream_disconnect_aborts_behind_the_api_key(engine: AsyncLLM) -> None:
    with ServerThread(build_app(_state(engine, api_key="k"))) as server:
        _check_stream_disconnect(server.url, engine, {"Authorization": "Bearer k"})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_hang_up_before_the_first_token_aborts(
    server: ServerThread, engine: AsyncLLM, stream: bool
) -> None:
    max_tokens = MAX_MODEL_LEN - 5
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    before = engine.get_stats()
    _pause_engine(engine, 2.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    _settle(engine)
    # The hang-up cancelled the request while it was still queued for the paused engine
    # thread: it never ran, rather than being aborted at its first token (or its last).
    after = engine.get_stats()
    assert after.total_generation_tokens == before.total_generation_tokens
    assert after.num_finished_requests == before.num_finished_requests
