"""Attention metadata and the backend interface.

The model sees flattened tokens of every scheduled request (no padding) plus one
`AttentionMetadata` per step. The paged KV cache lives inside the backend: each attention
layer owns one tensor of shape `kv_cache_shape(...)`, and a token's K/V goes to
`slot = block_id * block_size + offset`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tinyvllm.attention.layer import Attention


@dataclass
class AttentionMetadata:
    """Everything an attention backend needs for one forward pass.

    Tensors live on the model's device. The `*_cpu` lists mirror the small per-request
    tensors so that backends can plan work without device syncs.
    """

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length *including* this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64; -1 marks a padding token
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Backend-private plan, built once per step by `AttentionBackend.plan`.
    plan: Any = field(default=None)


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and attends over cached context."""

    name: str = "abstract"

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV tensor: K and V stacked in front of the blocks."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def plan(self, metadata: AttentionMetadata) -> None:
        """Precompute per-step indices shared by all layers (called once per forward)."""
        metadata.plan = None

    @abstractmethod
    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write `key`/`value` ([T, Hkv, D]) into `kv_cache` at `metadata.slot_mapping`,
        then attend `query` ([T, Hq, D]) causally over each request's full context.

        Returns [T, Hq, D].
        """


def get_attention_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """Pick the backend for a device; `name` overrides the automatic choice."""
    from tinyvllm.attention.torch_attn import TorchAttentionBackend

    available: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}
    if name is None:
        name = "torch"
    if name not in available:
        raise ValueError(
            f"attention_backend={name!r} is not available on {device.type}; "
            f"choose one of {sorted(available)}"
        )
    return available[name]()
