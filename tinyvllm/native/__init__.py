"""Native CPU kernels for the decode step (AVX2 + FMA, compiled on first use, ctypes)."""

from __future__ import annotations

from tinyvllm.native.ops import (
    MAX_ELEMENTWISE_ROWS,
    MAX_LINEAR_ROWS,
    NativeCpuOps,
    attach_native_ops,
    dtype_code,
)

__all__ = [
    "MAX_ELEMENTWISE_ROWS",
    "MAX_LINEAR_ROWS",
    "NativeCpuOps",
    "attach_native_ops",
    "dtype_code",
]
