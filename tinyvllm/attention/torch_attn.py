"""CPU / reference attention backend in plain torch.

Work is planned once per step and shared by all layers. Decode tokens (query length 1) of all
requests run as one batched matmul over K/V gathered through the block table; prefill chunks run
one SDPA call per request (few per step under a token budget), reading the fresh K/V directly
when the request has no cached context, otherwise the paged context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata
from tinyvllm.attention.layer import Attention


@dataclass
class _PrefillSpan:
    start: int  # first token of the chunk in the flattened batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor  # blocks covering the whole context incl. this chunk


@dataclass
class _TorchPlan:
    decode_token_idx: torch.Tensor | None  # [Bd] flattened token index of each decode query
    decode_blocks: torch.Tensor | None  # [Bd, nb] block ids covering the longest decode context
    decode_key_pos: torch.Tensor | None  # [1, nb * block_size] key positions
    decode_query_pos: torch.Tensor | None  # [Bd, 1] position of each decode query
    prefills: list[_PrefillSpan]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, metadata: AttentionMetadata) -> None:
        qsl = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        bs = metadata.block_size
        decode_rows: list[int] = []
        prefills: list[_PrefillSpan] = []
        for i in range(metadata.num_reqs):
            q_len = qsl[i + 1] - qsl[i]
            if q_len == 1:
                decode_rows.append(i)
            elif q_len > 1:
                nb = -(-seq_lens[i] // bs)
                prefills.append(
                    _PrefillSpan(
                        qsl[i], qsl[i + 1], seq_lens[i] - q_len, metadata.block_table[i, :nb].long()
                    )
                )
        plan = _TorchPlan(None, None, None, None, prefills)
        if decode_rows:
            device = metadata.block_table.device
            rows = torch.tensor(decode_rows, device=device)
            max_len = max(seq_lens[i] for i in decode_rows)
            nb = -(-max_len // bs)
            plan.decode_token_idx = metadata.query_start_loc[rows].long()
            plan.decode_blocks = metadata.block_table[rows, :nb].long()
            plan.decode_key_pos = torch.arange(nb * bs, device=device).unsqueeze(0)
            plan.decode_query_pos = (metadata.seq_lens[rows] - 1).long().unsqueeze(1)
        metadata.plan = plan

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan: _TorchPlan = metadata.plan
        n = metadata.num_actual_tokens
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        k_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        v_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        slots = metadata.slot_mapping[:n]
        k_cache.index_copy_(0, slots, key[:n])
        v_cache.index_copy_(0, slots, value[:n])

        out = torch.empty_like(query)
        for span in plan.prefills:
            out[span.start : span.end] = self._prefill(layer, query, key, value, kv_cache, span)
        if plan.decode_token_idx is not None:
            out[plan.decode_token_idx] = self._decode(layer, query, kv_cache, plan)
        return out

    def _prefill(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        span: _PrefillSpan,
    ) -> torch.Tensor:
        q = query[span.start : span.end].transpose(0, 1)  # [Hq, q_len, D]
        q_len = span.end - span.start
        if span.context_len == 0:
            k = key[span.start : span.end].transpose(0, 1)
            v = value[span.start : span.end].transpose(0, 1)
        else:
            kv_len = span.context_len + q_len
            k = kv_cache[0][span.block_ids].flatten(0, 1)[:kv_len].transpose(0, 1)
            v = kv_cache[1][span.block_ids].flatten(0, 1)[:kv_len].transpose(0, 1)
        if span.context_len == 0 and layer.sliding_window is None:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=layer.scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(span.context_len, span.context_len + q_len, device=q.device)
            k_pos = torch.arange(k.shape[1], device=q.device)
            diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
            mask = diff >= 0
            if layer.sliding_window is not None:
                mask &= diff < layer.sliding_window
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=True
            )
        return o.transpose(0, 1)

    def _decode(
        self, layer: Attention, query: torch.Tensor, kv_cache: torch.Tensor, plan: _TorchPlan
    ) -> torch.Tensor:
        assert plan.decode_blocks is not None and plan.decode_token_idx is not None
        num_seqs = plan.decode_blocks.shape[0]
        num_kv_heads = kv_cache.shape[3]
        group = layer.num_heads // num_kv_heads
        # [Bd, nb, bs, Hkv, D] -> [Bd, Hkv, L, D]
        k = kv_cache[0][plan.decode_blocks].flatten(1, 2).transpose(1, 2)
        v = kv_cache[1][plan.decode_blocks].flatten(1, 2).transpose(1, 2)
        q = query[plan.decode_token_idx].view(num_seqs, num_kv_heads, group, layer.head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * layer.scale  # [Bd, Hkv, G, L]
        diff = plan.decode_query_pos - plan.decode_key_pos  # [Bd, L]
        mask = diff >= 0
        if layer.sliding_window is not None:
            mask &= diff < layer.sliding_window
        if layer.logits_soft_cap is not None:
            scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        o = torch.matmul(probs, v)  # [Bd, Hkv, G, D]
        return o.view(num_seqs, layer.num_heads, layer.head_dim)
