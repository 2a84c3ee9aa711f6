"""Random paged-attention batches and a dense reference, shared by the attention backend tests.

`make_case` builds one step: requests with given context and query lengths, their blocks
scattered at random over the cache, optional padded requests (query length 0, seq_len 0) and
padded tokens (slot -1) after the real ones, as CUDA-graph replays pass them.
`reference_attention` recomputes every real token's output densely from the cache;
`paged_decode_reference` does the same for the native decode op's arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.attention.layer import Attention


@dataclass
class Case:
    layer: Attention
    metadata: AttentionMetadata
    query: torch.Tensor  # [T, Hq, D], T = real tokens + padded tokens
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # before this step's store
    num_real_tokens: int

    def expected_cache(self) -> torch.Tensor:
        """The cache after this step's K/V store (padded slots untouched)."""
        cache = self.kv_cache.clone()
        _, _, _, hkv, d = cache.shape
        n = self.num_real_tokens
        slots = self.metadata.slot_mapping[:n]
        cache[0].view(-1, hkv, d).index_copy_(0, slots, self.key[:n].to(cache.dtype))
        cache[1].view(-1, hkv, d).index_copy_(0, slots, self.value[:n].to(cache.dtype))
        return cache


def make_case(
    gen: torch.Generator,
    *,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    # One span per request, or (a list per request) several: [num_reqs, K, 2] ranges.
    bidirectional: Sequence[tuple[int, int] | list[tuple[int, int]]] | None = None,
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    spare_blocks: int = 3,
) -> Case:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for n in blocks_per_req:
        tables.append(order[:n])
        order = order[n:]
    width = max([*blocks_per_req, 1]) + 1  # a spare column, as real block tables have
    starts, slots = [0], []
    for table, ctx, q_len in zip(tables, context_lens, query_lens, strict=True):
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)
        ]
        starts.append(starts[-1] + q_len)
    num_real = starts[-1]
    starts += [num_real] * pad_reqs
    seq_lens_all = seq_lens + [0] * pad_reqs
    rows = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad_reqs
    total = num_real + pad_tokens

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    ranges = None
    if bidirectional is not None:
        if any(isinstance(b, list) for b in bidirectional):
            k = max(len(b) for b in bidirectional if isinstance(b, list))
            lists = [b if isinstance(b, list) else [b] for b in bidirectional]
            rows_k = [b + [(0, 0)] * (k - len(b)) for b in lists] + [[(0, 0)] * k] * pad_reqs
            ranges = torch.tensor(rows_k, dtype=torch.int32, device=device)
        else:
            spans = list(bidirectional) + [(0, 0)] * pad_reqs
            ranges = torch.tensor(spans, dtype=torch.int32, device=device)
    metadata = AttentionMetadata(
        num_reqs=len(query_lens) + pad_reqs,
        num_actual_tokens=num_real,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens_all, dtype=torch.int32, device=device),
        block_table=torch.tensor(rows, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64, device=device),
        max_query_len=max([*query_lens, 1]),
        max_seq_len=max([*seq_lens, 1]),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens_all,
        block_size=block_size,
        bidirectional_ranges=ranges,
    )
    layer = Attention(
        0, num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window, soft_cap
    )
    return Case(
        layer=layer,
        metadata=metadata,
        query=rand(total, num_heads, head_dim),
        key=rand(total, num_kv_heads, head_dim),
        value=rand(total, num_kv_heads, head_dim),
        kv_cache=rand(2, num_blocks, block_size, num_kv_heads, head_dim),
        num_real_tokens=num_real,
    )


def reference_attention(case: Case, cache: torch.Tensor) -> torch.Tensor:
    """[num_real_tokens, Hq, D] in fp64, from the stored cache, one query at a time."""
    md, layer = case.metadata, case.layer
    group = layer.num_heads // layer.num_kv_heads
    bs = md.block_size
    qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    ranges = md.bidirectional_ranges
    if ranges is not None and ranges.dim() == 2:
        ranges = ranges[:, None]
    ranges = ranges.tolist() if ranges is not None else None
    out = torch.zeros(case.num_real_tokens, layer.num_heads, layer.head_dim, dtype=torch.float64)
    for r in range(md.num_reqs):
        q_len, seq_len = qsl[r + 1] - qsl[r], seq_lens[r]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len)
        slots = md.block_table[r].cpu().long()[pos // bs] * bs + pos % bs
        k = cache[0].flatten(0, 1)[slots.to(cache.device)].cpu().double()  # [S, Hkv, D]
        v = cache[1].flatten(0, 1)[slots.to(cache.device)].cpu().double()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = case.query[qsl[r] : qsl[r + 1]].cpu().double().transpose(0, 1)  # [Hq, q_len, D]
        q_pos = torch.arange(seq_len - q_len, seq_len)
        diff = q_pos[:, None] - pos[None, :]
        visible = diff >= 0
        for start, end in ranges[r] if ranges is not None else ():
            q_in = (q_pos >= start) & (q_pos < end)
            k_in = (pos >= start) & (pos < end)
            visible |= q_in[:, None] & k_in[None, :]
        # transformers' Gemma 3 sliding mask: the window bounds the span's keys too.
        if layer.sliding_window is not None:
            visible &= diff < layer.sliding_window
        scores = q @ k.transpose(1, 2) * layer.scale
        if layer.logits_soft_cap:
            scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qsl[r] : qsl[r + 1]] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double().cpu() - want.double().cpu()).abs().max().item()


def paged_decode_reference(q, kv, seq_lens, block_table, scale, window, cap) -> torch.Tensor:
    """Query token i over the first seq_lens[i] positions of block_table[i], in float64 (the
    native tv_paged_decode's contract; its kv layout [2][blocks][block_size][Hkv][D])."""
    _, _, _, hkv, d = kv.shape
    group = q.shape[1] // hkv
    outs = []
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        ids = block_table[i].long()
        k = kv[0][ids].reshape(-1, hkv, d)[:n].double().repeat_interleave(group, 1)
        v = kv[1][ids].reshape(-1, hkv, d)[:n].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
        if cap:
            s = torch.tanh(s / cap) * cap
        if window:
            s[:, : max(0, n - window)] = float("-inf")
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
    return torch.stack(outs)
