"""The AMX causal prefill kernel for fresh prompts (native prefill_attn_amx.cpp): same result as
torch's flash SDPA up to summation order, and the step paths that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_cases import max_error
from prefill_kernel_cases import (
    BACKEND_STEPS,
    attend_gapped_prompts,
    backend_step,
    check_chunks_after_context,
    fused_qkv,
)

from tinyvllm.attention.prefill_amx import AmxPrefillAttention
from tinyvllm.attention.prompt_batch import PromptBatch
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


def _equal_prompts(
    kernel: AmxPrefillAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    length: int,
    scale: float,
) -> torch.Tensor:
    """The kernel over T / length prompts of `length` tokens laid out back to back."""
    n = q.shape[0] // length
    starts = torch.arange(0, n * length, length, dtype=torch.int64)
    lens = torch.full((n,), length, dtype=torch.int64)
    out = torch.empty(q.shape, dtype=q.dtype)
    kernel.attend(q, k, v, out, PromptBatch([], starts, lens, length), scale)
    return out


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
    q, k, v = fused_qkv(torch.Generator().manual_seed(length), prompts * length, hq, hkv)
    assert kernel.fits(q, k, v)
    out = _equal_prompts(kernel, q, k, v, length, scale)

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
    q, k, v = fused_qkv(torch.Generator().manual_seed(1), 32, 4, 2)
    assert not kernel.fits(q.float(), k.float(), v.float())
    assert not kernel.fits(q[:, :, :32], k[:, :, :32], v[:, :, :32])  # head_dim 32
    assert not kernel.fits(q[:, :3], k, v)  # 3 query heads on 2 KV heads
    assert not kernel.fits(q.transpose(0, 1), k, v)


def _flash_and_exact(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's flash SDPA of one prompt's [L, H, 64] rows, and the same in fp64."""
    args = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    flash = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=True)
    exact = F.scaled_dot_product_attention(
        *(t.double() for t in args), is_causal=True, scale=scale, enable_gqa=True
    )
    return flash[0].transpose(0, 1), exact[0].transpose(0, 1)


def test_kernel_attends_prompts_of_any_lengths_in_one_call(kernel: AmxPrefillAttention) -> None:
    """One call over prompts of different lengths (a block of 16 rows, the 32-key padding and
    the 64-row items each left partly empty), with rows between them that are not its own:
    each prompt as flash SDPA computes it alone, the other rows untouched."""
    q, k, v, out, prompts = attend_gapped_prompts(kernel)
    for start, length in prompts.tolist():
        rows = slice(start, start + length)
        flash, exact = _flash_and_exact(q[rows], k[rows], v[rows], 0.125)
        assert max_error(out[rows], exact) <= max_error(flash, exact) * 1.5 + 1e-3


def test_kernel_continues_prompts_after_their_cached_tokens(kernel: AmxPrefillAttention) -> None:
    """Chunks after context_len cached tokens (in blocks scattered over the paged cache, the
    chunk's own K / V stored there too, as the backend does first) next to a fresh prompt:
    each as SDPA over its context and own keys with the causal mask computes it."""
    check_chunks_after_context(kernel, [0, 150, 31, 16], 16, torch.bfloat16, torch.bfloat16, 1e-3)


@pytest.mark.parametrize(("query_lens", "context_lens", "kernel_prompts"), BACKEND_STEPS)
def test_native_backend_attends_fresh_bf16_prompts_with_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
    kernel: AmxPrefillAttention,
    ops: NativeCpuOps,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    kernel_prompts: list[int],
) -> None:
    out, reference, calls = backend_step(
        monkeypatch, ops, AmxPrefillAttention, query_lens, context_lens, torch.bfloat16, True
    )
    assert calls == kernel_prompts
    assert max_error(out, reference) < 2e-2


def test_torch_openmp_team_and_thread_pool_give_the_same_bits(kernel: AmxPrefillAttention) -> None:
    # The kernel runs its items on torch's OpenMP team (whose workers spin right after the
    # preceding GEMM) where it finds torch's runtime, else on the library's pool.
    assert kernel.omp_parallel is not None  # torch's CPU wheels run on OpenMP
    q, k, v = fused_qkv(torch.Generator().manual_seed(3), 4 * 96, 9, 3)
    pool = AmxPrefillAttention(kernel.lib, kernel.num_threads, None)
    assert torch.equal(
        _equal_prompts(kernel, q, k, v, 96, 0.125), _equal_prompts(pool, q, k, v, 96, 0.125)
    )
