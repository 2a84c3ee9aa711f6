"""The AMX causal prefill kernel for equal fresh prompts (native prefill_attn_amx.cpp): same
result as torch's flash SDPA up to summation order, and the step path that uses it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from attention_cases import make_case, max_error, reference_attention

from tinyvllm.attention.prefill_amx import AmxPrefillAttention
from tinyvllm.native.ops import NativeCpuOps


@pytest.fixture(scope="module")
def ops() -> NativeCpuOps:
    ops = NativeCpuOps.load()
    if ops is None:
        pytest.skip("the native kernels do not build here")
    return ops


@pytest.fixture(scope="module")
def kernel(ops: NativeCpuOps) -> AmxPrefillAttention:
    kernel = AmxPrefillAttention.load(ops.lib, ops.num_threads)
    if kernel is None:
        pytest.skip("no AMX-BF16 on this CPU")
    return kernel


def _fused_qkv(
    gen: torch.Generator, tokens: int, hq: int, hkv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q / k / v as the model hands them over: head views of one fused projection's rows."""
    qkv = torch.randn(tokens, (hq + 2 * hkv) * 64, generator=gen).mul(2).to(torch.bfloat16)
    q, k, v = qkv.split([hq * 64, hkv * 64, hkv * 64], dim=1)
    return q.view(tokens, hq, 64), k.view(tokens, hkv, 64), v.view(tokens, hkv, 64)


@pytest.mark.parametrize("scale", [0.125, 0.1])  # 0.1: the softmax's unfused scaling
@pytest.mark.parametrize(
    ("prompts", "length", "hq", "hkv"),
    [
        (8, 64, 9, 3),  # SmolLM2's heads
        (3, 37, 4, 2),  # neither the length nor a block of 16 rows full
        (2, 100, 8, 8),  # no grouping
        (1, 300, 2, 1),  # key tiles past the first 256
        (2, 1, 2, 1),  # one-token prompts
    ],
)
def test_kernel_matches_torch_flash_sdpa(
    kernel: AmxPrefillAttention, prompts: int, length: int, hq: int, hkv: int, scale: float
) -> None:
    q, k, v = _fused_qkv(torch.Generator().manual_seed(length), prompts * length, hq, hkv)
    assert kernel.fits(q, k, v)
    out = kernel(q, k, v, length, scale)

    def batched(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(prompts, length, -1, 64).transpose(1, 2)

    args = (batched(q), batched(k), batched(v))
    flash = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=True)
    flash = flash.transpose(1, 2).reshape(out.shape)
    exact = F.scaled_dot_product_attention(
        *(t.double() for t in args), is_causal=True, scale=scale, enable_gqa=True
    )
    exact = exact.transpose(1, 2).reshape(out.shape)
    # The same bf16 rounding points as the flash kernel: no further from the fp64 result,
    # and mostly the very same bits.
    assert max_error(out, exact) <= max_error(flash, exact) * 1.5 + 1e-3
    assert (out == flash).float().mean().item() > 0.85


def test_kernel_takes_only_its_layout(kernel: AmxPrefillAttention) -> None:
    q, k, v = _fused_qkv(torch.Generator().manual_seed(1), 32, 4, 2)
    assert not kernel.fits(q.float(), k.float(), v.float())
    assert not kernel.fits(q[:, :, :32], k[:, :, :32], v[:, :, :32])  # head_dim 32
    assert not kernel.fits(q[:, :3], k, v)  # 3 query heads on 2 KV heads
    assert not kernel.fits(q.transpose(0, 1), k, v)


@pytest.mark.parametrize(("query_lens", "amx_calls"), [((80, 80, 80), 1), ((80, 79), 0)])
def test_native_backend_attends_equal_fresh_bf16_prompts_with_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
    kernel: AmxPrefillAttention,
    ops: NativeCpuOps,
    query_lens: tuple[int, ...],
    amx_calls: int,
) -> None:
    import tinyvllm.attention.torch_attn as torch_attn
    from tinyvllm.attention.cpu_native import NativeCpuAttentionBackend

    monkeypatch.setattr(torch_attn, "has_native_bf16_matmul", lambda: True)
    calls = [0]
    run = AmxPrefillAttention.__call__

    def counting(self: AmxPrefillAttention, *args: Any) -> torch.Tensor:
        calls[0] += 1
        return run(self, *args)

    monkeypatch.setattr(AmxPrefillAttention, "__call__", counting)
    case = make_case(
        torch.Generator().manual_seed(9),
        query_lens=query_lens,
        context_lens=(0,) * len(query_lens),
        head_dim=64,
        dtype=torch.bfloat16,
    )
    backend = NativeCpuAttentionBackend(ops)
    cache = case.kv_cache.clone()
    backend.plan(case.metadata)
    out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    assert calls[0] == amx_calls
    assert max_error(out, reference_attention(case, cache)) < 2e-2


def test_torch_openmp_team_and_thread_pool_give_the_same_bits(kernel: AmxPrefillAttention) -> None:
    # The kernel runs its items on torch's OpenMP team (whose workers spin right after the
    # preceding GEMM) where it finds torch's runtime, else on the library's pool.
    assert kernel.omp_parallel is not None  # torch's CPU wheels run on OpenMP
    q, k, v = _fused_qkv(torch.Generator().manual_seed(3), 4 * 96, 9, 3)
    pool = AmxPrefillAttention(kernel.lib, kernel.num_threads, None)
    assert torch.equal(kernel(q, k, v, 96, 0.125), pool(q, k, v, 96, 0.125))
