"""Float or GGUF weights -> the integer values, scales and zero points our kernels read.

Everything works on row slabs: a checkpoint tensor is read once and never expanded to fp32
as a whole (the lm_head of a small model is already 100+ MB in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm.gguf.weight import GGUFWeight

# GGUF formats whose blocks are exactly 4-bit values with a scale and min per 32 columns.
GGUF_INT4_QTYPES = frozenset({2, 3, 12})  # Q4_0, Q4_1, Q4_K
_SLAB_ROWS = 4096


@dataclass(frozen=True)
class Int4Rows:
    """w = (q - 8) * scale + zero per group; q uint8 [rows, K], scale/zero [rows, K / G]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def is_gguf_int4(weight: torch.Tensor | GGUFWeight) -> bool:
    return isinstance(weight, GGUFWeight) and weight.qtype in GGUF_INT4_QTYPES


def _float_rows(weight: torch.Tensor | GGUFWeight, start: int, stop: int) -> torch.Tensor:
    if isinstance(weight, GGUFWeight):
        return weight.select_rows(slice(start, stop)).dequantize(torch.float32)
    return weight[start:stop].float()


def quantize_int8_rows(
    weight: torch.Tensor | GGUFWeight, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row: (q int8 [N, K], scale [N] in `scale_dtype`).

    q is rounded against the stored (rounded) scale, so dequantizing with it is as close
    to the input as int8 allows.
    """
    rows = weight.shape[0]
    device = weight.data.device
    q = torch.empty(weight.shape, dtype=torch.int8, device=device)
    scale = torch.empty(rows, dtype=scale_dtype, device=device)
    for start in range(0, rows, _SLAB_ROWS):
        stop = min(start + _SLAB_ROWS, rows)
        w = _float_rows(weight, start, stop)
        s = (w.abs().amax(dim=1) / 127.0).to(scale_dtype)
        scale[start:stop] = s
        s = s.float().clamp_min(torch.finfo(torch.float32).tiny)
        q[start:stop] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_rows(
    weight: torch.Tensor | GGUFWeight, group_size: int, scale_dtype: torch.dtype
) -> Int4Rows:
    """Asymmetric 4-bit groups of `group_size` columns (min/max fit), or, for GGUF
    Q4_0/Q4_1/Q4_K blocks, their own values repacked (groups of 32, no requantization)."""
    if is_gguf_int4(weight):
        return _gguf_int4_rows(weight, scale_dtype)  # type: ignore[arg-type]
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"{cols} input columns do not split into groups of {group_size}")
    device = weight.data.device
    q = torch.empty(weight.shape, dtype=torch.uint8, device=device)
    scale = torch.empty(rows, cols // group_size, dtype=scale_dtype, device=device)
    zero = torch.empty_like(scale)
    for start in range(0, rows, _SLAB_ROWS):
        stop = min(start + _SLAB_ROWS, rows)
        w = _float_rows(weight, start, stop).view(stop - start, -1, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        s = ((hi - lo) / 15.0).to(scale_dtype)
        # Zero is the value of code 8; rounding codes against the stored scale and zero
        # keeps the bf16 rounding of both out of the reconstruction error.
        z = (lo + 8.0 * s.float()).to(scale_dtype)
        scale[start:stop], zero[start:stop] = s, z
        sf = s.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        codes = torch.round((w - z.float().unsqueeze(-1)) / sf + 8.0).clamp_(0, 15)
        q[start:stop] = codes.to(torch.uint8).view(stop - start, cols)
    return Int4Rows(q=q, scale=scale, zero=zero)


def _gguf_int4_rows(weight: GGUFWeight, scale_dtype: torch.dtype) -> Int4Rows:
    from tinyvllm.gguf.dequant import q4_blocks

    # GGUF: w = scale * q + min; ours: (q - 8) * scale + zero, so zero = min + 8 * scale.
    q, scale, minimum = q4_blocks(weight.data, weight.qtype, weight.shape)
    zero = minimum + 8.0 * scale
    return Int4Rows(q=q, scale=scale.to(scale_dtype), zero=zero.to(scale_dtype))
