"""/v1/realtime end to end on a tiny random Voxtral Realtime checkpoint: the streamed deltas
and transcription.done give the offline request's text; sessions run side by side, a stalled
one holds up nobody; audio after the final commit, empty audio and a dropped connection each
end only what they concern."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("websockets")

from server_helpers import ServerThread, wait_engine_clean
from test_realtime_ws import TIMEOUT, pcm_event, run
from test_server_cli import ROOT, _free_port, _wait_healthy
from voxtral_realtime_fixtures import build_tiny_voxtral, random_audio
from websockets.asyncio.client import connect

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.transcription import streaming_prompt_ids
from tinyvllm.server.app import build_app
from tinyvllm.server.serving import ServerState

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny-voxtral"


@pytest.fixture(scope="module")
def vox_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_voxtral(tmp_path_factory.mktemp("voxtral_rt_ws"), tokenizer_dir)


@pytest.fixture(scope="module")
def vox_llm(vox_path: Path) -> LLM:
    """The offline reference, on an engine of its own (the server's engine thread owns its
    engine: nothing else may step it)."""
    return LLM(str(vox_path), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def served(vox_path: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(vox_path), dtype="float32", max_model_len=256)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def ws_url(served: AsyncLLM) -> Iterator[str]:
    state = ServerState(
        engine=served, model_names=[MODEL], model_path=served.engine.config.model.model_path
    )
    with ServerThread(build_app(state)) as server:
        yield server.url.replace("http://", "ws://") + "/v1/realtime"


def pcm16(clip: np.ndarray) -> bytes:
    return np.round(np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes()


def offline_text(llm: LLM, clip: np.ndarray) -> tuple[str, int]:
    """(text, output tokens) of the offline request over the PCM16-rounded clip."""
    samples = np.frombuffer(pcm16(clip), dtype="<i2").astype(np.float32) / 32768.0
    prompt = {
        "prompt_token_ids": streaming_prompt_ids(llm.engine),
        "multi_modal_data": {"audio": (samples, 16000)},
    }
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1000), use_tqdm=False)
    return out[0].outputs[0].text, len(out[0].outputs[0].token_ids)


async def transcribe(
    ws: Any, data: bytes, chunk: int = 4096, gate: asyncio.Event | None = None
) -> tuple[list[str], dict]:
    """vLLM's client flow on an open session: update, commit, append chunks, final commit;
    returns (deltas, the done event). Waits for `gate` after the first chunk."""
    await ws.send(json.dumps({"type": "session.update", "model": MODEL}))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    for i, start in enumerate(range(0, len(data), chunk)):
        await ws.send(pcm_event(data[start : start + chunk]))
        if i == 0 and gate is not None:
            await gate.wait()
    await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
    deltas = []
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        if event["type"] == "transcription.delta":
            deltas.append(event["delta"])
        elif event["type"] == "transcription.done":
            return deltas, event
        else:
            raise AssertionError(f"unexpected event {event}")


async def session(url: str, data: bytes, **kwargs: Any) -> tuple[list[str], dict]:
    async with connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        return await transcribe(ws, data, **kwargs)


def test_streamed_deltas_give_the_offline_transcript(
    vox_llm: LLM, served: AsyncLLM, ws_url: str
) -> None:
    clip = random_audio(1.45, seed=1)
    text, num_tokens = offline_text(vox_llm, clip)
    assert text
    deltas, done = run(session(ws_url, pcm16(clip)))
    assert len(deltas) > 1 and "".join(deltas) == text == done["text"]
    prompt = len(streaming_prompt_ids(vox_llm.engine))
    usage = {"prompt_tokens": prompt, "completion_tokens": num_tokens}
    assert done["usage"] == {**usage, "total_tokens": prompt + num_tokens}
    wait_engine_clean(served.engine)


def test_sessions_side_by_side_and_a_stalled_one(
    vox_llm: LLM, served: AsyncLLM, ws_url: str
) -> None:
    clips = [random_audio(1.0, seed=s) for s in (2, 3, 4)]
    expected = [offline_text(vox_llm, c)[0] for c in clips]

    async def main() -> list[str]:
        gate = asyncio.Event()
        stalled = asyncio.create_task(session(ws_url, pcm16(clips[0]), gate=gate))
        others = await asyncio.gather(
            session(ws_url, pcm16(clips[1]), chunk=2000), session(ws_url, pcm16(clips[2]))
        )
        gate.set()  # the others finished while it waited for audio
        return [(await stalled)[1]["text"], *(done["text"] for _, done in others)]

    assert run(main()) == expected
    wait_engine_clean(served.engine)


def test_late_audio_empty_audio_and_the_next_utterance(
    vox_llm: LLM, served: AsyncLLM, ws_url: str
) -> None:
    first, second = random_audio(0.8, seed=5), random_audio(0.7, seed=6)
    expected = [offline_text(vox_llm, c)[0] for c in (first, second)]

    async def main() -> tuple[list[dict], dict, dict]:
        async with connect(ws_url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "model": MODEL}))
            await ws.send(pcm_event(pcm16(first)))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            await ws.send(pcm_event(pcm16(first[:800])))  # after the final commit
            events = []
            while not events or events[-1]["type"] != "transcription.done":
                events.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))
            # No audio at all: one error, and the session goes on.
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            empty = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            _, done = await transcribe(ws, pcm16(second))
            return events, empty, done

    events, empty, done = run(main())
    late = [e for e in events if e["type"] == "error"]
    assert [e["code"] for e in late] == ["input_ended"]
    assert events[-1]["text"] == expected[0]
    assert empty["type"] == "error" and empty["code"] == "processing_error"
    assert "nothing to transcribe" in empty["error"]
    assert done["text"] == expected[1]
    wait_engine_clean(served.engine)


def test_a_dropped_connection_aborts_its_transcription(
    vox_llm: LLM, served: AsyncLLM, ws_url: str
) -> None:
    clip = random_audio(1.0, seed=7)

    async def main() -> None:
        async with connect(ws_url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "model": MODEL}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(pcm_event(pcm16(clip[:6000])))
            await asyncio.wait_for(ws.recv(), TIMEOUT)  # a delta: the request is running
        # Closed with the input still open: the server aborts the request.

    run(main())
    wait_engine_clean(served.engine)


@pytest.mark.slow  # ~10 s: starts `tinyvllm serve` in a process of its own
def test_the_serve_command_serves_realtime(vox_llm: LLM, vox_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tinyvllm.cli", "serve", str(vox_path), "--port", str(port)]
    cmd += ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256"]
    cmd += ["--device", "cpu", "--uvicorn-log-level", "warning"]
    clip = random_audio(0.9, seed=8)
    expected = offline_text(vox_llm, clip)[0]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        _, done = run(session(f"ws://127.0.0.1:{port}/v1/realtime", pcm16(clip)))
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert done["text"] == expected
    assert proc.returncode == 0, err
    assert f"realtime transcription at ws://127.0.0.1:{port}/v1/realtime" in err
