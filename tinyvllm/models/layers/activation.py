"""Gated activations applied to a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.native.ops import MAX_ELEMENTWISE_ROWS, NativeCpuOps, dtype_code


class SiluAndMul(nn.Module):
    """silu(gate) * up where the input is [..., 2 * d] = [gate | up]; returns [..., d]."""

    native: NativeCpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.native is not None
            and x.dim() == 2
            and x.shape[0] <= MAX_ELEMENTWISE_ROWS
            and x.is_contiguous()
            and dtype_code(x.dtype) is not None
        ):
            return self.native.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
