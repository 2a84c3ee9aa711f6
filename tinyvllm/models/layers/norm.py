"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import default_weight_loader, new_parameter
from tinyvllm.native.ops import NativeCpuOps


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, with the statistics computed in float32.

    `forward(x)` returns the normalised x. `forward(x, residual)` first adds x to the
    residual stream and returns (normalised sum, sum), so a decoder layer can carry the
    residual without a separate add kernel.
    """

    native: NativeCpuOps | None = None

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        # Checkpoints always provide the weight; ones keep a freshly built norm an identity.
        self.weight.data.fill_(1.0)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel for the fp32 statistics (vs five eager ops: a third of the norm's
        # cost at decode); HF casts back before the weight multiply, and so do we.
        normed = F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (
            self.native is not None
            and self.native.elementwise_fits(x)
            and x.is_contiguous()
            and self.weight.dtype == x.dtype
            and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype))
        ):
            # One call; the residual stream is updated in place (nobody else holds it).
            out = self.native.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        # The add happens in the activation dtype, as in HF's `residual + hidden_states`.
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, which scales by (1 + w). The checkpoint stores w; the parameter holds
    1 + w (added in float32 at load), so the forward and the native kernels stay RMSNorm's.
    In float32 this is HF's computation exactly; in bf16 the scale is rounded to bf16 once."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self._load_offset  # type: ignore[attr-defined]

    @staticmethod
    def _load_offset(
        param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        default_weight_loader(param, loaded.float() + 1.0, shard_id)
