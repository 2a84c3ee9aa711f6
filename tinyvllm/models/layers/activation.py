"""Gated activations applied to a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.native.ops import NativeCpuOps, elementwise_rows_fit


class SiluAndMul(nn.Module):
    """silu(gate) * up where the input is [..., 2 * d] = [gate | up]; returns [..., d]."""

    name = "silu"  # for the native decode plan
    native: NativeCpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and self.native.elementwise_fits(x) and x.is_contiguous():
            return self.native.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`), same layout as `SiluAndMul`."""

    name = "gelu_tanh"
    native: NativeCpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and elementwise_rows_fit(x) and x.is_contiguous():
            return self.native.gelu_tanh_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
