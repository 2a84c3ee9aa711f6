"""Per-device kernel choices, made once: `select_platform` picks the `Platform` the runner
builds and runs its models with (see interface.py)."""

from __future__ import annotations

import torch

from tinyvllm.platforms.interface import Platform

__all__ = ["CudaPlatform", "Platform", "select_platform"]


class CudaPlatform(Platform):
    """CUDA: the attention backend's default (triton where it imports) and CUDA graphs."""

    name = "cuda"

    @property
    def uses_cuda_graphs(self) -> bool:
        return True


def select_platform(
    device: torch.device,
    dtype: torch.dtype,
    enforce_eager: bool,
    fp32_weight_copy_bytes: int | None = None,
) -> Platform:
    """The platform for `device`. `enforce_eager` keeps the plain PyTorch path: no CUDA
    graphs, and on CPU no native library at all (torch ops only). `fp32_weight_copy_bytes`
    caps the CPU's GEMM weight copies, fp32 or prepacked (see EngineArgs)."""
    if device.type == "cpu":
        from tinyvllm.native.ops import NativeCpuOps
        from tinyvllm.platforms.cpu import CpuPlatform

        native = None if enforce_eager else NativeCpuOps.load()
        return CpuPlatform(device, dtype, native, fp32_weight_copy_bytes)
    if device.type == "cuda" and not enforce_eager:
        return CudaPlatform(device, dtype)
    return Platform(device, dtype)
