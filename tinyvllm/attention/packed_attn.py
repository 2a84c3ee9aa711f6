"""Attention without a KV cache, for steps that carry every request's whole sequence (pooling
models): each request attends over its own tokens only, bidirectionally for encoders and
causally for decoders.

Requests are attended in groups of similar length padded to the group's longest (one SDPA call
per group and layer, planned once per step): the pooling runner orders a step's requests by
length, so padding stays small; a group whose requests are all equally long and adjacent needs
no gather, no scatter and (bidirectional, no window) no mask at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata
from tinyvllm.attention.layer import Attention

# Padded tokens per group: large enough that SDPA calls are few, small enough that a group's
# scores ([n, heads, L, L]) stay cache-sized for short sentences.
_GROUP_TOKENS = 4096


@dataclass
class _Group:
    start: int  # first token (in the flattened batch) of the group's first request
    lengths: list[int]
    max_len: int
    device: torch.device
    # [n, max_len] token index of each padded position (padding points at the group's first
    # token); None when every request has max_len tokens (a plain view of the batch).
    index: torch.Tensor | None = None
    valid: torch.Tensor | None = None  # [n, max_len] bool, None like `index`
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def mask(self, causal: bool, window: int | None) -> torch.Tensor | None:
        """Boolean [n or 1, 1, L or 1, L] mask of the keys each query may see; None when SDPA
        needs none (all keys, or plain causal with `is_causal`)."""
        if window not in self.masks:
            visible: torch.Tensor | None = None
            if window is not None or (causal and self.valid is not None):
                pos = torch.arange(self.max_len, device=self.device)
                diff = pos[:, None] - pos[None, :]  # query - key
                visible = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
                if window is not None:
                    visible = visible & (diff.abs() < window)
                visible = visible[None, None]
            if self.valid is not None:
                keys = self.valid[:, None, None, :]
                visible = keys if visible is None else visible & keys
            self.masks[window] = visible
        return self.masks[window]


class PackedAttentionBackend(AttentionBackend):
    """No KV cache: `kv_cache` is ignored, every request's context is its tokens in this step."""

    name = "packed"

    def __init__(self, causal: bool) -> None:
        self.causal = causal

    def plan(self, metadata: AttentionMetadata) -> None:
        qsl = metadata.query_start_loc_cpu
        lengths = [qsl[i + 1] - qsl[i] for i in range(metadata.num_reqs)]
        groups: list[_Group] = []
        members: list[int] = []
        longest = 0
        # Requests come in ascending (or any) length order; a group ends when padding every
        # member to its longest would pass the token budget, or when lengths drop (a new run).
        for i, length in enumerate(lengths):
            grown = max(longest, length)
            if members and ((len(members) + 1) * grown > _GROUP_TOKENS or length < longest):
                groups.append(self._group(qsl, members, lengths, metadata.query_start_loc.device))
                members, grown = [], length
            members.append(i)
            longest = grown
        if members:
            groups.append(self._group(qsl, members, lengths, metadata.query_start_loc.device))
        metadata.plan = groups

    @staticmethod
    def _group(
        qsl: list[int], members: list[int], lengths: list[int], device: torch.device
    ) -> _Group:
        sizes = [lengths[i] for i in members]
        group = _Group(qsl[members[0]], sizes, max(sizes), device)
        if min(sizes) != group.max_len:
            pos = torch.arange(group.max_len, device=device)
            starts = torch.tensor([qsl[i] for i in members], device=device)
            valid = pos[None, :] < torch.tensor(sizes, device=device)[:, None]
            group.index = torch.where(valid, starts[:, None] + pos, group.start)
            group.valid = valid
        return group

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        groups: list[_Group] = metadata.plan
        out = torch.empty_like(query)
        gqa = layer.num_heads != layer.num_kv_heads
        for group in groups:
            end = group.start + group.num_tokens
            n = len(group.lengths)
            if group.index is None:
                shape = (n, group.max_len)
                q, k, v = (t[group.start : end].unflatten(0, shape) for t in (query, key, value))
            else:
                q, k, v = query[group.index], key[group.index], value[group.index]
            # [n, L, heads, D] -> [n, heads, L, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            mask = group.mask(self.causal, layer.sliding_window)
            attn = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=self.causal and mask is None,
                scale=layer.scale,
                enable_gqa=gqa,
            ).transpose(1, 2)
            if group.index is None:
                out[group.start : end] = attn.flatten(0, 1)
            else:
                assert group.valid is not None
                out[group.start : end] = attn[group.valid]
        return out
