"""PoolingRunner: runs a pooling model over whole prompts and pools the hidden states.

No KV cache, no sampling, no per-request state between steps: every request of a step has all
of its prompt in the step, so attention needs only the step's own tokens (PackedAttentionBackend:
bidirectional for encoders such as BERT, causal for decoder models pooled at their last token).
Requests run ordered by length, so the attention groups pad little.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.attention.packed_attn import PackedAttentionBackend
from tinyvllm.config import EngineConfig
from tinyvllm.models.layers.pooler import normalize_rows, pool
from tinyvllm.platforms import Platform
from tinyvllm.runner.loading import load_target_model


@dataclass(frozen=True)
class PoolingInput:
    """One request of a step: its tokens, and what to return for it."""

    token_ids: list[int]
    task: str  # "embed" | "token_embed"
    normalize: bool


class PoolingRunner:
    def __init__(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
        pooler = config.model.pooler_config
        assert pooler is not None and pooler.pooling_type is not None
        self.device = device
        self.pooling_type = pooler.pooling_type
        self.platform: Platform
        self.platform, self.model = load_target_model(config, dtype, device)
        causal = not getattr(self.model, "is_encoder_only", False)
        self.backend = PackedAttentionBackend(causal)
        # The layers check that a cache is bound; this backend never reads it.
        no_cache = torch.empty(0, device=device)
        for layer in self.model.attention_layers():
            layer.backend = self.backend
            layer.kv_cache = no_cache

    @torch.inference_mode()
    def execute(self, inputs: list[PoolingInput]) -> list[torch.Tensor]:
        """Each request's result on the CPU: [hidden] for "embed", [tokens, hidden] for
        "token_embed"; in `inputs`' order."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].token_ids))
        lengths = [len(inputs[i].token_ids) for i in order]
        hidden = self._forward([inputs[i].token_ids for i in order], lengths)
        pooled = normalize_rows(
            pool(hidden, lengths, self.pooling_type), [inputs[i].normalize for i in order]
        ).cpu()
        token_rows: tuple[torch.Tensor, ...] | None = None
        results: list[torch.Tensor | None] = [None] * len(inputs)
        for rank, i in enumerate(order):
            if inputs[i].task == "embed":
                results[i] = pooled[rank]
                continue
            if token_rows is None:
                token_rows = hidden.cpu().split(lengths)
            results[i] = normalize_rows(token_rows[rank], [inputs[i].normalize] * lengths[rank])
        return results  # type: ignore[return-value]  # every slot is filled

    def _forward(self, token_ids: list[list[int]], lengths: list[int]) -> torch.Tensor:
        device = self.device
        flat = [t for ids in token_ids for t in ids]
        input_ids = torch.tensor(flat, dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        metadata = AttentionMetadata(
            num_reqs=len(lengths),
            num_actual_tokens=len(flat),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_table=torch.empty(len(lengths), 0, dtype=torch.int32, device=device),
            slot_mapping=torch.empty(0, dtype=torch.long, device=device),
            max_query_len=max(lengths),
            max_seq_len=max(lengths),
            query_start_loc_cpu=starts,
            seq_lens_cpu=lengths,
            block_size=1,
        )
        self.backend.plan(metadata)
        return self.model(input_ids, positions, metadata)
