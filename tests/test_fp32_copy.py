"""fp32 copies of bf16 linear weights (tinyvllm/models/layers/fp32_copy.py): MKL-packed where
torch has MKL, the plain GEMM's values at every row count, plain where packing is missing or
disagrees with the plain GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tinyvllm.models.layers.fp32_copy as fp32_copy
from tinyvllm.models.layers.fp32_copy import Fp32WeightCopy, mkl_packing_available


def _weights(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen).bfloat16()
    return w, torch.randn(out, generator=gen).bfloat16()


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 65, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_the_copy_computes_the_plain_fp32_gemm(rows: int, bias: bool) -> None:
    w, b = _weights(96, 160, rows)
    copy = Fp32WeightCopy(w, b if bias else None)
    assert copy.nbytes == 96 * 160 * 4
    assert (copy.packed is not None) == mkl_packing_available()
    x = torch.randn(rows, 160).bfloat16()
    got = copy(x)
    want = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # Another summation order than the plain GEMM's: fp32 rounding of the magnitudes' sum.
    scale = x.float().abs() @ w.float().abs().T + (b.float().abs() if bias else 0)
    assert bool(((got - want).abs() <= 1e-5 * scale + 1e-6).all())


def test_packed_rows_do_not_depend_on_the_batch() -> None:
    """A row's values are the same alone and in a batch of any size (the packing is told 64
    rows; calls name their own)."""
    w, b = _weights(64, 96, 3)
    copy = Fp32WeightCopy(w, b)
    x = torch.randn(130, 96).bfloat16()
    whole = copy(x)
    for n in (1, 3, 64, 100):
        assert torch.allclose(copy(x[:n]), whole[:n], rtol=1e-5, atol=1e-5)


def test_a_packed_gemm_that_disagrees_keeps_the_copy_plain(monkeypatch) -> None:
    if not mkl_packing_available():
        pytest.skip("torch without MKL packing: the copy is always plain")
    real = torch.ops.mkl._mkl_linear

    class WrongMkl:
        _mkl_reorder_linear_weight = torch.ops.mkl._mkl_reorder_linear_weight

        @staticmethod
        def _mkl_linear(*args):  # type: ignore[no-untyped-def]
            return real(*args) * 1.001

    monkeypatch.setattr(fp32_copy.torch.ops, "mkl", WrongMkl)
    w, b = _weights(32, 64, 5)
    copy = Fp32WeightCopy(w, b)
    assert copy.packed is None
    x = torch.randn(5, 64)
    assert torch.equal(copy(x), F.linear(x, w.float(), b.float()))
