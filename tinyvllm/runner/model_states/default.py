"""DefaultModelState: decoder-only text models with 1-D rotary positions (Llama, Mistral,
Qwen2, Qwen3): nothing per request beyond the paged KV, no extra attention metadata."""

from __future__ import annotations

import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.runner.input_batch import InputBatch
from tinyvllm.runner.model_states.interface import ModelInputs, ModelState


class DefaultModelState(ModelState):
    def model_inputs(self, batch: InputBatch) -> ModelInputs:
        # 1-D rope: a token's rotary position is its index in the sequence.
        return ModelInputs(batch.input_ids, batch.positions, batch.attn_metadata)

    def dummy_inputs(self, metadata: AttentionMetadata) -> ModelInputs:
        positions = torch.arange(metadata.num_actual_tokens, device=self.device)
        return ModelInputs(torch.zeros_like(positions), positions, metadata)
