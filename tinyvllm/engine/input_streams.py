"""Streaming-input requests on the engine side: chunks appended to a request while it runs.

A streaming request is an ordinary Request whose prompt (text models) or media (realtime
audio models) keeps growing. What the scheduler needs is two facts on the Request:
`awaiting_prompt` (more prompt tokens may come, so the last received one is held back: the
token sampled after it would be wrong once the prompt grows) and `input_limit` (positions whose
input has arrived). The scheduler computes only that far, so a stalled stream simply has
nothing to run while the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tinyvllm.engine.output_processor import OutputProcessor, ParentState
from tinyvllm.engine.prompts import PromptType, check_text, check_token_ids
from tinyvllm.request import Request


@dataclass(eq=False)
class InputStream:
    parent: ParentState
    request: Request
    ended: bool = False


class InputStreams:
    """The engine's open and ended input streams, by request id (the user's id)."""

    def __init__(
        self,
        tokenizer: Any,
        mm_processor: Any,
        output_processor: OutputProcessor,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.mm_processor = mm_processor
        self.output_processor = output_processor
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.streams: dict[str, InputStream] = {}

    @property
    def awaiting_input(self) -> bool:
        """Whether some request waits for input (then an idle engine is not stuck)."""
        return any(not s.ended for s in self.streams.values())

    def start(self, parent: ParentState, request: Request) -> None:
        """`request` (the only sample of `parent`) takes more input from now on."""
        # One list: the outputs report the prompt as it grows.
        parent.prompt_token_ids = request.prompt_token_ids
        request.awaiting_prompt = True
        self.streams[parent.request_id] = InputStream(parent, request)

    def append(self, request_id: str, prompt: PromptType) -> None:
        """Append one chunk; ValueError (naming the problem) leaves the request as it was."""
        stream = self._stream(request_id)
        if stream.ended:
            raise ValueError(
                f"request {request_id!r} got an input chunk after its end of input; end the "
                "input only after the last chunk"
            )
        text, token_ids = self._tokens(prompt)
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        request = stream.request
        if data:
            self._append_media(stream, data)
        if not token_ids:
            return
        if request.output_token_ids:
            raise ValueError(
                f"request {request_id!r} is generating already: prompt tokens can no longer be "
                "appended to it"
            )
        total = request.num_prompt_tokens + len(token_ids)
        if total > self.max_model_len:
            raise ValueError(
                f"the streamed prompt of request {request_id!r} would have {total} tokens, more "
                f"than max_model_len={self.max_model_len}; send less input or raise "
                "max_model_len"
            )
        check_token_ids(token_ids, self.vocab_size)
        self.mm_processor.check_text_prompt(token_ids)
        request.prompt_token_ids.extend(token_ids)
        parent = stream.parent
        parent.prompt = parent.prompt + text if parent.prompt is not None and text else None
        parent.metrics.num_prompt_tokens = request.num_prompt_tokens
        # Nothing was generated yet: detokenize the output against the prompt as it is now.
        self.output_processor.reseed(parent)

    def end(self, request_id: str) -> None:
        """No more input will come: the request runs to its end."""
        stream = self._stream(request_id)
        if stream.ended:
            raise ValueError(f"request {request_id!r} got a second end of input")
        stream.ended = True
        stream.request.awaiting_prompt = False

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def _stream(self, request_id: str) -> InputStream:
        stream = self.streams.get(request_id)
        if stream is None:
            raise ValueError(
                f"request {request_id!r} is not a streaming-input request in flight (finished, "
                "aborted, or added with a plain prompt)"
            )
        return stream

    def _tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A chunk's text and token ids; text after the first chunk gets no special tokens
        (no second BOS in the middle of the prompt)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokens(prompt["prompt"])
            if "multi_modal_data" in prompt:
                return None, []
            raise ValueError(
                "an input chunk dict needs 'prompt', 'prompt_token_ids' or "
                f"'multi_modal_data', got keys {sorted(prompt)}"
            )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text chunks need a tokenizer, but the engine was started with "
                    "skip_tokenizer_init=True; send token ids instead"
                )
            return prompt, list(self.tokenizer.encode(check_text(prompt), add_special_tokens=False))
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise TypeError(
            f"an input chunk must be a str, a list of token ids or a dict, got "
            f"{type(prompt).__name__}"
        )

    def _append_media(self, stream: InputStream, data: Any) -> None:
        append = getattr(self.mm_processor, "append_stream_media", None)
        if append is None:
            kinds = sorted(data) if isinstance(data, dict) else [type(data).__name__]
            raise ValueError(
                f"this model takes no streamed media ({', '.join(kinds)}): it is a text-only "
                "model here; stream prompt tokens or text, or serve a realtime audio model"
            )
        append(stream.request, data)
