"""The AVX-512 GEMVs (tinyvllm/native/avx512_kernels.cpp: vdpbf16ps on bf16 rows, 16-lane
GGUF block dot products) run where the CPU has them, agree with the AVX2 kernels within fp32
rounding, and keep each row's bits independent of the batch."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.native import NativeCpuOps
from tinyvllm.native.abi import FORMAT_Q4_1, FORMAT_Q8_0
from tinyvllm.native.build import load_library, unsupported_reason
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.utils.cpu import cpu_flags

AVX2, AVX512 = 1, 2
WIDE_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)
wide_only = pytest.mark.skipif(not cpu_flags() >= WIDE_FLAGS, reason="CPU without AVX-512 BF16")


def test_best_kernels_are_the_cpus() -> None:
    lib = load_library()
    want = AVX512 if cpu_flags() >= WIDE_FLAGS else AVX2
    assert lib.tv_set_isa(0) == want
    assert lib.tv_set_isa(AVX2) == AVX2
    assert lib.tv_set_isa(0) == want


def _bf16_bound(x: torch.Tensor, w: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of sum |w||x| plus the output's bf16 rounding."""
    return 1e-5 * (x.float().abs() @ w.float().abs().t()) + want.abs() * 2.0**-8 + 1e-6


@wide_only
def test_bf16_rows_on_avx512_match_fp32_and_avx2(lib) -> None:
    gen = torch.Generator().manual_seed(1)
    for k in (576, 600, 31):  # whole 32-column steps, a masked tail, a tail only
        w = torch.randn(77, k, generator=gen).bfloat16()
        b = torch.randn(77, generator=gen).bfloat16()
        x = torch.randn(19, k, generator=gen).bfloat16()
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        got = {}
        for isa in (AVX2, AVX512):
            assert lib.tv_set_isa(isa) == isa
            got[isa] = NativeCpuOps(lib, 2).linear(x, w, b)
            assert ((got[isa].float() - want).abs() <= _bf16_bound(x, w, want)).all(), (k, isa)
        # Same arithmetic in another order: bits may differ, values barely.
        assert (got[AVX2].float() - got[AVX512].float()).abs().max() <= 2 * want.abs().max() / 128


@wide_only
def test_bf16_rows_on_avx512_do_not_depend_on_batch_or_threads(lib) -> None:
    lib.tv_set_isa(AVX512)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(200, 576, generator=gen).bfloat16()
    x = torch.randn(21, 576, generator=gen).bfloat16()
    ops = NativeCpuOps(lib, 1)
    alone = torch.cat([ops.linear(x[i : i + 1], w, None) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 13, 21):
        assert torch.equal(ops.linear(x[:rows], w, None), alone[:rows]), rows
        assert torch.equal(NativeCpuOps(lib, 3).linear(x[:rows], w, None), alone[:rows]), rows


def _q4_1_and_q8_0(gen: torch.Generator, rows: int, k: int) -> list[tuple[int, torch.Tensor]]:
    q41 = torch.randint(0, 256, (rows, k // 32, 20), generator=gen, dtype=torch.uint8)
    q41[..., :4] = torch.tensor([0, 0x2C, 0, 0xA8], dtype=torch.uint8)  # fp16 d, m
    q80 = torch.randint(0, 256, (rows, k // 32, 34), generator=gen, dtype=torch.uint8)
    q80[..., :2] = torch.tensor([0, 0x2C], dtype=torch.uint8)
    return [(FORMAT_Q4_1, q41.reshape(rows, -1)), (FORMAT_Q8_0, q80.reshape(rows, -1))]


@wide_only
def test_block_rows_on_avx512_match_avx2_and_ignore_the_batch(lib) -> None:
    gen = torch.Generator().manual_seed(3)
    rows, k = 70, 192
    x = torch.randn(11, k, generator=gen)
    for fmt, weight in _q4_1_and_q8_0(gen, rows, k):
        out = {}
        for isa in (AVX2, AVX512):
            lib.tv_set_isa(isa)
            out[isa] = QuantKernels(lib, 2).gemv(x, fmt, weight, rows)
        scale = out[AVX2].abs().max()
        assert (out[AVX2] - out[AVX512]).abs().max() <= 1e-5 * scale, fmt
        alone = torch.cat(
            [QuantKernels(lib, 1).gemv(x[i : i + 1], fmt, weight, rows) for i in range(11)]
        )
        assert torch.equal(out[AVX512], alone), fmt


FOUNDATION_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.skipif(not cpu_flags() >= FOUNDATION_FLAGS, reason="CPU without AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx512_foundation_gemv_matches_fp32_and_ignores_the_batch(lib, dtype) -> None:
    """gemv_avx512f.cpp: 16 columns per FMA where the CPU has AVX-512 without (or besides)
    BF16 dot products: fp32 activations against bf16 or fp32 rows (on AVX512-BF16 CPUs bf16
    activations take vdpbf16ps instead, so fp32 ones reach this kernel everywhere)."""
    gen = torch.Generator().manual_seed(4)
    for k in (576, 600, 31, 1536):  # whole 16-column steps, a scalar tail, a tail only
        w = torch.randn(77, k, generator=gen).to(dtype)
        b = torch.randn(77, generator=gen)
        x = torch.randn(19, k, generator=gen)
        want = torch.nn.functional.linear(x, w.float(), b)
        got = {}
        for isa in (AVX2, 0):
            lib.tv_set_isa(isa)
            got[isa] = NativeCpuOps(lib, 2).linear(x, w, b)
            bound = 1e-5 * (x.abs() @ w.float().abs().t()) + 1e-6
            assert ((got[isa] - want).abs() <= bound).all(), (k, isa)
        # The AVX2 kernel sums 8 lanes, this one 16: another order, values within rounding.
        assert not torch.equal(got[AVX2], got[0]) or k == 31
        alone = torch.cat([NativeCpuOps(lib, 1).linear(x[i : i + 1], w, b) for i in range(19)])
        assert torch.equal(got[0], alone), k
        assert torch.equal(NativeCpuOps(lib, 3).linear(x, w, b), alone), k
