"""Triton kernels for the Mamba2 decode step (one token per request, continuing its slot):
the conv window update and the SSM state update, each one launch for the whole batch instead
of a dozen small torch ops per layer. Imported only on CUDA (`Mamba2Mixer` picks it at
construction); tests run it in Triton's CPU interpreter.

Two kernels because a group's B/C channels feed several heads: the conv kernel owns every
channel once (so each window is updated by exactly one program), the SSM kernel then reads the
activated conv output of its head's channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_C = 128


@triton.jit
def _conv_step_kernel(
    xbc_ptr,  # [T, C] conv input (a column slice of in_proj's output)
    stride_xt,
    token_ptr,  # [R] int64: each decode request's token row
    slot_ptr,  # [R] int64: its state slot
    window_ptr,  # [S, C, WIDTH] the last WIDTH inputs per channel, oldest first
    stride_ws,
    stride_wc,
    weight_ptr,  # [C, WIDTH + 1]
    stride_wtc,
    bias_ptr,  # [C] (unused without HAS_BIAS)
    out_ptr,  # [R, C] float32: silu(conv)
    stride_or,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    req = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < CHANNELS
    token = tl.load(token_ptr + req)
    slot = tl.load(slot_ptr + req)
    x = tl.load(xbc_ptr + token * stride_xt + offs, mask=mask).to(tl.float32)
    weights = weight_ptr + offs * stride_wtc
    acc = x * tl.load(weights + WIDTH, mask=mask).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask).to(tl.float32)
    window = window_ptr + slot * stride_ws + offs * stride_wc
    for k in tl.static_range(WIDTH):
        prev = tl.load(window + k, mask=mask)
        acc += prev.to(tl.float32) * tl.load(weights + k, mask=mask).to(tl.float32)
        if k > 0:  # shift left: position k-1 was read in the previous iteration
            tl.store(window + k - 1, prev, mask=mask)
    tl.store(window + WIDTH - 1, x.to(window_ptr.dtype.element_ty), mask=mask)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + req * stride_or + offs, out, mask=mask)


@triton.jit
def _ssm_step_kernel(
    conv_ptr,  # [R, C] float32: activated conv output [x | B | C]
    stride_cr,
    dt_ptr,  # [T, H] raw dt (before bias and softplus)
    stride_dtt,
    token_ptr,
    slot_ptr,
    state_ptr,  # [S, H, P, N]
    stride_ss,
    stride_sh,
    stride_sp,
    a_ptr,  # [H] float32, negative
    d_ptr,  # [H]
    dt_bias_ptr,  # [H]
    y_ptr,  # [T, H * P] float32
    stride_yt,
    dt_min,
    dt_max,
    HEAD_DIM: tl.constexpr,
    STATE: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    INTERMEDIATE: tl.constexpr,  # H * P: where B starts in the conv output
    GROUPS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(token_ptr + req)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    group = head // HEADS_PER_GROUP
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < HEAD_DIM
    mask_n = offs_n < STATE
    row = conv_ptr + req * stride_cr
    x = tl.load(row + head * HEAD_DIM + offs_p, mask=mask_p, other=0.0)
    b = tl.load(row + INTERMEDIATE + group * STATE + offs_n, mask=mask_n, other=0.0)
    c = tl.load(row + INTERMEDIATE + (GROUPS + group) * STATE + offs_n, mask=mask_n, other=0.0)
    dt = tl.load(dt_ptr + token * stride_dtt + head).to(tl.float32)
    dt += tl.load(dt_bias_ptr + head).to(tl.float32)
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus, torch's threshold
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(a_ptr + head))
    mask = mask_p[:, None] & mask_n[None, :]
    cell = state_ptr + slot * stride_ss + head * stride_sh
    cell += offs_p[:, None] * stride_sp + offs_n[None, :]
    state = tl.load(cell, mask=mask, other=0.0).to(tl.float32)
    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(cell, state.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + head).to(tl.float32) * x
    tl.store(y_ptr + token * stride_yt + head * HEAD_DIM + offs_p, y, mask=mask_p)


def mamba2_decode_step(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    n_groups: int,
    y: torch.Tensor,
) -> None:
    """The decode step of `Mamba2Mixer` for requests at rows `tokens` with state `slots`:
    updates their conv windows and SSM states in place and writes y (without the gate/norm)
    into `y` [T, H * P] at those rows."""
    num = tokens.shape[0]
    if num == 0:
        return
    channels, width = conv_weight.shape[0], conv_weight.shape[-1] - 1
    _, heads, head_dim, state_size = ssm_state.shape
    weight = conv_weight.reshape(channels, width + 1)
    assert xbc.stride(1) == 1 and conv_state.stride(2) == 1 and ssm_state.stride(3) == 1
    conv = torch.empty(num, channels, dtype=torch.float32, device=xbc.device)
    _conv_step_kernel[(num, triton.cdiv(channels, _BLOCK_C))](
        xbc,
        xbc.stride(0),
        tokens,
        slots,
        conv_state,
        conv_state.stride(0),
        conv_state.stride(1),
        weight,
        weight.stride(0),
        weight if conv_bias is None else conv_bias,
        conv,
        conv.stride(0),
        CHANNELS=channels,
        WIDTH=width,
        HAS_BIAS=conv_bias is not None,
        BLOCK_C=_BLOCK_C,
    )
    _ssm_step_kernel[(num, heads)](
        conv,
        conv.stride(0),
        dt,
        dt.stride(0),
        tokens,
        slots,
        ssm_state,
        ssm_state.stride(0),
        ssm_state.stride(1),
        ssm_state.stride(2),
        A,
        D,
        dt_bias,
        y,
        y.stride(0),
        float(dt_limit[0]),
        float(min(dt_limit[1], 3.0e38)),  # inf is not a valid fp32 kernel scalar everywhere
        HEAD_DIM=head_dim,
        STATE=state_size,
        HEADS_PER_GROUP=heads // n_groups,
        INTERMEDIATE=heads * head_dim,
        GROUPS=n_groups,
        BLOCK_P=triton.next_power_of_2(head_dim),
        BLOCK_N=triton.next_power_of_2(state_size),
    )
