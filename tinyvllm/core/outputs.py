"""What crosses between the scheduler and the model runner (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyvllm.request import MultiModalFeature
from tinyvllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after preemption (recompute)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    # Hybrid models: the request's running recurrent-state slot, and the snapshot slot its
    # state starts from on a prefix-cache hit (None: from zeros).
    state_slot: int | None = None
    restore_state_slot: int | None = None
    # Images / videos of the prompt with their placeholder ranges (empty for text).
    mm_features: list[MultiModalFeature] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Requests the runner already holds; only what changed since the last step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Streaming input: prompt tokens that arrived for a request since the runner last saw it
    # (request id -> the new tokens; absent when none did). Streamed audio needs no entry:
    # the runner reads the request's AudioStream, which its audio features share.
    appended_prompt_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # Tokens to run this step per request, in batch order (running first, then new).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Draft tokens to verify per request (speculative decoding); empty when off.
    scheduled_spec_decode_tokens: dict[str, list[int]]
    # Requests that finished or were aborted since the last step: the runner drops their rows.
    finished_req_ids: set[str]
    # Requests preempted this step: the runner drops their rows; they come back as new.
    preempted_req_ids: set[str]
    # Hybrid models: request -> snapshot slot to copy its recurrent state into after this
    # step (its computed tokens then end on a block boundary; prefix caching, "align" mode).
    state_snapshots: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per scheduled request: the tokens sampled this step (empty for a partial prefill)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request: (token ids, logprobs, rank of column 0) per sampled token, or None.
    logprobs: list[list[tuple[list[int], list[float], int]] | None] | None = None
    # Per request: prompt logprobs for the positions computed this step, or None.
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(
        default_factory=dict
    )
    # Draft tokens proposed for each request's next step (speculative decoding).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request whose drafts were verified this step: (drafts, accepted drafts).
    spec_counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The K the speculator chose for this step's proposals; None when nothing was proposed
    # (no speculator, or no request sampled), so the last reported K stands.
    num_speculative_tokens: int | None = None
    # Requests that failed on their own this step (their values could not be stored, or their
    # logits were not finite) -> why. They have no entry above; the rest of the batch ran.
    failed: dict[str, str] = field(default_factory=dict)
