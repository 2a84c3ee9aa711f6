"""Typed Python faces of the GGUF block kernels (see quant_kernels.cpp).

A weight is described to the kernels by a format code and a pointer: dense float rows (codes 0
and 1) or a GGUF block matrix kept exactly as the file stores it (codes 2..7). `linear` runs the
native GEMV for decode-sized batches and, for larger ones, dequantizes slabs of rows to fp32
for a GEMM; `embedding` dequantizes looked-up rows only.
"""

from __future__ import annotations

import ctypes

import torch

from tinyvllm.native.abi import DTYPE_CODES as _DTYPE_FORMATS
from tinyvllm.native.abi import FORMAT_BF16, FORMAT_F32, FORMAT_INT8_ACT
from tinyvllm.native.build import load_library
from tinyvllm.utils.cpu import native_threads

# Input rows up to which the GEMV (in passes of 8 rows) beats dequantize-then-GEMM: each pass
# re-reads the blocks, while the dense path pays one dequantization of the matrix and then runs
# at GEMM speed (benchmarks/gguf_gemv.py on a 2-core AVX2 EPYC, SmolLM2 shapes: the GEMV wins
# at 32 rows, the two trade places around 64). Up to here a row's result is the same whatever
# the batch around it (the kernels are batch invariant; the GEMM is not), matching the native
# decode program, which takes batches of up to 64 tokens.
GEMV_MAX_ROWS = 64
# Output rows dequantized at once on the dense path: a slab stays cache-sized.
DENSE_SLAB_ROWS = 256


class QuantKernels:
    """The loaded library's block kernels; calls run on `num_threads`, fixed when the library
    loads (at model load): decode steps lower torch's own count while they run, see
    `CpuPlatform.start_step`."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self.lib = lib
        self.num_threads = num_threads

    @classmethod
    def load(cls, num_threads: int | None = None) -> QuantKernels | None:
        """The block kernels of this machine's native library (None where it does not load)."""
        lib = load_library()
        return None if lib is None else cls(lib, num_threads or native_threads())

    def linear(
        self,
        x: torch.Tensor,
        fmt: int,
        weight: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] (fp32 or bf16) @ W^T (+ bias) -> [M, out_features] in x's dtype.

        `weight` is dense [N, K] for codes 0/1 or uint8 blocks [N, bytes per row]. Up to
        `GEMV_MAX_ROWS` rows (and any dense weight) take the GEMV, more a GEMM on dequantized
        slabs. A block code or-ed with `FORMAT_INT8_ACT` runs the opt-in int8-activation GEMV
        where this CPU has it (`int8_activations_supported`); the GEMM path stays exact.
        """
        if x.shape[0] > GEMV_MAX_ROWS and fmt not in (FORMAT_F32, FORMAT_BF16):
            # The GEMM path is exact whatever the code asks of the GEMVs.
            fmt &= ~FORMAT_INT8_ACT
            return self.dense_linear(x, fmt, weight, out_features, bias)
        return self.gemv(x, fmt, weight, out_features, bias)

    def gemv(
        self,
        x: torch.Tensor,
        fmt: int,
        weight: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`linear` through tv_linear_any whatever the row count."""
        if not x.is_contiguous():
            x = x.contiguous()
        m, k = x.shape
        if bias is not None and bias.dtype not in _DTYPE_FORMATS:
            bias = bias.float()
        out = torch.empty((m, out_features), dtype=x.dtype)
        self.lib.tv_linear_any(
            x.data_ptr(), _DTYPE_FORMATS[x.dtype], weight.data_ptr(), fmt,
            None if bias is None else bias.data_ptr(),
            0 if bias is None else _DTYPE_FORMATS[bias.dtype], out.data_ptr(), m, out_features,
            k, self.num_threads,
        )  # fmt: skip
        return out

    def int8_activations_supported(self, fmt: int) -> bool:
        """Whether GEMVs over format `fmt` with `FORMAT_INT8_ACT` run the int8-activation
        kernel here on the file's layout (AVX512-VNNI, Q4_0 / Q4_1 / Q8_0) rather than the exact
        one; the 16-row layout has int8 kernels on AVX2 too (`rows16_supported`)."""
        return bool(self.lib.tv_int8_act_supported(fmt & ~FORMAT_INT8_ACT))

    def rows16_supported(self, fmt: int) -> bool:
        """Whether a Q4_0 / Q4_1 / Q8_0 matrix can be repacked 16 rows at a time for the
        int8-activation GEMVs here (`repack_rows16`; its rows must be a multiple of 16;
        AVX512-VNNI or AVX2 kernels)."""
        return bool(self.lib.tv_rows16_supported(fmt & ~FORMAT_INT8_ACT))

    def rows16_exact_supported(self, fmt: int) -> bool:
        """Whether the exact GEMV takes a Q4_0 / Q4_1 matrix in the 16-row layout against
        bf16 activations here (bf16_rows16.cpp with AVX512-BF16, bf16_rows16_avx2.cpp)."""
        return bool(self.lib.tv_rows16_exact_supported(fmt & ~FORMAT_INT8_ACT))

    def repack_rows16(self, fmt: int, weight: torch.Tensor, in_features: int) -> torch.Tensor:
        """The block matrix `weight` [N, bytes per row] in the 16-row layout the code
        `fmt | FORMAT_ROWS16` names (same shape and bytes, rows interleaved; int8_rows16.cpp)."""
        if weight.shape[0] % 16 or in_features % 32 or not weight.is_contiguous():
            raise ValueError(
                f"the 16-row layout needs a contiguous matrix with a multiple of 16 rows and "
                f"of 32 columns, got {tuple(weight.shape)} for {in_features} columns"
            )
        out = torch.empty_like(weight)
        self.lib.tv_repack_rows16(
            weight.data_ptr(), fmt & ~FORMAT_INT8_ACT, weight.shape[0], in_features,
            out.data_ptr(), self.num_threads,
        )  # fmt: skip
        return out

    def dequantize_rows(
        self, fmt: int, weight: torch.Tensor, in_features: int, start: int, stop: int
    ) -> torch.Tensor:
        """Rows [start, stop) of a block matrix as fp32 [stop - start, in_features], bit for
        bit what tinyvllm.gguf.dequant gives."""
        out = torch.empty((stop - start, in_features), dtype=torch.float32)
        self.lib.tv_dequant_rows(
            weight.data_ptr(), fmt, in_features, start, stop, out.data_ptr(), self.num_threads,
        )  # fmt: skip
        return out

    def embedding(
        self, fmt: int, weight: torch.Tensor, in_features: int, ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        """Rows `ids` of W in `dtype` (rounded once from the exact fp32 values)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], in_features), dtype=dtype)
        self.lib.tv_embedding_any(
            weight.data_ptr(), fmt, flat.data_ptr(), flat.shape[0], in_features, out.data_ptr(),
            _DTYPE_FORMATS[dtype],
        )  # fmt: skip
        return out.view(*ids.shape, in_features)

    def dense_linear(
        self,
        x: torch.Tensor,
        fmt: int,
        weight: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """fp32 GEMM over slabs of dequantized rows (prefill and large batches)."""
        xf = x.float()
        k = x.shape[1]
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        for start in range(0, out_features, DENSE_SLAB_ROWS):
            stop = min(start + DENSE_SLAB_ROWS, out_features)
            slab = self.dequantize_rows(fmt, weight, k, start, stop)
            out[:, start:stop] = xf @ slab.t()
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype)
