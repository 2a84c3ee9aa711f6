"""/v1/realtime's protocol through a `websockets` client on a loopback port, against a server
over the tiny random Llama (a text model: every audio path ends in a clear error event, and
the connection stays usable after each)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
websockets = pytest.importorskip("websockets")

from server_helpers import ServerThread, wait_engine_clean  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from tinyvllm.engine.async_llm import AsyncLLM  # noqa: E402
from tinyvllm.server.app import build_app  # noqa: E402
from tinyvllm.server.serving import ServerState  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny-llama"
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def engine(tiny_models: Any, one_torch_thread: None) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    yield llm
    llm.shutdown()


def serve(engine: AsyncLLM, api_key: str | None = None) -> ServerThread:
    state = ServerState(
        engine=engine,
        model_names=[MODEL],
        model_path=engine.engine.config.model.model_path,
        api_key=api_key,
    )
    return ServerThread(build_app(state))


@pytest.fixture(scope="module")
def ws_url(engine: AsyncLLM) -> Iterator[str]:
    with serve(engine) as server:
        yield server.url.replace("http://", "ws://") + "/v1/realtime"


def pcm_event(data: bytes) -> str:
    audio = base64.b64encode(data).decode()
    return json.dumps({"type": "input_audio_buffer.append", "audio": audio})


async def exchange(url: str, messages: list[Any], **connect_kwargs: Any) -> list[dict]:
    """Connect, read session.created, send each message (a dict or raw text) and read one
    event after each."""
    async with connect(url, **connect_kwargs) as ws:
        events = [json.loads(await ws.recv())]
        for message in messages:
            await ws.send(message if isinstance(message, str | bytes) else json.dumps(message))
            events.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))
        return events


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def test_session_created_then_errors_as_events(ws_url: str, engine: AsyncLLM) -> None:
    commit = {"type": "input_audio_buffer.commit"}
    messages = [
        "{not json",
        json.dumps([1, 2]),
        b"\x00\x01",
        {"type": "response.create"},
        commit,  # before session.update
        {"type": "session.update", "model": "other"},
        commit,  # the bad update validated nothing
        {"type": "session.update", "model": MODEL, "input_audio_format": "g711_ulaw"},
        pcm_event(b""),
        pcm_event(b"\x01\x02\x03"),
        {"type": "input_audio_buffer.append", "audio": "%%%"},
        {"type": "input_audio_buffer.append"},
    ]
    events = run(exchange(ws_url, messages))
    created = events[0]
    assert created["type"] == "session.created" and created["id"].startswith("sess-")
    assert isinstance(created["created"], int)
    codes = [e["code"] for e in events[1:]]
    assert all(e["type"] == "error" and e["error"] for e in events[1:])
    assert codes == [
        "invalid_json",
        "invalid_json",
        "invalid_json",
        "unknown_event",
        "model_not_validated",
        "model_not_found",
        "model_not_validated",
        "invalid_audio_format",
        "invalid_audio",
        "invalid_audio",
        "invalid_audio",
        "invalid_audio",
    ]
    assert "`other` does not exist" in events[6]["error"]
    assert "2 bytes per sample" in events[10]["error"]


def test_a_text_model_refuses_to_transcribe(ws_url: str, engine: AsyncLLM) -> None:
    messages = [
        {"type": "session.update", "model": MODEL},
        pcm_event(b"\x00\x00" * 1600),
        {"type": "input_audio_buffer.commit", "final": True},
    ]

    async def main() -> list[dict]:
        async with connect(ws_url) as ws:
            await ws.recv()
            for message in messages:
                await ws.send(message if isinstance(message, str) else json.dumps(message))
            first = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            # The connection still answers: another bad event gets its own error.
            await ws.send(json.dumps({"type": "nope"}))
            return [first, json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))]

    refused, after = run(main())
    assert refused["type"] == "error" and refused["code"] == "model_not_supported"
    assert "not a realtime speech model" in refused["error"]
    assert after["code"] == "unknown_event"
    wait_engine_clean(engine.engine)


def test_api_key_guards_the_websocket(engine: AsyncLLM) -> None:
    with serve(engine, api_key="sekrit") as server:
        url = server.url.replace("http://", "ws://") + "/v1/realtime"
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            run(exchange(url, []))
        assert info.value.response.status_code == 403
        with pytest.raises(websockets.exceptions.InvalidStatus):
            run(exchange(url, [], additional_headers={"Authorization": "Bearer wrong"}))
        events = run(exchange(url, [], additional_headers={"Authorization": "Bearer sekrit"}))
        assert events[0]["type"] == "session.created"


def test_the_input_buffer_is_bounded(ws_url: str, engine: AsyncLLM) -> None:
    """Audio buffered before a commit is bounded by what one request could ever use."""
    too_much = b"\x00\x00" * (64 * 16000 + 1)  # max_model_len 64 positions of a second each
    messages = [pcm_event(too_much[:-2]), pcm_event(b"\x00\x00" * 2)]

    async def main() -> dict:
        async with connect(ws_url, max_size=None) as ws:
            await ws.recv()
            for message in messages:
                await ws.send(message)
            return json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))

    refused = run(main())
    assert refused["code"] == "buffer_full" and "exceed 1024000 samples" in refused["error"]
