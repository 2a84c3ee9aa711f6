"""Weight-only quantized matmuls: y = x @ W^T with W kept packed, dequantized on the fly.

Two storage formats, identical on every device except how int4 nibbles are laid out:
- int8: `qweight` int8 [N, K], `scale` [N]; w = q * scale.
- int4: `qweight` uint8 holding two 4-bit values per byte, `scales_zeros` [K / G, N, 2];
  w = (q - 8) * scale + zero for the G input columns of a group (torch's convention).

On CPU the decode-sized products go to torch's packed kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`), which read bf16 activations far faster than fp32 ones.
From `dense_min_rows` rows up, dequantizing a slab of rows to fp32 and running the fp32
GEMM is faster on CPUs without native bf16 dot products; the slab is transient, so memory
stays at the packed size. On CUDA a Triton kernel serves small batches and a transient
dequantized copy of one layer serves prefill; other devices always take the copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

# torch's CPU int4 layout interleaves blocks of output rows: 32 on AVX2 builds, 64 where torch
# dispatches to AVX-512. Shorter tails are laid out differently, so N is padded to a whole block
# instead of decoding them; the candidates are tried in `cpu_int4_block_rows`.
CPU_INT4_BLOCK_CANDIDATES = (32, 64)
# Output rows dequantized at once on the dense path: a slab stays cache-sized.
DENSE_SLAB_ROWS = 512
# Batch rows from which the dense path beats the packed kernel (benchmarks/quant_matmul.py
# on a 2-core AVX2 EPYC, SmolLM2 shapes: the int8 curves cross between 32 and 64 rows, the
# int4 ones between 64 and 128). CPUs with native bf16 matmul keep the packed kernels.
CPU_DENSE_MIN_ROWS_INT8 = 48
CPU_DENSE_MIN_ROWS_INT4 = 96
# Largest batch the Triton kernel takes; beyond it cuBLAS on a dequantized copy should win
# (not measured yet: no GPU was at hand when this was written).
TRITON_MAX_ROWS = 16


# --- int4 layouts -----------------------------------------------------------------------


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, K / 2], column 2i in the low nibble of byte i."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def pack_int4_cpu(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (N a multiple of 32) -> torch's CPU int4 kernel layout.

    The conversion op wants int32 input; converting in row blocks bounds that transient.
    """
    n = q.shape[0]
    block = cpu_int4_block_rows()
    if n % block:
        raise ValueError(f"CPU int4 packing needs a multiple of {block} rows, got {n}")
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    if not cpu_int4_layout_known():
        return convert(q.to(torch.int32), 1)
    step = 64 * block
    return torch.cat([convert(q[i : i + step].to(torch.int32), 1) for i in range(0, n, step)])


