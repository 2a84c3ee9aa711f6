"""fp32 copies of bf16 linear weights for batched GEMMs on CPUs without bf16 matmul.

Why a copy: there torch's bf16 GEMM is emulated (several times slower than fp32), while the
values of a bf16 weight are exact in fp32, so an fp32 GEMM on a copy gives the products of the
bf16 weights at fp32 speed (see `attach_fp32_gemm_weights`).

Why packed: `F.linear` hands MKL's sgemm the plain [out, in] matrix, and sgemm repacks it into
its panel layout on every call: a full read and write of the weight, for a decode batch's few
dozen rows as dear as the products themselves (SmolLM2-135M's layer at 64 rows on a 2-core Ice
Lake: 2.7-3.3 ms plain, 1.8-2.3 ms packed; at 8 rows 1.5 against 0.37 ms). Where torch has
MKL the copy is packed once (`cblas_sgemm_pack` through torch's `mkl::_mkl_reorder_linear_weight`,
about the plain copy's bytes) and every call runs `cblas_sgemm_compute` on it. torch passes the
compute the caller's row count as the packing's "batch size" and falls back to the plain weight
on any other count, so each call names its own row count: the packed panels of the weight do not
depend on it (checked when the copy is made, against the plain GEMM, and otherwise the copy
stays plain).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows the packing is told to expect (on torch 2.13's MKL the packed size was the same for 1 to
# 4,096, and a pack for 64 gave fp32-exact products for calls of 1 to 2,048 rows; `_packed_copy`
# checks each copy it makes).
_PACK_ROWS = 64
# Rows of the check of a new packed copy against the plain GEMM.
_CHECK_ROWS = 3


class Fp32WeightCopy:
    """An fp32 copy of a linear layer's weight (and bias), called with rows [T, in] in any
    float dtype: returns the fp32 [T, out] of x @ W^T + b, not rounded to x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        plain = weight.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.nbytes = plain.numel() * 4
        self.packed = _packed_copy(plain)
        # The packed call reads only the plain weight's sizes (its fallback, never taken here,
        # would read its values): a zero-stride view stands in for the values we drop.
        self.plain = plain if self.packed is None else torch.zeros(()).expand(plain.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.packed is None:
            return F.linear(x, self.plain, self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0  # leading dims are rows too
        return torch.ops.mkl._mkl_linear(x, self.packed, self.plain, self.bias, rows)


def mkl_packing_available() -> bool:
    return (
        torch.backends.mkl.is_available()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def _packed_copy(plain: torch.Tensor) -> torch.Tensor | None:
    """`plain` packed for MKL's sgemm_compute, or None where torch cannot, or where the packed
    GEMM disagrees with the plain one (another MKL, a layout that depends on the rows)."""
    if not mkl_packing_available() or plain.numel() == 0:
        return None
    try:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(plain, _PACK_ROWS)
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(_CHECK_ROWS, plain.shape[1], generator=gen)
        got = torch.ops.mkl._mkl_linear(probe, packed, plain, None, _CHECK_ROWS)
    except RuntimeError:
        return None
    want = F.linear(probe, plain)
    # Two fp32 sums of `in` products differ by a few ulps of the magnitudes' sum, which
    # Cauchy-Schwarz bounds by the rows' norms (no |W| or fp64 copy of a large weight); a
    # wrong layout is off by the values themselves.
    bound = probe.norm(dim=1)[:, None] * plain.norm(dim=1)[None, :]
    if not bool(((got - want).abs() <= 1e-5 * bound).all()):
        return None
    return packed
