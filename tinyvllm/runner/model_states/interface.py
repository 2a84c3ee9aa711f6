"""ModelState: the part of the runner that differs per model kind (vLLM MRv2's model states).

The runner (`runner/model_runner.py`) does what every model shares: it keeps the persistent
request rows, builds the flat batch, runs the model and samples. A model state answers the
questions whose answers depend on the model kind:

- which positions the model's rotary embedding sees (`model_inputs`): 1-D token positions for
  text models; three M-RoPE sections (time, height, width) for Qwen-VL-style models;
- what a request keeps besides its paged KV (`add_request` / `remove_request`): nothing for
  text models; conv and SSM state slots for hybrid (Mamba, short-conv) models;
- what the attention layers need beyond the common metadata (`model_inputs`): bidirectional
  ranges for the image spans of prefix-LM VLMs;
- what happens around the forward (`pre_forward` / `post_forward`): gathering encoder outputs
  for the scheduled positions; snapshotting recurrent state when a chunk ends on a block
  boundary, so a prefix-cache hit can resume from it.

The registry's `ModelEntry.state_kind` names the state a model needs (`model_states.get`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.core.outputs import NewRequestData, SchedulerOutput
from tinyvllm.runner.input_batch import InputBatch


@dataclass
class ModelInputs:
    """What one forward of the model takes: `model(input_ids, positions, attn_metadata)`."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] for 1-D rope; a state may use another layout (M-RoPE [3, T])
    attn_metadata: AttentionMetadata
    # Token embeddings with encoder outputs merged in (set by a VLM state's pre_forward for
    # steps that schedule media tokens); None: the model embeds input_ids itself.
    inputs_embeds: torch.Tensor | None = None


class ModelState(ABC):
    """Per-model-kind inputs, per-request state and forward hooks; one per runner.

    The request hooks run once per request row change, the forward hooks once per step: keep
    them cheap (a text model's state does nothing in them).
    """

    # Whether `positions` are the flat [T] token indices that the CUDA graph buffers and the
    # native decode program take; a state with another layout runs the eager forward.
    flat_positions: ClassVar[bool] = True

    def __init__(self, model: nn.Module, max_num_reqs: int, device: torch.device) -> None:
        self.model = model
        self.max_num_reqs = max_num_reqs
        self.device = device

    # ---- per-request state beyond the paged KV -------------------------------------------
    def begin_step(self, sched: SchedulerOutput) -> None:  # noqa: B027
        """A step starts (before rows change): note what the state needs from the scheduler's
        decisions (e.g. the recurrent-state snapshots this step takes)."""

    def add_request(self, row: int, new: NewRequestData) -> None:  # noqa: B027
        """`new` now holds runner row `row` (first scheduled, or resumed after preemption).

        A hybrid model claims the row's recurrent-state slot here and fills it: zeros for a
        fresh prompt, or a copy of the snapshot stored with the last prefix-cache hit block
        (`new.num_computed_tokens` says how far the hit reaches)."""

    def remove_request(self, row: int) -> None:  # noqa: B027
        """Runner row `row` is free again (its request finished, was aborted or preempted);
        per-request state kept for it may be dropped or reused."""

    # ---- inputs ----------------------------------------------------------------------------
    @abstractmethod
    def model_inputs(self, batch: InputBatch) -> ModelInputs:
        """The model's inputs for one step's flat batch.

        `batch.positions` holds each token's index in its sequence (what the KV slots and the
        input ids are gathered by); the state turns it into what the rotary embedding needs
        (M-RoPE: per-request section offsets) and may add attention metadata (bidirectional
        ranges) to `batch.attn_metadata`."""

    @abstractmethod
    def dummy_inputs(self, metadata: AttentionMetadata) -> ModelInputs:
        """Inputs of the right shapes for a profiling forward of `metadata.num_actual_tokens`
        tokens of one request (their values do not matter, their memory does)."""

    # ---- around the forward ----------------------------------------------------------------
    def pre_forward(self, batch: InputBatch, inputs: ModelInputs) -> None:  # noqa: B027
        """Before the model runs on `inputs` (e.g. run the vision encoder for the media the
        step schedules, or copy recurrent state into the batch's slots)."""

    def post_forward(self, batch: InputBatch, hidden: torch.Tensor) -> None:  # noqa: B027
        """After the forward, before sampling (e.g. snapshot recurrent state of requests whose
        computed tokens now end on a block boundary, for the prefix cache)."""
