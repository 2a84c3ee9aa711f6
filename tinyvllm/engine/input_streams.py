"""Streaming-input requests on the engine side: chunks appended to a request while it runs.

A streaming request is an ordinary Request whose prompt (text models) or media (realtime
audio models) keeps growing. What the scheduler needs is two facts on the Request:
`awaiting_prompt` (more prompt tokens may come, so the last received one is held back: the
token sampled after it would be wrong once the prompt grows) and `input_gate` (what says how
many positions have their input: a realtime model's AudioStream, which the request's audio
features share with the model runner). The scheduler computes only that far, so a stalled
stream simply has nothing to run while the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinyvllm.engine.output_processor import OutputProcessor, ParentState
from tinyvllm.engine.prompts import PromptType, check_text, check_token_ids
from tinyvllm.request import Request

if TYPE_CHECKING:
    from tinyvllm.multimodal.audio_stream import AudioStream


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

    def first_chunk(self, prompt: PromptType) -> PromptType:
        """The prompt a streaming request is added with. For a realtime audio model its audio
        (none yet, or the first chunk's) becomes an open AudioStream that later chunks extend;
        its prompt tokens are complete."""
        if not getattr(self.mm_processor, "realtime", False):
            return prompt
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise ValueError(
                "the first input chunk for a realtime audio model is {'prompt_token_ids': "
                "[...], 'multi_modal_data': {'audio': samples}} (the audio may come later)"
            )
        from tinyvllm.multimodal.audio_stream import AudioStream

        data = dict(prompt.get("multi_modal_data") or {})
        audio = AudioStream(self.mm_processor.frame_config)
        if data.get("audio") is not None:
            self._extend(audio, data["audio"])
        return {**prompt, "multi_modal_data": {**data, "audio": audio}}

    def start(self, parent: ParentState, request: Request) -> None:
        """`request` (the only sample of `parent`) takes more input from now on."""
        # One list: the outputs report the prompt as it grows.
        parent.prompt_token_ids = request.prompt_token_ids
        # A realtime request's prompt is complete; its audio gates it (`input_gate`).
        request.awaiting_prompt = request.input_gate is None
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
        if token_ids and request.input_gate is not None:
            raise ValueError(
                f"request {request_id!r} is a realtime audio request: its later chunks carry "
                "audio only ({'multi_modal_data': {'audio': samples}}); its prompt tokens come "
                "in the first chunk"
            )
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

    def end(self, request_id: str) -> Request:
        """No more input will come: the request runs to its end (a realtime request: to one
        token per position of its audio, as offline). Returns the request."""
        stream = self._stream(request_id)
        if stream.ended:
            raise ValueError(f"request {request_id!r} got a second end of input")
        request = stream.request
        audio = _audio_of(request)
        if audio is not None:
            audio.end()
            self._note_ready(request, audio)
            limit = audio.sequence_limit()
            assert limit is not None
            if limit <= request.num_prompt_tokens:
                raise ValueError(
                    f"request {request_id!r}: its audio ({audio.num_samples} samples) gives "
                    f"{limit} decoder positions, no more than the prompt's "
                    f"{request.num_prompt_tokens} tokens, so there is nothing to transcribe; "
                    f"send at least {audio.config.samples_per_position} samples per position"
                )
            request.max_tokens = min(request.max_tokens, limit - request.num_prompt_tokens)
        stream.ended = True
        request.awaiting_prompt = False
        return request

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
        request = stream.request
        audio = _audio_of(request)
        if audio is None:
            kinds = sorted(data) if isinstance(data, dict) else [type(data).__name__]
            raise ValueError(
                f"this model takes no streamed media ({', '.join(map(str, kinds))}): it is a "
                "text-only model here; stream prompt tokens or text, or serve a realtime audio "
                "model"
            )
        unknown = sorted(set(data) - {"audio"}) if isinstance(data, dict) else ["?"]
        if unknown:
            raise ValueError(
                f"multi_modal_data of an input chunk has unsupported key(s) {unknown}; a "
                "realtime audio model takes {'audio': samples}"
            )
        self._extend(audio, data["audio"])
        self._note_ready(request, audio)

    @staticmethod
    def _extend(audio: AudioStream, item: Any) -> None:
        """Append one chunk's samples (an empty chunk adds nothing)."""
        samples = item[0] if isinstance(item, tuple) else item
        rate = audio.config.sampling_rate
        if isinstance(item, tuple) and len(item) == 2 and item[1] != rate:
            # Resampling chunk by chunk would click at every boundary.
            raise ValueError(
                f"streamed audio must be at {rate} Hz, got a chunk at {item[1]} Hz; resample "
                f"the whole stream to {rate} Hz before sending it"
            )
        # Here: numpy and the resampler's torch stay out of `import tinyvllm`.
        import numpy as np

        from tinyvllm.multimodal.audio import audio_samples

        if isinstance(samples, np.ndarray) and samples.size == 0:
            return
        # A copy: the caller may reuse its buffer (a recorder's ring) for the next chunk.
        audio.append(np.array(audio_samples(item, rate), dtype=np.float32))

    @staticmethod
    def _note_ready(request: Request, audio: AudioStream) -> None:
        """Key the newly ready positions' audio for the prefix cache (one feature per range)."""
        known = request.mm_features[-1].end if request.mm_features else 0
        ready = audio.positions_ready()
        if ready > known:
            request.mm_features.append(audio.chunk_feature(known, ready))


def _audio_of(request: Request) -> AudioStream | None:
    """The request's AudioStream (a realtime model's), None for text."""
    if request.input_gate is None:
        return None
    from tinyvllm.multimodal.audio_stream import audio_stream_of

    return audio_stream_of(request.mm_features)
