"""The fp32 causal prefill kernel for CPUs without AMX (native prefill_attn_f32.h, AVX2 and
AVX-512 Foundation): the result of torch's fp32 SDPA up to summation order, and the step paths
that use it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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

from tinyvllm.attention.prefill_f32 import Fp32PrefillAttention
from tinyvllm.attention.prompt_batch import PromptBatch
from tinyvllm.native.ops import NativeCpuOps
from tinyvllm.utils.cpu import cpu_flags

AVX2, BEST = 1, 0  # tv_set_isa: AVX2 only, or the best this CPU has


@pytest.fixture(scope="module")
def ops() -> NativeCpuOps:
    ops = NativeCpuOps.load()
    if ops is None:
        pytest.skip("the native kernels do not build here")
    return ops


@pytest.fixture(params=[BEST, AVX2], ids=["best", "avx2"])
def kernel(request: pytest.FixtureRequest, ops: NativeCpuOps) -> Iterator[Fp32PrefillAttention]:
    if request.param == BEST and not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags():
        pytest.skip("the best kernel here is the AVX2 one")
    ops.lib.tv_set_isa(request.param)
    try:
        yield Fp32PrefillAttention.load(ops.lib, ops.num_threads)
    finally:
        ops.lib.tv_set_isa(BEST)


def _sdpa_and_exact(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fp32 SDPA of one prompt's [L, H, D] rows (causal, or under `mask`) rounded to
    q's dtype, and the same in fp64."""
    args = [t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    kw: dict[str, Any] = {"scale": scale, "enable_gqa": True}
    kw.update({"is_causal": True} if mask is None else {"attn_mask": mask})
    sdpa = F.scaled_dot_product_attention(*args, **kw)[0].transpose(0, 1).to(q.dtype)
    exact = F.scaled_dot_product_attention(*(t.double() for t in args), **kw)
    return sdpa, exact[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [0.125, 0.1])
@pytest.mark.parametrize(
    ("prompts", "length", "hq", "hkv", "dim"),
    [
        (8, 64, 9, 3, 64),  # SmolLM2's heads
        (3, 37, 4, 2, 64),  # neither the length nor a micro-tile of 6 rows full
        (2, 100, 8, 8, 128),  # no grouping, two output passes at AVX-512's width
        (1, 600, 4, 1, 64),  # three chunks of keys: the online softmax's rescaling
        (2, 1, 2, 1, 64),  # one-token prompts
        (2, 77, 4, 2, 16),  # head_dim 16: the AVX2 kernel on any CPU
    ],
)
def test_kernel_matches_torch_fp32_sdpa(
    kernel: Fp32PrefillAttention,
    prompts: int,
    length: int,
    hq: int,
    hkv: int,
    dim: int,
    scale: float,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(length)
    q, k, v = fused_qkv(gen, prompts * length, hq, hkv, dim, dtype)
    assert kernel.fits(q, k, v)
    out = torch.empty(q.shape, dtype=dtype)
    starts = torch.arange(0, prompts * length, length, dtype=torch.int64)
    lens = torch.full((prompts,), length, dtype=torch.int64)
    kernel.attend(q, k, v, out, PromptBatch([], starts, lens, length), scale)
    for start in starts.tolist():
        rows = slice(start, start + length)
        sdpa, exact = _sdpa_and_exact(q[rows], k[rows], v[rows], scale, None)
        # fp32 throughout: as close to the fp64 result as torch's, and in bf16 (one rounding
        # at the end) almost always the very same bits.
        assert max_error(out[rows], exact) <= max_error(sdpa, exact) * 1.5 + 1e-5
        if dtype == torch.bfloat16:
            assert (out[rows] == sdpa).float().mean().item() > 0.98


def test_kernel_takes_only_its_layout() -> None:
    q, k, v = fused_qkv(torch.Generator().manual_seed(1), 32, 4, 2, 64, torch.bfloat16)
    fits = Fp32PrefillAttention.fits
    assert fits(q, k, v) and fits(q.float(), k.float(), v.float())
    assert not fits(q.half(), k.half(), v.half())
    assert not fits(q.float(), k, v)  # mixed dtypes
    assert not fits(q[:, :, :24], k[:, :, :24], v[:, :, :24])  # head_dim 24
    assert not fits(q[:, :3], k, v)  # 3 query heads on 2 KV heads
    assert not fits(q.transpose(0, 1), k, v)
    wide = fused_qkv(torch.Generator().manual_seed(1), 4, 2, 1, 272, torch.float32)
    assert not fits(*wide)  # head_dim past the kernel's buffers


def test_kernel_attends_prompts_of_any_lengths_in_one_call(kernel: Fp32PrefillAttention) -> None:
    """One call over prompts of different lengths (micro-tiles, key tiles and 48-row items left
    partly empty; one past a chunk of keys), with rows between them that are not its own: each
    prompt as SDPA computes it alone, the other rows untouched."""
    q, k, v, out, prompts = attend_gapped_prompts(kernel)
    for start, length in prompts.tolist():
        rows = slice(start, start + length)
        sdpa, exact = _sdpa_and_exact(q[rows], k[rows], v[rows], 0.125, None)
        assert max_error(out[rows], exact) <= max_error(sdpa, exact) * 1.5 + 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 5])
def test_kernel_continues_prompts_after_their_cached_tokens(
    kernel: Fp32PrefillAttention, block_size: int, dtype: torch.dtype
) -> None:
    """A fresh prompt beside chunks after 16-290 cached tokens, in caches of either dtype with
    blocks of 16 or 5 tokens: each chunk as fp32 SDPA of its context and own keys computes it
    under the causal mask."""
    check_chunks_after_context(kernel, [0, 290, 31, 16], block_size, dtype, torch.float32, 1e-5)


@pytest.mark.parametrize(("query_lens", "context_lens", "kernel_prompts"), BACKEND_STEPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_backend_attends_prompts_with_the_kernel_without_bf16_matmul(
    monkeypatch: pytest.MonkeyPatch,
    ops: NativeCpuOps,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    kernel_prompts: list[int],
    dtype: torch.dtype,
) -> None:
    out, reference, calls = backend_step(
        monkeypatch, ops, Fp32PrefillAttention, query_lens, context_lens, dtype, False
    )
    assert calls == kernel_prompts
    assert max_error(out, reference) < (1e-4 if dtype == torch.float32 else 2e-2)


def test_torch_openmp_team_and_thread_pool_give_the_same_bits(ops: NativeCpuOps) -> None:
    # Items are independent and each runs the same operations wherever it runs.
    kernel = Fp32PrefillAttention.load(ops.lib, ops.num_threads)
    assert kernel.omp_parallel is not None  # torch's CPU wheels run on OpenMP
    pool = Fp32PrefillAttention(ops.lib, ops.num_threads, None)
    q, k, v = fused_qkv(torch.Generator().manual_seed(3), 4 * 96, 9, 3, 64, torch.float32)
    batch = PromptBatch([], torch.arange(0, 4 * 96, 96), torch.full((4,), 96), 96)
    outs = []
    for each in (kernel, pool):
        out = torch.empty(q.shape)
        each.attend(q, k, v, out, batch, 0.125)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
