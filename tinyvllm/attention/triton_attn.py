"""Triton attention backend: one K/V store launch and one attention launch per layer.

`forward` reads no tensor values and none of the `*_cpu` lists on the host: launch
parameters come from tensor shapes, the layer's constants and `metadata.max_query_len` /
`metadata.max_seq_len`, so whole-model CUDA graphs can capture it (see
`tinyvllm.attention.kernels.unified_attention` for the kernel design).
"""

from __future__ import annotations

import torch

from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata
from tinyvllm.attention.kernels.kv_store import store_kv
from tinyvllm.attention.kernels.unified_attention import unified_attention
from tinyvllm.attention.layer import Attention

# SM count assumed off-GPU (Triton's interpreter), where the split heuristic only matters
# for which code path the tests exercise.
_INTERPRETER_SMS = 8


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cuda_graph_safe = True

    def __init__(self, num_splits: int | None = None) -> None:
        # Forces the split-KV factor (power of two) instead of the heuristic; for tests.
        self.num_splits = num_splits

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        store_kv(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_sms = (
            torch.cuda.get_device_properties(query.device).multi_processor_count
            if query.is_cuda
            else _INTERPRETER_SMS
        )
        unified_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            out,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            scale=layer.scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            sliding_window=layer.sliding_window,
            soft_cap=layer.logits_soft_cap,
            bidirectional_ranges=metadata.bidirectional_ranges,
            num_splits=self.num_splits,
            num_sms=num_sms,
        )
        return out
