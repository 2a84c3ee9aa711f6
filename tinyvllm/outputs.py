"""What the engine hands back per request, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    """Log-probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token at this position
    decoded_token: str | None = None


# One dict per generated token: candidate token id -> its Logprob (the sampled token is included).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None because nothing predicts the first token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    `finish_reason` is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort", or "error"; `stop_reason` is the stop string or stop token id
    that ended it, None for EOS and the other reasons.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={_short(self.token_ids)}, "
            f"cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={_count(self.logprobs)}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    """Timestamps (seconds, all on the engine's one clock) and counts for one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: drafts verified for this request and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        return _diff(self.first_scheduled_time, self.arrival_time)

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival (so queueing counts, as users feel it)."""
        return _diff(self.first_token_time, self.arrival_time)

    @property
    def e2e_latency(self) -> float | None:
        return _diff(self.finished_time, self.arrival_time)

    @property
    def mean_tpot(self) -> float | None:
        """Mean time per output token after the first (inter-token latency)."""
        span = _diff(self.last_token_time, self.first_token_time)
        if span is None or self.num_generation_tokens < 2:
            return None
        return span / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    """The state of one request as returned by `LLM.generate` or streamed by the engine.

    A request that failed carries `error` (and its completions finish_reason "error"), so a
    batch reports the failure for that request instead of raising for all of them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # Not a vLLM field, hence last: vLLM code that never sets it is unaffected.
    error: str | None = None

    def __repr__(self) -> str:
        error = f", error={self.error!r}" if self.error is not None else ""
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={_short_text(self.prompt)}, "
            f"prompt_token_ids={_short(self.prompt_token_ids)}, "
            f"prompt_logprobs={_count(self.prompt_logprobs)}, outputs={self.outputs!r}, "
            f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens}{error})"
        )


@dataclass
class PoolingOutput:
    """What a pooling model computed for one prompt: `data` is a tensor on the CPU, [hidden]
    for "embed" or [num_prompt_tokens, hidden] for "token_embed" (`LLM.encode`)."""

    data: torch.Tensor

    def __repr__(self) -> str:
        return f"PoolingOutput(data=<tensor {tuple(self.data.shape)}>)"


@dataclass
class EmbeddingOutput:
    """One prompt's embedding as a list of floats."""

    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        if output.data.ndim != 1:
            raise ValueError(
                f"an embedding is one vector, got pooled data of shape {tuple(output.data.shape)}"
            )
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """The result of one pooling request (vLLM's shape). `outputs` is None only when the
    request did not finish normally: aborted, or failed (then `error` says why)."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    # Not vLLM fields, hence last (as on RequestOutput).
    metrics: RequestMetrics | None = None
    error: str | None = None

    def __repr__(self) -> str:
        error = f", error={self.error!r}" if self.error is not None else ""
        return (
            f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
            f"prompt_token_ids={_short(self.prompt_token_ids)}, finished={self.finished}{error})"
        )


@dataclass(repr=False)
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """`outputs.embedding` is the prompt's embedding (a list of floats)."""

    @staticmethod
    def from_base(output: PoolingRequestOutput[Any]) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            request_id=output.request_id,
            outputs=EmbeddingOutput.from_base(output.outputs),
            prompt_token_ids=output.prompt_token_ids,
            num_cached_tokens=output.num_cached_tokens,
            finished=output.finished,
            metrics=output.metrics,
            error=output.error,
        )


def _diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


def _short(ids: list[int], keep: int = 8) -> str:
    # Long id lists make reprs unreadable in logs and the REPL; show the ends and the length.
    if len(ids) <= 2 * keep:
        return repr(ids)
    head = ", ".join(map(str, ids[:keep]))
    tail = ", ".join(map(str, ids[-keep:]))
    return f"[{head}, ... {tail}] (len={len(ids)})"


def _short_text(text: str | None, keep: int = 60) -> str:
    if text is None or len(text) <= 2 * keep:
        return repr(text)
    return f"{text[:keep]!r}...{text[-keep:]!r} (len={len(text)})"


def _count(items: list | None) -> str:
    return "None" if items is None else f"<{len(items)} positions>"
