"""StreamingInput: one chunk of a request whose input keeps arriving while it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tinyvllm.sampling_params import SamplingParams


@dataclass
class StreamingInput:
    """The next piece of a streaming-input request's prompt (vLLM's shape).

    `AsyncLLM.generate(prompt=<async iterator of StreamingInput>, ...)` runs one request over
    all chunks: each chunk's prompt is appended to what came before (token ids, text, or a
    dict with "prompt" / "prompt_token_ids" and, for realtime audio models,
    "multi_modal_data": {"audio": samples}). The request computes what has arrived, waits for
    more without holding up other requests, and generates once the iterator ends (end of
    input) or, for a realtime audio model, as the audio for each position arrives.

    `sampling_params` may be set on the first chunk only (it then replaces the ones passed to
    `generate`); text chunks after the first are tokenized without special tokens. The engine
    thread reads a chunk shortly after it is yielded: do not modify its arrays afterwards.
    """

    prompt: str | list[int] | dict[str, Any]
    sampling_params: SamplingParams | None = None
