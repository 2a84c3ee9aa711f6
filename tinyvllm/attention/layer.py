"""The attention layer a model holds; the backend and KV tensor are bound by the runner."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged attention over one layer's KV cache.

    q/k/v come in already projected and rotated: q [T, num_heads * head_dim],
    k/v [T, num_kv_heads * head_dim]; the output is [T, num_heads * head_dim].
    """

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Key j is visible to query i iff i - j < sliding_window (HF's convention).
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError("Attention layer used before the runner bound a KV cache")
        num_tokens = q.shape[0]
        out = self.backend.forward(
            self,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            metadata,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
