"""bf16 linears of 2+ rows on AMX tiles (tinyvllm/native/amx_linear.cpp, taken by tv_linear):
within fp32 rounding of the exact product, bias and output rounding as the vdpbf16ps path,
every shape the tiles cover (activation rows past a multiple of 16, a 16-row output tail, the
passes that take turns over k from 48 rows on, groups past 128 rows), and each row's bits
independent of the rows around it and of the thread count."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import load_library, unsupported_reason
from tinyvllm.utils.cpu import cpu_flags

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None or not cpu_flags() >= {"amx_bf16", "amx_tile", "avx512_bf16"},
    reason="native kernels or AMX-BF16 unavailable",
)
AMX_MIN_ROWS = 2  # kAmxMinRows in common.h; a single row takes the vdpbf16ps kernel


def _bound(x: torch.Tensor, w: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of sum |w||x| plus the output's bf16 rounding."""
    return 1e-5 * (x.float().abs() @ w.float().abs().t()) + want.abs() * 2.0**-8 + 1e-6


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(2, 192, 576), (9, 64, 1536), (16, 960, 576), (17, 208, 576), (64, 192, 1536), (130, 48, 224)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_rows_match_fp32(m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m + n)
    w = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    got = NativeCpuOps(load_library(), 2).linear(x, w, b)
    assert ((got.float() - want).abs() <= _bound(x, w, want)).all()
    # Against the vdpbf16ps path (one row at a time): another summation order, same values
    # up to one bf16 rounding step.
    ops = NativeCpuOps(load_library(), 1)
    alone = torch.cat([ops.linear(x[i : i + 1], w, b) for i in range(m)])
    assert ((got.float() - alone.float()).abs() <= 2 * _bound(x, w, want)).all()


def test_amx_rows_do_not_depend_on_batch_or_threads() -> None:
    gen = torch.Generator().manual_seed(4)
    w = (0.05 * torch.randn(224, 576, generator=gen)).bfloat16()
    x = torch.randn(150, 576, generator=gen).bfloat16()
    # 150 rows: two groups of activation blocks, the passes over pairs of blocks taking turns
    # every few steps; 16 and 31 rows: one pass over all of k.
    full = NativeCpuOps(load_library(), 1).linear(x, w, None)
    for rows in (AMX_MIN_ROWS, 7, 16, 31, 33, 48, 64, 129):
        for threads in (1, 2, 3):
            got = NativeCpuOps(load_library(), threads).linear(x[-rows:], w, None)
            assert torch.equal(got, full[-rows:]), (rows, threads)


def test_small_batches_sum_in_the_tile_order() -> None:
    # A product of 2**30 in the first column and its negative in the last: the small products
    # between them vanish in a running sum over k (the tiles' order), but survive in the
    # vdpbf16ps kernel's other lanes. Batches from AMX_MIN_ROWS rows on give the tile order's
    # bits; a single row gives the vdpbf16ps order's (the check that the data tells them apart).
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 576, generator=gen).bfloat16()
    x = torch.randn(40, 576, generator=gen).bfloat16()
    w[:, 0], w[:, -1], x[:, 0], x[:, -1] = 2.0**15, -(2.0**15), 2.0**15, 2.0**15
    ops = NativeCpuOps(load_library(), 2)
    full = ops.linear(x, w, None)
    for rows in (AMX_MIN_ROWS, 3, 8, 15):
        assert torch.equal(ops.linear(x[:rows], w, None), full[:rows]), rows
    assert not torch.equal(ops.linear(x[:1], w, None), full[:1])


def test_zero_and_negative_zero_outputs_round_like_the_scalar_path() -> None:
    # Rows of zeros give +0 sums; NaN and inf inputs propagate as on every other path.
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    w[0, 0] = float("nan")
    w[1, 0] = float("inf")
    x = torch.ones(AMX_MIN_ROWS, 64, dtype=torch.bfloat16)
    got = NativeCpuOps(load_library(), 2).linear(x, w, None)
    assert got[:, 0].isnan().all() and (got[:, 1] == float("inf")).all()
    assert (got[:, 2:] == 0).all() and not torch.signbit(got[:, 2:].float()).any()
