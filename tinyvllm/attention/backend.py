"""Attention metadata and the backend interface.

The model sees flattened tokens of every scheduled request (no padding) plus one
`AttentionMetadata` per step. The paged KV cache lives inside the backend: each attention
layer owns one tensor of shape `kv_cache_shape(...)`, and a token's K/V goes to
`slot = block_id * block_size + offset`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tinyvllm.attention.layer import Attention
    from tinyvllm.attention.recurrent import RecurrentMetadata


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
    # [num_reqs, 2] or [num_reqs, K, 2] int32 absolute positions [start, end) of up to K
    # disjoint spans per request (start == end: none): a query and a key inside the same span
    # see each other regardless of order (multimodal prefix spans), still limited to keys <
    # seq_len and, in sliding-window layers, to the window. The scheduler keeps a span in one
    # chunk.
    bidirectional_ranges: torch.Tensor | None = None
    # Hybrid models: state slots of the batch's requests for the recurrent (mixer) layers.
    recurrent: RecurrentMetadata | None = None


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and attends over cached context."""

    name: str = "abstract"
    # Whether `forward` may be captured in a CUDA graph: no host reads of per-step values.
    cuda_graph_safe: bool = False

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
        then attend `query` ([T, Hq, D]) causally over each request's full context (plus
        `metadata.bidirectional_ranges`, when given).

        Returns [T, Hq, D].
        """


BACKENDS = ("torch", "triton")


def _triton_problem(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on `device`, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None  # Triton's CPU interpreter: slow, for tests
    return (
        f"its Triton kernels need a CUDA device, not {device.type} "
        "(TRITON_INTERPRET=1 runs them in Triton's slow CPU interpreter)"
    )


def get_attention_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """Pick the backend for a device; `name` ("torch" | "triton") overrides the choice.

    CUDA devices default to "triton" when triton imports, everything else to "torch".
    """
    if name is None:
        name = "triton" if device.type == "cuda" and _triton_problem(device) is None else "torch"
    if name == "torch":
        from tinyvllm.attention.torch_attn import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        problem = _triton_problem(device)
        if problem is not None:
            raise ValueError(
                f"attention_backend='triton' cannot run on {device.type}: {problem}; "
                "use attention_backend='torch' (or leave it unset)"
            )
        from tinyvllm.attention.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend={name!r}; choose one of {list(BACKENDS)}")
