"""/v1/realtime: realtime transcription over a WebSocket, in the shape vLLM serves.

Client -> server events (JSON text frames):
- `{"type": "session.update", "model": NAME}`: pick (validate) the model; required before
  the first commit.
- `{"type": "input_audio_buffer.append", "audio": BASE64}`: PCM16 little-endian mono at
  16 kHz. Before a commit it is buffered; during a transcription it streams into it.
- `{"type": "input_audio_buffer.commit"}` starts a transcription of the buffered and all
  following audio; `{"type": "input_audio_buffer.commit", "final": true}` ends its input.

Server -> client events: `session.created` on connect, `transcription.delta` ({"delta":
text}) as the model produces text, `transcription.done` ({"text", "usage"}) when the
transcription ends, and `error` ({"error": message, "code": ...}) for anything refused: a bad
event ends nothing but itself, a refused transcription only that transcription. After
`transcription.done` the session takes the next utterance (append, commit, ...).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import time
import uuid
from typing import Any

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect

from tinyvllm.engine.streams import RequestError
from tinyvllm.engine.transcription import TranscriptionStream, require_realtime
from tinyvllm.server.serving import ServerState

logger = logging.getLogger(__name__)

PCM_RATE = 16000  # the protocol's audio: PCM16 mono at 16 kHz
# "Policy violation": the handshake is refused (HTTP 403) without the server's API key.
_CLOSE_POLICY = 1008


class RealtimeSession:
    """One WebSocket connection: at most one transcription at a time."""

    def __init__(self, websocket: WebSocket, state: ServerState) -> None:
        self.ws = websocket
        self.state = state
        self.validated = False
        self.buffer: list[np.ndarray] = []  # audio appended before the commit
        self.stream: TranscriptionStream | None = None
        self.task: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        # Audio the model could ever use in one request bounds what a client may buffer.
        self.max_buffered = max(1, state.max_model_len) * _samples_per_position(state)

    async def run(self) -> None:
        key = self.state.api_key
        given = self.ws.headers.get("authorization", "")
        if key and not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
            await self.ws.close(code=_CLOSE_POLICY)
            return
        await self.ws.accept()
        created = {"type": "session.created", "id": f"sess-{uuid.uuid4().hex}"}
        await self.send({**created, "created": int(time.time())})
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is None:
                    await self.error("send events as JSON text frames, not binary", "invalid_json")
                    continue
                await self.handle(message["text"])
        except WebSocketDisconnect:
            pass
        finally:
            if self.task is not None:
                self.task.cancel()  # aborts the request
                with contextlib.suppress(asyncio.CancelledError):
                    await self.task

    async def handle(self, message: str) -> None:
        try:
            event = json.loads(message)
        except ValueError:
            await self.error("the message is not valid JSON", "invalid_json")
            return
        if not isinstance(event, dict):
            await self.error("an event is a JSON object with a 'type'", "invalid_json")
            return
        kind = event.get("type")
        if kind == "session.update":
            await self.session_update(event)
        elif kind == "input_audio_buffer.append":
            await self.append(event)
        elif kind == "input_audio_buffer.commit":
            await self.commit(bool(event.get("final", False)))
        else:
            known = "session.update, input_audio_buffer.append, input_audio_buffer.commit"
            await self.error(
                f"unknown event type {kind!r}; this server takes {known}", "unknown_event"
            )

    async def session_update(self, event: dict[str, Any]) -> None:
        model = event.get("model")
        if model is not None and model not in self.state.model_names:
            await self.error(
                f"the model `{model}` does not exist; this server serves {self.state.model_names}",
                "model_not_found",
            )
            return
        audio_format = event.get("input_audio_format")
        if audio_format not in (None, "pcm16"):
            await self.error(
                f"input_audio_format {audio_format!r} is not supported; send PCM16 mono at "
                f"{PCM_RATE} Hz ('pcm16')",
                "invalid_audio_format",
            )
            return
        self.validated = True

    async def append(self, event: dict[str, Any]) -> None:
        samples = _decode_pcm16(event.get("audio"))
        if isinstance(samples, str):
            await self.error(samples, "invalid_audio")
            return
        stream = self.stream
        if stream is not None and stream.ended:
            await self.error(
                "input_audio_buffer.append after the final commit: this transcription's "
                "input has ended; wait for transcription.done, then append and commit again",
                "input_ended",
            )
            return
        if stream is not None:
            stream.append(samples)
            return
        if sum(map(len, self.buffer)) + len(samples) > self.max_buffered:
            await self.error(
                f"the input audio buffer would exceed {self.max_buffered} samples, more than "
                "the model can transcribe in one request; commit to start transcribing",
                "buffer_full",
            )
            return
        self.buffer.append(samples)

    async def commit(self, final: bool) -> None:
        if not self.validated:
            await self.error(
                "send a session.update event naming the model before the first commit",
                "model_not_validated",
            )
            return
        if self.stream is None:
            try:
                self.stream = TranscriptionStream(self.state.engine)
            except ValueError as exc:
                await self.error(str(exc), "model_not_supported")
                return
            for samples in self.buffer:
                self.stream.append(samples)
            self.buffer = []
            self.task = asyncio.create_task(self.transcribe(self.stream))
        if final:
            self.stream.end()

    async def transcribe(self, stream: TranscriptionStream) -> None:
        """Stream one transcription's deltas, then its done event (or an error event)."""
        text: list[str] = []
        prompt_tokens = completion_tokens = 0
        try:
            async for out in stream.outputs():
                prompt_tokens = len(out.prompt_token_ids)
                completion = out.outputs[0]
                completion_tokens += len(completion.token_ids)
                if completion.text:
                    text.append(completion.text)
                    await self.send({"type": "transcription.delta", "delta": completion.text})
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            await self.send({"type": "transcription.done", "text": "".join(text), "usage": usage})
        except RequestError as exc:
            await self.error(exc.message, "processing_error")
        except ValueError as exc:  # refused at submission
            await self.error(str(exc), "processing_error")
        finally:
            if self.stream is stream:
                self.stream = None

    async def send(self, event: dict[str, Any]) -> None:
        async with self._send_lock:  # the reader and the transcription both send
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await self.ws.send_text(json.dumps(event))

    async def error(self, message: str, code: str) -> None:
        await self.send({"type": "error", "error": message, "code": code})


def _decode_pcm16(audio: Any) -> np.ndarray | str:
    """The samples of an append's base64 PCM16 payload, or why it is refused."""
    if not isinstance(audio, str):
        return "input_audio_buffer.append needs 'audio': base64-encoded PCM16 mono at 16 kHz"
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        return "the 'audio' of input_audio_buffer.append is not valid base64"
    if not raw:
        return "empty audio: input_audio_buffer.append carried no samples"
    if len(raw) % 2:
        return f"PCM16 audio has 2 bytes per sample, got {len(raw)} bytes (an odd count)"
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def _samples_per_position(state: ServerState) -> int:
    try:
        require_realtime(state.engine.engine)
    except ValueError:
        return PCM_RATE  # a text model transcribes nothing: a second per position bounds it
    return int(state.engine.engine.mm_processor.frame_config.samples_per_position)
