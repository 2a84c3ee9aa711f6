"""The server in front of a pooling engine: with a stand-in for the engine, /v1/embeddings'
shapes through the official client (which asks for base64 by default and decodes it), batching,
errors, and generation refused with a 400; then real pooling engines started as `tinyvllm serve`
starts them (auto-detected BERT, `--runner pooling` on a decoder), with their /metrics."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server_helpers import ServerThread, served_state  # noqa: E402

from tinyvllm.server.app import build_app  # noqa: E402
from tinyvllm.server.serving import ServerState  # noqa: E402

MAX_LEN = 16


class FakePoolingEngine:
    """Answers `embed` like AsyncLLM on a pooling model: one vector per prompt, derived from
    its token ids (one id per character here), so every input gets a distinct answer."""

    def __init__(self) -> None:
        config = SimpleNamespace(model=SimpleNamespace(max_model_len=MAX_LEN, vocab_size=256))
        self.engine = SimpleNamespace(runner_type="pooling", config=config)
        self.calls: list[dict[str, Any]] = []
        self.is_running = True

    async def embed(self, prompt: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else [ord(c) for c in prompt]
        if len(ids) > MAX_LEN and kwargs["truncate_prompt_tokens"] is None:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than {MAX_LEN}")
        vector = [float(len(ids)), float(sum(ids)), 0.5]
        if kwargs["normalize"] is not False:
            norm = math.sqrt(sum(v * v for v in vector))
            vector = [v / norm for v in vector]
        return SimpleNamespace(outputs=SimpleNamespace(embedding=vector), prompt_token_ids=ids)


@pytest.fixture(scope="module")
def fake() -> FakePoolingEngine:
    return FakePoolingEngine()


@pytest.fixture(scope="module")
def server(fake: FakePoolingEngine) -> Iterator[ServerThread]:
    state = ServerState(engine=fake, model_names=["embedder"], model_path="fake")
    with ServerThread(build_app(state)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_health_follows_the_engine(server: ServerThread, fake: FakePoolingEngine) -> None:
    import urllib.error
    import urllib.request

    with urllib.request.urlopen(server.url + "/health") as ok:
        assert ok.status == 200
    fake.is_running = False
    try:
        with pytest.raises(urllib.error.HTTPError) as dead:
            urllib.request.urlopen(server.url + "/health")
        assert dead.value.code == 503
    finally:
        fake.is_running = True


def test_embeddings_float_and_base64(client: Any, fake: FakePoolingEngine) -> None:
    raw = client.embeddings.create(model="embedder", input=["ab", "xyz"], encoding_format="float")
    # The client's default asks for base64 and decodes it.
    decoded = client.embeddings.create(model="embedder", input=["ab", "xyz"])
    assert [d.index for d in raw.data] == [0, 1]
    for a, b in zip(raw.data, decoded.data, strict=True):
        assert b.embedding == pytest.approx(a.embedding, rel=1e-6)
    assert raw.data[0].embedding != raw.data[1].embedding
    assert math.isclose(sum(v * v for v in raw.data[1].embedding), 1.0, rel_tol=1e-6)
    assert raw.usage.prompt_tokens == raw.usage.total_tokens == 5


def test_embedding_options_reach_the_engine(client: Any, fake: FakePoolingEngine) -> None:
    out = client.embeddings.create(
        model="embedder",
        input=[1, 2, 3],
        encoding_format="float",
        extra_body={"normalize": False, "truncate_prompt_tokens": 8},
    )
    assert out.data[0].embedding == [3.0, 6.0, 0.5]
    assert fake.calls[-1]["normalize"] is False and fake.calls[-1]["truncate_prompt_tokens"] == 8


def test_embedding_errors_and_generation_refused(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="more than 16"):
        client.embeddings.create(model="embedder", input="x" * 40)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="embedder", input="x", dimensions=2)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model="embedder", prompt="x")
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(
            model="embedder", messages=[{"role": "user", "content": "x"}]
        )


def _samples(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as response:
        text = response.read().decode()
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in text.splitlines())
        if not name.startswith("#")
    }


def test_a_real_pooling_engine(tmp_path: Any, tokenizer_dir: Any, one_torch_thread: None) -> None:
    """`tinyvllm serve BERT_DIR` detects the pooling model (no --runner) and gives through the
    client the embeddings `LLM.embed` gives; its context limit is a 400, and /metrics counts
    the pooling requests (one per input, refused ones not) and their prompt tokens."""
    import shutil
    from pathlib import Path

    from transformers import BertConfig, BertModel

    from tinyvllm import LLM

    config = BertConfig(
        vocab_size=2000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=48,
    )
    BertModel(config).float().eval().save_pretrained(tmp_path)
    for path in Path(tokenizer_dir).iterdir():
        if path.is_file():
            shutil.copy(path, tmp_path / path.name)
    texts = ["hello sea", "a b c d e f"]
    reference = [out.outputs.embedding for out in LLM(str(tmp_path)).embed(texts)]
    state = served_state([str(tmp_path), "--served-model-name", "bert"])
    try:
        assert state.is_pooling
        with ServerThread(build_app(state)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            out = client.embeddings.create(model="bert", input=texts)
            for got, want in zip(out.data, reference, strict=True):
                assert got.embedding == pytest.approx(want, rel=1e-4, abs=1e-5)
            with pytest.raises(openai.BadRequestError, match="48"):
                client.embeddings.create(model="bert", input="x " * 100)
            with pytest.raises(openai.BadRequestError, match="embedding model"):
                client.completions.create(model="bert", prompt="x")
            samples = _samples(server.url)
        label = '{model_name="bert"}'
        stats = state.engine.get_stats()
        assert samples[f"tinyvllm:prompt_tokens_total{label}"] == out.usage.prompt_tokens
        assert stats.total_prompt_tokens == out.usage.prompt_tokens
        assert samples[f"tinyvllm:generation_tokens_total{label}"] == 0
        assert samples[f"tinyvllm:num_requests_running{label}"] == 0
        assert samples[f"tinyvllm:num_requests_waiting{label}"] == 0
        assert samples[f"tinyvllm:kv_cache_usage_perc{label}"] == 0
        success = 'tinyvllm:request_success_total{model_name="bert",finished_reason="stop"}'
        assert samples[success] == len(texts)
        assert samples[f"tinyvllm:e2e_request_latency_seconds_count{label}"] == len(texts)
        assert samples[f"tinyvllm:time_to_first_token_seconds_count{label}"] == 0
    finally:
        state.engine.shutdown()


def test_serve_runner_pooling_on_a_decoder(tiny_models: Any, one_torch_thread: None) -> None:
    """`--runner pooling` serves a decoder checkpoint (which auto-detection runs for generation)
    as a last-token embedding model, equal to `LLM(..., runner="pooling").embed`."""
    from tinyvllm import LLM

    path = str(tiny_models["qwen3"])
    texts = ["the sea is calm", "tokens"]
    llm = LLM(path, runner="pooling", dtype="float32", device="cpu")
    reference = [out.outputs.embedding for out in llm.embed(texts)]
    state = served_state([path, "--runner", "pooling", "--dtype", "float32"])
    try:
        assert state.is_pooling
        with ServerThread(build_app(state)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            out = client.embeddings.create(model=path, input=texts, encoding_format="float")
        for got, want in zip(out.data, reference, strict=True):
            assert got.embedding == pytest.approx(want, rel=1e-4, abs=1e-5)
    finally:
        state.engine.shutdown()
