"""Attention without a KV cache, for steps that carry every request's whole sequence (pooling
models): each request attends over its own tokens only, bidirectionally for encoders and
causally for decoders.

Adjacent requests of equal length are one SDPA call per layer on a plain view of the batch
([n, L, heads, D]): no padding, no gather or scatter, and no mask unless a sliding window
needs one. The pooling runner orders a step's requests by length, so a batch of sentences has
as many calls as distinct lengths, which costs far less than padding them (gathering padded
copies took ~40% of a MiniLM forward on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata
from tinyvllm.attention.layer import Attention


@dataclass(frozen=True)
class _Run:
    start: int  # first token, in the flattened batch, of the run's first request
    count: int  # requests in the run
    length: int  # tokens of each


@dataclass
class _Plan:
    runs: list[_Run]
    device: torch.device
    # (length, sliding window) -> the [L, L] mask of keys each query may see.
    masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def window_mask(self, length: int, window: int, causal: bool) -> torch.Tensor:
        mask = self.masks.get((length, window))
        if mask is None:
            pos = torch.arange(length, device=self.device)
            diff = pos[:, None] - pos[None, :]  # query - key
            mask = (diff >= 0) & (diff < window) if causal else diff.abs() < window
            self.masks[(length, window)] = mask
        return mask


class PackedAttentionBackend(AttentionBackend):
    """No KV cache: `kv_cache` is ignored, every request's context is its tokens in this step."""

    name = "packed"

    def __init__(self, causal: bool) -> None:
        self.causal = causal

    def plan(self, metadata: AttentionMetadata) -> None:
        qsl = metadata.query_start_loc_cpu
        runs: list[_Run] = []
        for i in range(metadata.num_reqs):
            length = qsl[i + 1] - qsl[i]
            if runs and runs[-1].length == length:
                last = runs[-1]
                runs[-1] = _Run(last.start, last.count + 1, length)
            else:
                runs.append(_Run(qsl[i], 1, length))
        metadata.plan = _Plan(runs, metadata.query_start_loc.device)

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan: _Plan = metadata.plan
        out = torch.empty_like(query)
        gqa = layer.num_heads != layer.num_kv_heads
        window = layer.sliding_window
        for run in plan.runs:
            end = run.start + run.count * run.length
            shape = (run.count, run.length)
            # [n * L, heads, D] -> [n, heads, L, D]
            q, k, v = (
                t[run.start : end].unflatten(0, shape).transpose(1, 2) for t in (query, key, value)
            )
            mask = None
            if window is not None and window < run.length:
                mask = plan.window_mask(run.length, window, self.causal)
            attn = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=self.causal and mask is None,
                scale=layer.scale,
                enable_gqa=gqa,
            )
            out[run.start : end] = attn.transpose(1, 2).flatten(0, 1)
        return out
