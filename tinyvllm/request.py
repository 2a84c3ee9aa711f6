"""Request: one sequence's state as the scheduler sees it (pure Python, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tinyvllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is a finished state.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class InputGate(Protocol):
    """How far a streaming request's input has arrived (a realtime model's AudioStream)."""

    def positions_ready(self) -> int:
        """Positions p whose input has fully arrived: p may be computed iff p < this."""
        ...


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    """One image or video of a prompt: where its placeholder tokens sit and what fills them.

    The scheduler and the prefix cache read only the plain fields; `data` is the processed
    media (pixel patches, grid) that only the model runner opens.
    """

    modality: str  # "image" | "video"
    identifier: str  # content hash (hex): the prefix cache's extra key and the encoder cache key
    offset: int  # index of the first placeholder token in the prompt
    length: int  # placeholder tokens (with EVS: the retained count)
    data: Any = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # resolved against max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # Draft tokens proposed for verification this step (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)
    # Prefix-cache hashes of the full blocks seen so far (memoised; tokens only ever grow).
    block_hashes: list[bytes] = field(default_factory=list)
    # Prompt tokens found in the prefix cache when the request was (last) admitted.
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Images / videos of the prompt, in prompt order (empty for text); audio chunks of a
    # streaming-input request, in arrival order.
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # Streaming input (`AsyncLLM.generate` over StreamingInput chunks): what says how many
    # positions have their input (None: all do; a realtime model's audio stream), and whether
    # more prompt tokens may still come, which holds back the last received one: the token
    # sampled after it would be wrong once the prompt grows.
    input_gate: InputGate | None = field(default=None, repr=False)
    awaiting_prompt: bool = False
    # Prompt tokens the model runner holds: the scheduler sends it those that came since.
    num_runner_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.stop_token_ids: frozenset[int] = frozenset(
            self.sampling_params.stop_ids(self.eos_token_id)
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def input_limit(self) -> int | None:
        """Positions whose input has arrived (None: all of them)."""
        return None if self.input_gate is None else self.input_gate.positions_ready()

    @property
    def num_input_tokens(self) -> int:
        """Tokens whose whole input has arrived (what the prefix cache may hash)."""
        limit = self.input_limit
        return self.num_tokens if limit is None else min(self.num_tokens, limit)

    @property
    def num_schedulable_tokens(self) -> int:
        """How far the scheduler may compute: every token (with drafts) of an ordinary request;
        for a streaming-input request only as far as its input has arrived."""
        n = self.num_tokens_with_spec
        limit = self.input_limit
        if limit is not None:
            n = min(n, limit)
        if self.awaiting_prompt:
            n = min(n, self.num_prompt_tokens - 1)
        return n

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
