"""Triton weight-only matmul for CUDA: the packed weight tile is dequantized in registers.

Layouts match `kernels.py` off-CPU: int8 [N, K] with a per-row scale; int4 nibbles [N, K/2]
(column 2i in the low nibble of byte i) with `scales_zeros` [K / G, N, 2].
Runs under TRITON_INTERPRET=1 on CPU tensors, which is how the tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_M = 16  # tl.dot's smallest tile; decode batches are below it anyway
_BLOCK_N = 64
_BLOCK_K = 64


@triton.jit
def _wo_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sg,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & n_ok[None, :]
        if BITS == 8:
            w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=w_mask, other=0)
            w = w.to(tl.float32)
        else:
            # Each byte is loaded for both of its columns; the second load hits the cache.
            byte = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None] // 2, mask=w_mask, other=0)
            q = (byte >> ((k[:, None] % 2) * 4).to(tl.uint8)) & 0x0F
            sz = s_ptr + (k[:, None] // GROUP_SIZE) * stride_sg + rn[None, :] * 2
            scale = tl.load(sz, mask=w_mask, other=0.0).to(tl.float32)
            zero = tl.load(sz + 1, mask=w_mask, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - 8.0) * scale + zero
        acc += tl.dot(x, w.to(x.dtype))  # [BLOCK_K, BLOCK_N] is W^T's tile
    if BITS == 8:
        row_scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc * row_scale[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def _launch(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, n: int, bits: int, group: int
) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _wo_matmul_kernel[grid](
        x,
        w,
        s,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        s.stride(0),
        y.stride(0),
        GROUP_SIZE=group,
        BITS=bits,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return y


def triton_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _launch(x, qweight, scale.contiguous(), qweight.shape[0], 8, 1)


def triton_int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor
) -> torch.Tensor:
    group = x.shape[1] // scales_zeros.shape[0]
    return _launch(x, qweight, scales_zeros.contiguous(), qweight.shape[0], 4, group)
