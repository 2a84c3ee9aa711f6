"""Realtime transcription over AsyncLLM: push audio as it arrives, read the text as it comes.

What `tinyvllm transcribe` and the server's /v1/realtime WebSocket share. One
TranscriptionStream is one streaming-input request to a realtime speech model (Voxtral
Realtime): its first chunk is the model's streaming prompt with the first audio, each later
chunk appends audio, and `end()` ends the input, after which the request stops at one token
per audio position, as an offline request over the same audio does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from tinyvllm.inputs import StreamingInput
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


def require_realtime(engine: Any) -> None:
    """ValueError unless `engine` serves a realtime speech model."""
    if not getattr(getattr(engine, "mm_processor", None), "realtime", False):
        model = engine.config.model.model
        raise ValueError(
            f"{model!r} is not a realtime speech model (transcription needs one, e.g. "
            "Voxtral Realtime: VoxtralRealtimeForConditionalGeneration)"
        )


def streaming_prompt_ids(engine: Any) -> list[int]:
    """The prompt a transcription starts with: the model processor's streaming prefix when it
    names one, else the beginning-of-sequence token."""
    processor = engine.mm_processor
    prefix = getattr(processor, "streaming_prompt_ids", None)
    if callable(prefix):
        return list(prefix(engine.tokenizer))
    tokenizer = engine.tokenizer
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    if bos is None:
        hf_config = engine.config.model.hf_config
        text_config = getattr(hf_config, "text_config", hf_config)
        bos = getattr(text_config, "bos_token_id", None)
    if bos is None:
        raise ValueError(
            "the model names no beginning-of-sequence token to start a transcription with; "
            "pass the prompt's token ids explicitly"
        )
    return [int(bos)]


def transcription_params(max_tokens: int) -> SamplingParams:
    """Greedy, streamed as deltas; the audio's length ends it (max_tokens is only a bound)."""
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA
    )


class TranscriptionStream:
    """One transcription request: `append` audio (float32 or int16 mono at the model's rate)
    and `end` it from the event loop; iterate `outputs()` for the text deltas."""

    def __init__(
        self, llm: Any, prompt_ids: list[int] | None = None, request_id: str | None = None
    ) -> None:
        require_realtime(llm.engine)
        self.llm = llm
        self.prompt_ids = prompt_ids if prompt_ids is not None else streaming_prompt_ids(llm.engine)
        self.request_id = request_id
        self.num_samples = 0
        self.ended = False
        self._queue: asyncio.Queue[np.ndarray | None] = asyncio.Queue()

    def append(self, samples: np.ndarray) -> None:
        if self.ended:
            raise ValueError(
                "audio arrived after the end of this transcription's input; start a new "
                "transcription for more audio"
            )
        self.num_samples += len(samples)
        self._queue.put_nowait(samples)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self._queue.put_nowait(None)

    def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs (text deltas); RequestError if the engine refuses the audio."""
        max_tokens = self.llm.engine.config.model.max_model_len
        return self.llm.generate(self._chunks(), transcription_params(max_tokens), self.request_id)

    async def _chunks(self) -> AsyncIterator[StreamingInput]:
        first = await self._queue.get()
        audio = {} if first is None else {"audio": first}
        yield StreamingInput({"prompt_token_ids": self.prompt_ids, "multi_modal_data": audio})
        if first is None:
            return
        while (chunk := await self._queue.get()) is not None:
            yield StreamingInput({"multi_modal_data": {"audio": chunk}})
