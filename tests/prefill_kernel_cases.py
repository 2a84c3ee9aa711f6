"""Cases shared by the tests of the native prefill attention kernels (test_prefill_amx.py,
test_prefill_f32.py): q / k / v as the model hands them over, prompts with gaps between them,
chunks after context in a scattered paged cache, and a backend step that counts kernel calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from attention_cases import make_case, max_error, reference_attention

from tinyvllm.attention.prompt_batch import PromptBatch
from tinyvllm.native.ops import NativeCpuOps


def fused_qkv(
    gen: torch.Generator,
    tokens: int,
    hq: int,
    hkv: int,
    dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q / k / v as the model hands them over: head views of one fused projection's rows."""
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen).mul(2).to(dtype)
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=1)
    return q.view(tokens, hq, dim), k.view(tokens, hkv, dim), v.view(tokens, hkv, dim)


def attend_gapped_prompts(kernel: Any) -> tuple[torch.Tensor, ...]:
    """One kernel call over bf16 prompts of different lengths (1 to 300 tokens) with rows
    between them that belong to no prompt; asserts those rows are untouched. Returns q, k, v,
    out and each prompt's first row and length ([n, 2])."""
    lens, gaps = [1, 17, 64, 100, 300, 33], [0, 2, 1, 0, 3, 1]
    starts, row = [], 0
    for gap, length in zip(gaps, lens, strict=True):
        starts.append(row + gap)
        row += gap + length
    q, k, v = fused_qkv(torch.Generator().manual_seed(5), row, 9, 3)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    batch = PromptBatch([], torch.tensor(starts), torch.tensor(lens), max(lens))
    kernel.attend(q, k, v, out, batch, 0.125)
    mine = torch.zeros(row, dtype=torch.bool)
    for start, length in zip(starts, lens, strict=True):
        mine[start : start + length] = True
    assert (out[~mine] == 7.0).all()
    return q, k, v, out, torch.tensor([starts, lens]).T


@dataclass
class Span:
    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor


def check_chunks_after_context(
    kernel: Any,
    contexts: list[int],
    block_size: int,
    dtype: torch.dtype,
    sdpa_dtype: torch.dtype,
    slack: float,
) -> None:
    """One kernel call over chunks of 70, 33, 1 and 40 rows after contexts[i] cached tokens
    (9 query / 3 KV heads, head_dim 64, blocks scattered over a paged cache, the chunks' own
    K / V stored there first): each chunk as close to fp64 as SDPA in `sdpa_dtype` of its
    context and own keys under the causal mask (1.5x its error, plus `slack`)."""
    gen = torch.Generator().manual_seed(6)
    hq, hkv, lens = 9, 3, [70, 33, 1, 40]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(contexts, lens, strict=True))
    cache = torch.randn(2, num_blocks + 8, block_size, hkv, 64, generator=gen).mul(2).to(dtype)
    q, k, v = fused_qkv(gen, sum(lens), hq, hkv, 64, dtype)
    spans = chunks_after_context(gen, cache, k, v, lens, contexts)
    batch = PromptBatch.build(spans)
    assert batch is not None and kernel.fits_cache(cache, k)
    out = torch.zeros(q.shape, dtype=dtype)
    kernel.attend(q, k, v, out, batch, 0.125, cache)
    for span in spans:
        sdpa, exact = span_sdpa(q, cache, span, 0.125, sdpa_dtype)
        got = out[span.start : span.end]
        assert max_error(got, exact) <= max_error(sdpa, exact) * 1.5 + slack


# (query lengths, context lengths, the prompts of each kernel call) of one backend step
BACKEND_STEPS = [
    ((80, 80, 80), (0, 0, 0), [3]),  # equal prompts: instead of the uniform path's SDPA
    ((80, 79), (0, 0), [2]),
    # A chunk continuing a prompt joins them; a decode token stays with torch's path.
    ((80, 40, 1, 90), (0, 50, 30, 0), [3]),
    ((100, 60), (37, 150), [2]),
    ((40, 1), (50, 30), []),  # 41 tokens: a step the native decode program could run
]


def chunks_after_context(
    gen: torch.Generator,
    cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: list[int],
    contexts: list[int],
) -> list[Span]:
    """Chunks of `lens` rows of k / v after contexts[i] cached tokens, in blocks scattered over
    the paged cache [2, blocks, block_size, Hkv, D]; the chunks' own K / V are stored there
    too, as the backend does before attention."""
    num_blocks, block_size = cache.shape[1], cache.shape[2]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spans, row = [], 0
    for length, ctx in zip(lens, contexts, strict=True):
        nb = -(-(ctx + length) // block_size)
        blocks, order = torch.tensor(order[:nb]), order[nb:]
        for i in range(length):
            pos = ctx + i
            cache[0, blocks[pos // block_size], pos % block_size] = k[row + i]
            cache[1, blocks[pos // block_size], pos % block_size] = v[row + i]
        spans.append(Span(row, row + length, ctx, blocks))
        row += length
    return spans


def span_sdpa(
    q: torch.Tensor, cache: torch.Tensor, span: Span, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA in `dtype` of a span's queries over its context and own keys from the cache, with
    the causal mask, rounded to q's dtype; and the same in fp64."""
    keys = span.context_len + span.end - span.start
    ck = cache[0][span.block_ids].flatten(0, 1)[:keys]
    cv = cache[1][span.block_ids].flatten(0, 1)[:keys]
    mask = torch.arange(span.context_len, keys)[:, None] >= torch.arange(keys)[None, :]
    args = [t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (q[span.start : span.end], ck, cv)]
    kw: dict[str, Any] = {"attn_mask": mask, "scale": scale, "enable_gqa": True}
    sdpa = F.scaled_dot_product_attention(*args, **kw)[0].transpose(0, 1).to(q.dtype)
    exact = F.scaled_dot_product_attention(*(t.double() for t in args), **kw)
    return sdpa, exact[0].transpose(0, 1)


def backend_step(
    monkeypatch: pytest.MonkeyPatch,
    ops: NativeCpuOps,
    kernel_class: type,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    dtype: torch.dtype,
    bf16_matmul: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One layer of a step through the native backend, on a CPU with or without bf16 matmul:
    its output, the fp64 reference, and the prompts of each call of `kernel_class.attend`."""
    import tinyvllm.attention.torch_attn as torch_attn
    from tinyvllm.attention.cpu_native import NativeCpuAttentionBackend

    monkeypatch.setattr(torch_attn, "has_native_bf16_matmul", lambda: bf16_matmul)
    calls: list[int] = []
    attend = kernel_class.attend

    def counting(self: Any, *args: Any) -> None:
        calls.append(args[4].starts.shape[0])  # the number of prompts
        attend(self, *args)

    monkeypatch.setattr(kernel_class, "attend", counting)
    case = make_case(
        torch.Generator().manual_seed(9),
        query_lens=query_lens,
        context_lens=context_lens,
        head_dim=64,
        dtype=dtype,
    )
    backend = NativeCpuAttentionBackend(ops)
    cache = case.kv_cache.clone()
    backend.plan(case.metadata)
    out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    return out, reference_attention(case, cache), calls
