"""The server under concurrent load: many streaming clients at once through the official async
client; every request completes with its full answer, no KV block leaks, and the engine's
counters add up."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server_helpers import ServerThread, wait_engine_clean  # noqa: E402

from tinyvllm.engine.async_llm import AsyncLLM  # noqa: E402
from tinyvllm.server.app import build_app  # noqa: E402
from tinyvllm.server.serving import ServerState  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def engine(tiny_models: Any, one_torch_thread: None) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128)
    yield llm
    llm.shutdown()


async def _client_session(client: Any, index: int, rounds: int, max_tokens: int) -> list[int]:
    """One client: `rounds` streamed chats one after another; the tokens each one got."""
    counts = []
    if index % 8 == 0:  # some clients send a bad request first: it must not affect the rest
        with pytest.raises(openai.BadRequestError, match="max_model_len"):
            await client.completions.create(model=MODEL, prompt=list(range(10, 300)))
        with pytest.raises(openai.BadRequestError, match="top_p"):
            await client.completions.create(model=MODEL, prompt="x", top_p=0)
    for r in range(rounds):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"client {index} round {r}: tell a story"}],
            max_tokens=max_tokens,
            temperature=0.8,
            seed=index * 100 + r,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        reasons = []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        assert reasons == ["length"], reasons
        counts.append(usage.completion_tokens)
    return counts


def _load(engine: AsyncLLM, clients: int, rounds: int, max_tokens: int) -> None:
    before = engine.get_stats()
    with ServerThread(build_app(ServerState(engine, [MODEL], "tiny"))) as server:

        async def main() -> list[list[int]]:
            client = openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120
            )
            sessions = (_client_session(client, i, rounds, max_tokens) for i in range(clients))
            return await asyncio.wait_for(asyncio.gather(*sessions), 300)

        results = asyncio.run(main())
    assert results == [[max_tokens] * rounds] * clients
    wait_engine_clean(engine.engine)
    after = engine.get_stats()
    total = clients * rounds
    assert after.num_finished_requests - before.num_finished_requests == total
    generated = after.total_generation_tokens - before.total_generation_tokens
    assert generated == total * max_tokens
    assert after.num_running == after.num_waiting == 0


def test_concurrent_streaming_clients(engine: AsyncLLM) -> None:
    _load(engine, clients=64, rounds=2, max_tokens=4)


@pytest.mark.slow
def test_sixty_four_streaming_clients(engine: AsyncLLM) -> None:
    _load(engine, clients=64, rounds=3, max_tokens=32)
