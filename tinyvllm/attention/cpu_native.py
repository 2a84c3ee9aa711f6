"""CPU attention backend that runs decode-only steps through the native kernels.

Decode reads K/V straight from the paged cache through the block table (no gather, no
layout copy, no mask tensor). In steps that also hold prefill chunks, the chunks take the torch
backend's path and the step's decode queries still take the kernel (the torch path would
gather and pad each decode group's whole context, every layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.attention.layer import Attention
from tinyvllm.attention.torch_attn import TorchAttentionBackend
from tinyvllm.native.abi import MAX_QUERIES_PER_KV
from tinyvllm.native.ops import NativeCpuOps, dtype_code


@dataclass
class _NativeDecodePlan:
    token_idx: torch.Tensor  # [n] int64 flattened token of each decode query
    rows: torch.Tensor  # [n] int64 batch row (into seq_lens / block_table)
    torch_plan: object  # the torch backend's plan, for layers the kernel cannot take


@dataclass
class _MixedPlan:
    """A step of prefill chunks and decode queries: the kernel takes the decode queries."""

    token_idx: torch.Tensor  # [n] int64 flattened token of each decode query
    rows: torch.Tensor  # [n] int64 batch row of each
    torch_plan: Any  # the torch backend's plan of the whole step, for layers the kernel cannot take
    prefill_plan: Any  # the same without its decode queries


class NativeCpuAttentionBackend(TorchAttentionBackend):
    name = "cpu_native"

    def __init__(self, ops: NativeCpuOps) -> None:
        self.ops = ops

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        qsl = metadata.query_start_loc_cpu
        decode_only = metadata.max_query_len == 1 and qsl[-1] == metadata.num_reqs
        if getattr(metadata, "bidirectional_ranges", None) is not None:
            return
        if decode_only:
            n = metadata.num_reqs
            idx = torch.arange(n, dtype=torch.int64)
            metadata.plan = _NativeDecodePlan(idx, idx, metadata.plan)
            return
        torch_plan = metadata.plan
        if getattr(torch_plan, "decode_groups", None):
            rows = [i for i in range(metadata.num_reqs) if qsl[i + 1] - qsl[i] == 1]
            metadata.plan = _MixedPlan(
                token_idx=torch.tensor([qsl[i] for i in rows], dtype=torch.int64),
                rows=torch.tensor(rows, dtype=torch.int64),
                torch_plan=torch_plan,
                prefill_plan=replace(torch_plan, decode_groups=[]),
            )

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        # Row copies: torch's index_copy_ of a prefill step's strided K / V views (4,096 rows
        # of SmolLM2-135M) took 2-15 ms a layer, these 0.4 ms.
        if (
            key.dtype == kv_cache.dtype
            and value.dtype == kv_cache.dtype
            and slots.dtype == torch.int64
            and slots.is_contiguous()
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
            and kv_cache.is_contiguous()
        ):
            self.ops.store_kv(key, value, kv_cache, slots)
        else:
            super().store_kv(key, value, kv_cache, slots)

    def _native_ok(self, layer: Attention, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (
            layer.num_heads // layer.num_kv_heads <= MAX_QUERIES_PER_KV
            and dtype_code(query.dtype) is not None
            and kv_cache.dtype == query.dtype
            and query.stride(2) == 1
            and query.stride(1) == layer.head_dim
        )

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan = metadata.plan
        if not isinstance(plan, _NativeDecodePlan | _MixedPlan):
            return super().forward(layer, query, key, value, kv_cache, metadata)
        if not self._native_ok(layer, query, kv_cache) or key.stride(2) != 1:
            return self._with_plan(plan.torch_plan, layer, query, key, value, kv_cache, metadata)
        if isinstance(plan, _MixedPlan):
            # The torch path stores every token's K/V and attends the prefill chunks; the
            # decode rows of its output are left for the kernel.
            out = self._with_plan(plan.prefill_plan, layer, query, key, value, kv_cache, metadata)
            if not out.is_contiguous():  # not a fresh step-wide buffer: let torch do it all
                return self._with_plan(
                    plan.torch_plan, layer, query, key, value, kv_cache, metadata
                )
        else:
            n = metadata.num_actual_tokens
            self.ops.store_kv(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n])
            out = torch.empty(query.shape, dtype=query.dtype)
        self.ops.paged_decode(
            query,
            out,
            plan.token_idx,
            plan.rows,
            metadata.seq_lens,
            metadata.block_table,
            kv_cache,
            layer.scale,
            layer.sliding_window,
            layer.logits_soft_cap,
        )
        return out

    def _with_plan(
        self,
        plan: object,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The torch backend's forward on `plan` (the step's own plan is kept)."""
        own, metadata.plan = metadata.plan, plan
        try:
            return super().forward(layer, query, key, value, kv_cache, metadata)
        finally:
            metadata.plan = own
