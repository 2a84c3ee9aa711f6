"""CPU / reference attention backend in plain torch.

Work is planned once per step and shared by all layers. Decode tokens (query length 1) of all
requests run as one batched matmul over K/V gathered through the block table; prefill chunks run
one SDPA call per request (few per step under a token budget), reading the fresh K/V directly
when the request has no cached context, otherwise the paged context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata
from tinyvllm.attention.layer import Attention
from tinyvllm.attention.prefill_amx import AmxPrefillAttention
from tinyvllm.attention.prefill_f32 import Fp32PrefillAttention
from tinyvllm.attention.prompt_batch import PromptBatch
from tinyvllm.native.ops import MAX_LINEAR_ROWS
from tinyvllm.utils.cpu import has_native_bf16_matmul


@dataclass
class _PrefillSpan:
    start: int  # first token of the chunk in the flattened batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor  # blocks covering the whole context incl. this chunk
    # Bidirectional spans [start, end) that let some query of this chunk see a later key.
    bidirectional: list[tuple[int, int]] | None = None


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor  # [n] flattened token index of each decode query
    blocks: torch.Tensor  # [n, nb] block ids covering the group's longest context
    query_pos: torch.Tensor  # [n, 1] position of each decode query
    # True when the group is the whole batch in batch order (a decode-only step whose
    # requests are already sorted by context length): no gather or scatter of queries needed.
    is_whole_batch: bool = False
    # Additive masks [n, 1, 1, nb * block_size] by sliding window, built once per step.
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None, block_size: int) -> torch.Tensor:
        mask = self.masks.get(sliding_window)
        if mask is None:
            key_pos = torch.arange(self.blocks.shape[1] * block_size, device=self.blocks.device)
            diff = self.query_pos - key_pos
            visible = diff >= 0
            if sliding_window is not None:
                visible &= diff < sliding_window
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            mask.masked_fill_(~visible, float("-inf"))
            mask = self.masks[sliding_window] = mask[:, None, None, :]
        return mask


@dataclass
class _TorchPlan:
    decode_groups: list[_DecodeGroup]
    prefills: list[_PrefillSpan]
    # Set when the step is only fresh prompts of this one length, back to back, with no cached
    # context and no bidirectional span (e.g. a batch of equal prompts, or one long prompt):
    # causal layers then attend them as one batched SDPA call.
    uniform_len: int | None = None
    # The prompts and chunks a native prefill kernel may attend in one call
    # (TorchAttentionBackend._kernel_prompts): those without a bidirectional span.
    prompts: PromptBatch | None = None


# Decode queries are attended in groups of similar context length: each group pads only to its
# own longest context, and its gathered K/V stays small enough to be cache-resident (on a 2-core
# EPYC, 64 sequences of ~650 tokens: 76 ms per layer as one padded batch, 19 ms in groups of
# 8 x 1024 padded tokens).
_DECODE_GROUP_TOKENS = 8192


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # The native prefill kernels (AMX for bf16 prefill, FMA for fp32), looked up on first use
    # from the native library of a subclass that has one (`ops`, NativeCpuAttentionBackend).
    _prompt_kernels: tuple[AmxPrefillAttention | None, Fp32PrefillAttention | None] | None = None

    def _prompt_kernel(
        self, prefill_dtype: torch.dtype
    ) -> AmxPrefillAttention | Fp32PrefillAttention | None:
        """The native kernel for prefill attention computed in `prefill_dtype` (None: none)."""
        kernels = self._prompt_kernels
        if kernels is None:
            ops = getattr(self, "ops", None)
            kernels = (None, None)
            if ops is not None:
                kernels = (
                    AmxPrefillAttention.load(ops.lib, ops.num_threads),
                    Fp32PrefillAttention.load(ops.lib, ops.num_threads),
                )
            self._prompt_kernels = kernels
        return kernels[0] if prefill_dtype == torch.bfloat16 else kernels[1]

    def plan(self, metadata: AttentionMetadata) -> None:
        qsl = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        bs = metadata.block_size
        ranges = _span_lists(metadata.bidirectional_ranges)
        decode_rows: list[int] = []
        prefills: list[_PrefillSpan] = []
        for i in range(metadata.num_reqs):
            q_len = qsl[i + 1] - qsl[i]
            # A decode query sits at seq_len - 1 and sees no key past itself: spans never
            # change decode attention.
            if q_len == 1:
                decode_rows.append(i)
            elif q_len > 1:
                nb = -(-seq_lens[i] // bs)
                context_len = seq_lens[i] - q_len
                span = _PrefillSpan(
                    qsl[i], qsl[i + 1], context_len, metadata.block_table[i, :nb].long()
                )
                if ranges is not None:
                    # Some query in a span must have a later key in the span and context.
                    effective = [
                        (start, end)
                        for start, end in ranges[i]
                        if max(start, context_len) < min(end, seq_lens[i]) - 1
                    ]
                    span.bidirectional = effective or None
                prefills.append(span)
        decode_rows.sort(key=lambda i: seq_lens[i])
        groups: list[_DecodeGroup] = []
        members: list[int] = []
        for i in decode_rows:
            # Sorted ascending, so row i sets the group's padded length if it joins.
            if members and (len(members) + 1) * seq_lens[i] > _DECODE_GROUP_TOKENS:
                groups.append(self._decode_group(metadata, members))
                members = []
            members.append(i)
        if members:
            groups.append(self._decode_group(metadata, members))
        metadata.plan = _TorchPlan(
            groups,
            prefills,
            _uniform_len(prefills, decode_rows),
            # Only where a kernel may take them (the native backend, steps past what the
            # native decode program runs): other steps and backends skip the tensors.
            PromptBatch.build([span for span in prefills if not span.bidirectional])
            if prefills
            and metadata.num_actual_tokens > MAX_LINEAR_ROWS
            and getattr(self, "ops", None) is not None
            else None,
        )

    @staticmethod
    def _decode_group(metadata: AttentionMetadata, members: list[int]) -> _DecodeGroup:
        device = metadata.block_table.device
        rows = torch.tensor(members, device=device)
        nb = -(-metadata.seq_lens_cpu[members[-1]] // metadata.block_size)
        return _DecodeGroup(
            token_idx=metadata.query_start_loc[rows].long(),
            blocks=metadata.block_table[rows, :nb].long(),
            query_pos=(metadata.seq_lens[rows] - 1).long().unsqueeze(1),
            is_whole_batch=members == list(range(metadata.num_actual_tokens)),
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
        plan: _TorchPlan = metadata.plan
        n = metadata.num_actual_tokens
        self.store_kv(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n])

        # CPUs without bf16/fp16 dot-product units emulate those matmuls many times slower than
        # fp32, and attention is a small share of the FLOPs: compute it in fp32 there.
        compute_dtype = query.dtype
        if query.device.type == "cpu" and query.dtype != torch.float32:
            compute_dtype = torch.float32
        if len(plan.decode_groups) == 1 and plan.decode_groups[0].is_whole_batch:
            group = plan.decode_groups[0]
            return self._decode(layer, query.to(compute_dtype), kv_cache, group).to(query.dtype)
        out = torch.empty_like(query)
        q = None
        if plan.prefills:
            # With AVX512-BF16 / AMX, bf16 prefill SDPA is ~3x faster than fp32 (a 512-token
            # SmolLM2-135M head group: 0.9 vs 2.6 ms) and is what HF computes in bf16. Decode
            # and steps the native decode program can take (up to MAX_LINEAR_ROWS tokens) stay
            # in fp32, the precision of the native kernels they must agree with bit for bit.
            prefill_dtype = compute_dtype
            if (
                query.dtype == torch.bfloat16
                and query.device.type == "cpu"
                and n > MAX_LINEAR_ROWS
                and has_native_bf16_matmul()
            ):
                prefill_dtype = query.dtype
            spans = plan.prefills
            if n > MAX_LINEAR_ROWS:
                spans = self._kernel_prompts(
                    plan, layer, query, key, value, kv_cache, out, prefill_dtype
                )
            if spans:
                q = query.to(prefill_dtype)
                key, value = key.to(prefill_dtype), value.to(prefill_dtype)
            uniform = plan.uniform_len
            if (
                spans
                and uniform is not None
                and uniform * len(plan.prefills) == query.shape[0]  # no padding rows
                and _plain_causal(layer, uniform)
            ):
                return _uniform_prefill(layer, q, key, value, uniform).to(query.dtype)
            for span in spans:
                out[span.start : span.end] = self._prefill(layer, q, key, value, kv_cache, span)
        if plan.decode_groups:
            q = q if q is not None and q.dtype == compute_dtype else query.to(compute_dtype)
            for group in plan.decode_groups:
                out[group.token_idx] = self._decode(layer, q, kv_cache, group).to(out.dtype)
        return out

    def _kernel_prompts(
        self,
        plan: _TorchPlan,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        prefill_dtype: torch.dtype,
    ) -> list[_PrefillSpan]:
        """Attend the step's prompts and chunks (plain causal, with or without cached context)
        in one native kernel call where one runs (AMX for bf16 prefill; FMA in fp32 on the
        model's bf16 or fp32 rows otherwise); returns the spans left for `_prefill`.

        Why: otherwise each runs its own SDPA call, with an explicit mask and the context
        gathered from the cache when it has one: 64 prompts of 64-512 tokens prefilled at
        ~3,500 tok/s that way against ~5,000 with the AMX kernel, and a 300-token chunk after
        200 cached tokens took ~18 ms a layer in SDPA. In fp32 the kernel also skips the
        copies of q / k / v to fp32 and back."""
        batch = plan.prompts
        kernel = self._prompt_kernel(prefill_dtype)
        if (
            batch is None
            or kernel is None
            or out.stride(1) != out.shape[2]
            or not kernel.fits(query, key, value)
            or not _plain_causal(layer, batch.longest_keys)
            or (batch.context_lens is not None and not kernel.fits_cache(kv_cache, key))
        ):
            return plan.prefills
        kernel.attend(query, key, value, out, batch, layer.scale, kv_cache)
        attended = {id(span) for span in batch.spans}
        return [span for span in plan.prefills if id(span) not in attended]

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """key / value [T, Hkv, D] into the paged cache at `slots`."""
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)

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
            k = kv_cache[0][span.block_ids].flatten(0, 1)[:kv_len].transpose(0, 1).to(q.dtype)
            v = kv_cache[1][span.block_ids].flatten(0, 1)[:kv_len].transpose(0, 1).to(q.dtype)
        if (
            span.context_len == 0
            and layer.sliding_window is None
            and not layer.logits_soft_cap
            and span.bidirectional is None
        ):
            o = _sdpa(q, k, v, None, layer.scale)
        else:
            q_pos = torch.arange(span.context_len, span.context_len + q_len, device=q.device)
            k_pos = torch.arange(k.shape[1], device=q.device)
            diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
            mask = diff >= 0
            for start, end in span.bidirectional or ():
                q_in = (q_pos >= start) & (q_pos < end)
                k_in = (k_pos >= start) & (k_pos < end)
                mask |= q_in.unsqueeze(1) & k_in.unsqueeze(0)
            # The window bounds the span's keys too (transformers' Gemma 3 sliding mask:
            # AND(window, OR(causal, same image))).
            if layer.sliding_window is not None:
                mask &= diff < layer.sliding_window
            if layer.logits_soft_cap:
                bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device)
                bias.masked_fill_(~mask, float("-inf"))
                o = self._soft_capped(layer, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), bias)
                o = o.squeeze(0)
            else:
                o = _sdpa(q, k, v, mask, layer.scale)
        return o.transpose(0, 1)

    def _decode(
        self, layer: Attention, query: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup
    ) -> torch.Tensor:
        num_seqs, num_blocks = group.blocks.shape
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        kv_len = num_blocks * block_size
        # One gather for K and V together, then one copy into [2, n, Hkv, L, D] in the compute
        # dtype, so that SDPA runs on contiguous operands.
        kv = torch.empty(
            (2, num_seqs, num_kv_heads, kv_len, head_dim), dtype=query.dtype, device=query.device
        )
        gathered = kv_cache[:, group.blocks].view(2, num_seqs, kv_len, num_kv_heads, head_dim)
        kv.copy_(gathered.transpose(2, 3))
        q = query if group.is_whole_batch else query[group.token_idx]
        mask = group.mask(layer.sliding_window, block_size)
        if layer.logits_soft_cap is not None:
            return self._soft_capped(layer, q.unsqueeze(2), kv[0], kv[1], mask).squeeze(2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            kv[0],
            kv[1],
            attn_mask=mask.to(q.dtype),
            scale=layer.scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    @staticmethod
    def _soft_capped(
        layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention with tanh logit soft-capping (Gemma-style), which SDPA cannot express."""
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * layer.scale
        cap = layer.logits_soft_cap
        assert cap is not None
        scores = torch.tanh(scores / cap) * cap + mask
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA of one request's [heads, L, D] operands, causal unless `mask` is given.

    Run with a batch dimension: on CPU, 3-D operands take the unfused math fallback (a full
    [Hq, Lq, Lk] score matrix in a few separate kernels), 10-25x slower for a 2k-token prefill
    than the fused flash kernel that the same call gets in 4-D."""
    o = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(0)


def _plain_causal(layer: Attention, length: int) -> bool:
    """Whether the layer attends prompts of `length` tokens with a plain causal mask."""
    window = layer.sliding_window
    return not layer.logits_soft_cap and (window is None or window >= length)


def _uniform_prefill(
    layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int
) -> torch.Tensor:
    """Causal SDPA over [B * length, H, D] rows, B prompts of `length` tokens, as one call.

    One call instead of one per request: the flash kernel parallelises over the whole batch
    (one parallel region, not B), and its output, [B, L, H, D] in memory, is the rows' layout
    already, so no copy into a step-wide buffer is needed."""

    def batched(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, length, t.shape[1], t.shape[2]).transpose(1, 2)

    o = F.scaled_dot_product_attention(
        batched(q), batched(k), batched(v), is_causal=True, scale=layer.scale, enable_gqa=True
    )
    return o.transpose(1, 2).reshape(q.shape)


def _uniform_len(prefills: list[_PrefillSpan], decode_rows: list[int]) -> int | None:
    """The common length of a step made only of fresh, equally long prompts laid out back to
    back from token 0 (None: any other step)."""
    if decode_rows or not prefills:
        return None
    length = prefills[0].end - prefills[0].start
    for i, span in enumerate(prefills):
        if (
            span.start != i * length
            or span.end != (i + 1) * length
            or span.context_len
            or span.bidirectional
        ):
            return None
    return length


def _span_lists(ranges: torch.Tensor | None) -> list[list[tuple[int, int]]] | None:
    """Per request, its bidirectional spans: `ranges` is [num_reqs, 2] (one span each) or
    [num_reqs, K, 2] (up to K, (0, 0) padding)."""
    if ranges is None:
        return None
    rows = ranges.tolist()
    if ranges.dim() == 2:
        return [[(start, end)] for start, end in rows]
    return [[(start, end) for start, end in row] for row in rows]