def unpack_int4_cpu(packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) (whole blocks) of a `pack_int4_cpu` weight as uint8 [rows, K].

    With B = `cpu_int4_block_rows()`, byte (block b, column k, lane j) holds row B*b + j in its
    low and B*b + B/2 + j in its high nibble.
    """
    half = cpu_int4_block_rows() // 2
    k = packed.shape[1] * 2
    blocks = packed[start:stop].reshape(-1, k, half)
    rows = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [blocks, K, 32]
    return rows.transpose(1, 2).reshape(stop - start, k)


def _layout_matches(block: int) -> bool:
    """Whether torch packs int4 in `block`-row blocks the way `unpack_int4_cpu` reads them."""
    q = torch.randint(0, 16, (2 * block, 64), dtype=torch.uint8)
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    try:
        whole = convert(q.to(torch.int32), 1)
        tail = convert(q[block:].to(torch.int32), 1)
    except RuntimeError:
        return False
    half = block // 2
    blocks = whole.reshape(-1, 64, half)
    rows = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).transpose(1, 2).reshape(2 * block, 64)
    return bool(torch.equal(rows, q) and torch.equal(whole[block:], tail))


@functools.cache
def _detected_block_rows() -> int | None:
    return next((b for b in CPU_INT4_BLOCK_CANDIDATES if _layout_matches(b)), None)


def cpu_int4_block_rows() -> int:
    """Rows per interleaved block of this torch's CPU int4 layout (the padding unit of N).
    When the layout is not one we know, the largest candidate is used, which every known
    layout divides."""
    return _detected_block_rows() or max(CPU_INT4_BLOCK_CANDIDATES)


def cpu_int4_layout_known() -> bool:
    """Whether this torch packs int4 the way `unpack_int4_cpu` reads it, row-block by
    row-block. The layout is an implementation detail of torch (and of the CPU it dispatches
    to); if it ever changes, the packed kernel still works and only the dense path (which
    unpacks) is given up."""
    return _detected_block_rows() is not None


# --- dequantization ---------------------------------------------------------------------


def dequantize_int8(
    qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (qweight.to(dtype) * scale.to(dtype)[:, None]).to(dtype)


def dequantize_int4(
    q: torch.Tensor, scales_zeros: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 values [N, K] and their `scales_zeros` [K / G, N, 2] -> float [N, K]."""
    n, k = q.shape
    groups = scales_zeros.shape[0]
    sz = scales_zeros.to(dtype).permute(1, 0, 2)  # [N, K / G, 2]
    w = q.to(dtype).view(n, groups, k // groups).sub_(8)
    return w.mul_(sz[..., :1]).add_(sz[..., 1:]).view(n, k)


def _dense_linear(
    x: torch.Tensor, n: int, slab: int, dequant_rows: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """fp32 x @ W^T, W dequantized `slab` output rows at a time."""
    xf = x.float()
    parts = [F.linear(xf, dequant_rows(i, min(i + slab, n))) for i in range(0, n, slab)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# --- matmuls ----------------------------------------------------------------------------


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, dense_min_rows: int
) -> torch.Tensor:
    """x [M, K] @ (qweight * scale)^T -> [M, N] in x's dtype."""
    m = x.shape[0]
    if x.device.type == "cpu":
        if m >= dense_min_rows:
            y = _dense_linear(
                x,
                qweight.shape[0],
                DENSE_SLAB_ROWS,
                lambda a, b: dequantize_int8(qweight[a:b], scale[a:b]),
            )
            return y.to(x.dtype)
        xk = x.to(scale.dtype).contiguous()
        return torch.ops.aten._weight_int8pack_mm(xk, qweight, scale).to(x.dtype)
    if x.device.type == "cuda" and m <= TRITON_MAX_ROWS and _has_triton():
        from tinyvllm.quant.triton_kernels import triton_int8_linear

        return triton_int8_linear(x, qweight, scale)
    return dequant_linear_int8(x, qweight, scale)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    out_features: int,
    dense_min_rows: int,
) -> torch.Tensor:
    """x [M, K] @ W^T for an int4 weight packed for x's device -> [M, out_features].

    `qweight` may hold padding rows past `out_features` (CPU layout); they are dropped.
    """
    m = x.shape[0]
    group_size = x.shape[1] // scales_zeros.shape[0]
    if x.device.type == "cpu":
        if m >= dense_min_rows and cpu_int4_layout_known():
            rows = qweight.shape[0]
            y = _dense_linear(
                x,
                rows,
                DENSE_SLAB_ROWS,
                lambda a, b: dequantize_int4(unpack_int4_cpu(qweight, a, b), scales_zeros[:, a:b]),
            )
        else:
            xk = x.to(scales_zeros.dtype).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, qweight, group_size, scales_zeros)
        return y[:, :out_features].to(x.dtype)
    if x.device.type == "cuda" and m <= TRITON_MAX_ROWS and _has_triton():
        from tinyvllm.quant.triton_kernels import triton_int4_linear

        return triton_int4_linear(x, qweight, scales_zeros)
    return dequant_linear_int4(x, qweight, scales_zeros)


def dequant_linear_int8(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Any device: a transient dequantized copy of the layer, then the float GEMM."""
    return F.linear(x, dequantize_int8(qweight, scale, x.dtype))


def dequant_linear_int4(
    x: torch.Tensor, nibbles: torch.Tensor, scales_zeros: torch.Tensor
) -> torch.Tensor:
    """Any device, `pack_nibbles` layout: a transient dequantized copy, then the GEMM."""
    return F.linear(x, dequantize_int4(unpack_nibbles(nibbles), scales_zeros, x.dtype))


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
