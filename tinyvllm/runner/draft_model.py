"""A small draft model that proposes tokens for the target to verify.

The draft has its own KV tensors but shares the target's blocks: block ids, block tables and
slot mappings are the same, so prefix-cache hits, preemption and freeing cover both models at
once. Each step the draft first runs the target's own batch (so its KV follows every token the
target computed, accepted drafts included), then decodes greedily up to K tokens from each
request's newest token. Its KV at rejected positions is rewritten by the next step's batch
before anything reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata
from tinyvllm.runner.input_batch import InputBatch
from tinyvllm.runner.states import RequestStates
from tinyvllm.sample.sampler import argmax_rows

if TYPE_CHECKING:
    from tinyvllm.native.quant_ops import QuantKernels


def load_draft_model(
    model: str,
    target_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    quantization: str | None = None,
    quant_kernels: QuantKernels | None = None,
) -> torch.nn.Module:
    """The draft checkpoint (local dir, hub id or .gguf), resolved and built like the target,
    with the engine's `quantization=` resolved against it as against the target; its vocabulary
    must be the target's, or its token ids would mean other tokens. `quant_kernels`: the
    platform's native block kernels, as for the target."""
    from tinyvllm.models.checkpoint import resolve_checkpoint
    from tinyvllm.models.loader import load_model
    from tinyvllm.quant.config import resolve_quantization

    checkpoint = resolve_checkpoint(model)
    config = checkpoint.hf_config
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"draft model {model!r} has vocab_size {config.vocab_size} but the target has "
            f"{target_config.vocab_size}; a draft model must share the target's tokenizer"
        )
    gguf_path = checkpoint.path if checkpoint.is_gguf else None
    try:
        quant_config = resolve_quantization(quantization, gguf_path)
    except ValueError as exc:
        raise ValueError(f"draft model {model!r}: {exc}") from None
    return load_model(
        checkpoint.path, config, dtype, device, max_model_len, quant_config, quant_kernels
    )


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, block_size: int) -> None:
        self.model = model
        self.block_size = block_size

    def attention_layers(self) -> list[Any]:
        return self.model.attention_layers()

    def follow_batch(self, batch: InputBatch) -> None:
        """Run the target's batch through the draft so its KV covers the same tokens."""
        self.model(batch.input_ids, batch.positions, batch.attn_metadata)

    def propose(
        self,
        states: RequestStates,
        rows: torch.Tensor,
        ks: list[int],
        backend: AttentionBackend,
        device: torch.device,
    ) -> list[list[int]]:
        """Up to `ks[i]` greedy draft tokens for each row, continuing its known tokens."""
        drafts: list[list[int]] = [[] for _ in ks]
        k_max = max(ks, default=0)
        if k_max == 0:
            return drafts
        position = states.num_tokens[rows] - 1
        tokens = states.token_ids[rows, position]
        active = torch.arange(len(ks))
        k_tensor = torch.tensor(ks)
        for step in range(k_max):
            keep = k_tensor[active] > step
            active, position, tokens = active[keep], position[keep], tokens[keep]
            if active.numel() == 0:
                break
            metadata = self._decode_metadata(states, rows[active], position, device)
            backend.plan(metadata)
            hidden = self.model(tokens.to(device), position.to(device), metadata)
            tokens = argmax_rows(self.model.compute_logits(hidden)).cpu()
            for i, token in zip(active.tolist(), tokens.tolist(), strict=True):
                drafts[i].append(token)
            position = position + 1
        return drafts

    def _decode_metadata(
        self,
        states: RequestStates,
        rows: torch.Tensor,
        position: torch.Tensor,
        device: torch.device,
    ) -> AttentionMetadata:
        """One query token per request at `position`, reading everything before it."""
        bs = self.block_size
        num = rows.numel()
        seq_lens = position + 1
        block_ids = states.block_table[rows, position // bs].to(torch.int64)
        slots = block_ids * bs + position % bs
        max_seq_len = int(seq_lens.max())
        query_start_loc = torch.arange(num + 1, dtype=torch.int64)
        block_table = states.block_table[rows, : -(-max_seq_len // bs)]
        return AttentionMetadata(
            num_reqs=num,
            num_actual_tokens=num,
            query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
            seq_lens=seq_lens.to(device=device, dtype=torch.int32),
            block_table=block_table.to(device),
            slot_mapping=slots.to(device),
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=bs,
        )
