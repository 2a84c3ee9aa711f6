"""The Mamba2 math as pure torch functions: causal depthwise conv with a carried window, the
chunked SSD scan (prefill) and the single-step recurrence (decode).

Shapes use h = SSM heads, p = head dim, n = state size, g = B/C groups (h % g == 0), C = conv
channels, K = conv kernel width. A recurrent state is (conv window [C, K-1] of the last K-1
inputs, oldest first; SSM state [h, p, n]); prefill and decode leave exactly the state the other
would, so a sequence may be split anywhere (chunked prefill, prefix-cache restores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence's `x` [L, C] continuing after `window` [C, K-1]
    (the previous K-1 inputs; zeros at a sequence's start). `weight` is [C, K].

    Returns (out [L, C] in float32, before the activation; the new window [C, K-1]). K shifted
    multiply-adds in float32: a bf16 conv1d runs a slow generic kernel on CPUs without bf16
    units, and K is only ~4."""
    width, length = weight.shape[1] - 1, x.shape[0]
    full = torch.cat([window.t().to(x.dtype), x])  # [K-1+L, C], oldest first
    taps = weight.float()
    out = full[:length].float() * taps[:, 0]
    for k in range(1, width + 1):
        out += full[k : k + length].float() * taps[:, k]
    if bias is not None:
        out += bias.float()
    return out, full[full.shape[0] - width :].t()


def causal_conv1d_step(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: `x` [b, C], `windows` [b, C, K-1] -> (out [b, C] in float32,
    new windows [b, C, K-1]); the batched form of `causal_conv1d` with L = 1."""
    full = torch.cat([windows.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [b, C, K]
    out = (full.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out, full[..., 1:]


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., g, n] -> [..., h, n]: each group serves h/g consecutive heads."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of one sequence, in float32.

    x [L, h, p]; dt [L, h] (already softplus'd and clamped); A [h] (negative); B, C [L, g, n];
    initial_state [h, p, n] or None (zeros). Per step t: S = exp(dt_t A) S + dt_t x_t B_t^T and
    y_t = S C_t. Within a chunk this is a masked "attention" over the chunk (quadratic in
    chunk_size); across chunks the state is carried (linear in the number of chunks).

    Returns (y [L, h, p] without the D skip, final state [h, p, n])."""
    length, num_heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    per_group = num_heads // groups
    pad = (-length) % chunk_size
    chunks, q = (length + pad) // chunk_size, chunk_size
    # Padded steps get dt = 0: no decay, no input, so the final state is unchanged by them.
    x, dt = F.pad(x.float(), (0, 0, 0, 0, 0, pad)), F.pad(dt.float(), (0, 0, 0, pad))
    B, C = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (B, C))
    # Layouts that make every contraction a plain batched matmul: g = groups, r = heads per
    # group. B and C are shared by a group's heads, so the products with them run once per
    # group over all its heads' channels (r * p) instead of once per head.
    xdt = (x * dt.unsqueeze(-1)).view(chunks, q, groups, per_group, head_dim)
    Bg = B.view(chunks, q, groups, state_size).transpose(1, 2)  # [c, g, q, n]
    Cg = C.view(chunks, q, groups, state_size).transpose(1, 2)
    # Log decay from the chunk's start to each step (inclusive): [c, g, r, q].
    cum = torch.cumsum((dt * A.float()).view(chunks, q, num_heads), dim=1)
    cum = cum.view(chunks, q, groups, per_group).permute(0, 2, 3, 1)

    # Intra-chunk: y_l += sum_{s<=l} exp(cum_l - cum_s) (C_l . B_s) xdt_s. Differences for s > l
    # are positive and masked to -inf before exp, so nothing overflows. In place: this
    # [c, g, r, q, q] tensor is the largest of the scan.
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    scores = cum.unsqueeze(-1) - cum.unsqueeze(-2)
    scores.masked_fill_(~causal, float("-inf")).exp_()
    scores.mul_((Cg @ Bg.transpose(-1, -2)).unsqueeze(2))
    y_diag = scores @ xdt.permute(0, 2, 3, 1, 4)  # [c, g, r, q, p]

    # Each chunk's own contribution to the state at its end: [c, g, r * p, n].
    to_end = torch.exp(cum[..., -1:] - cum).permute(0, 3, 1, 2)  # [c, q, g, r]
    weighted = (xdt * to_end.unsqueeze(-1)).view(chunks, q, groups, -1).permute(0, 2, 3, 1)
    chunk_states = weighted @ Bg
    chunk_decay = torch.exp(cum[..., -1]).repeat_interleave(head_dim, dim=-1)  # [c, g, r * p]

    # Inter-chunk: carry the state chunk by chunk (a few iterations: L / chunk_size).
    shape = (groups, per_group * head_dim, state_size)
    state = (
        torch.zeros(shape, device=x.device)
        if initial_state is None
        else initial_state.float().reshape(shape)
    )
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = state * chunk_decay[c].unsqueeze(-1) + chunk_states[c]
    # From each chunk's start state: C_l . S, decayed to step l: [c, g, q, r, p].
    y = (Cg @ torch.stack(starts).transpose(-1, -2)).view(chunks, groups, q, per_group, -1)
    y *= torch.exp(cum).permute(0, 1, 3, 2).unsqueeze(-1)
    y += y_diag.transpose(2, 3)
    y = y.transpose(1, 2).reshape(chunks * q, num_heads, head_dim)
    return y[:length], state.reshape(num_heads, head_dim, state_size)


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One recurrent step for b sequences, updating `state` [b, h, p, n] (float32, contiguous)
    in place: x [b, h, p], dt [b, h], A [h], B, C [b, g, n] -> y [b, h, p] without the D skip.

    In place because the state is the largest thing a decode step touches (more bytes than a
    small model's mixer weights): decay and rank-1 update are one pass each, y one read."""
    batch, num_heads, head_dim = x.shape
    rows, state_size = batch * num_heads, B.shape[-1]
    dt = dt.float()
    B, C = _heads(B.float(), num_heads), _heads(C.float(), num_heads)
    flat = state.view(rows, head_dim, state_size)
    flat.mul_(torch.exp(dt * A.float()).view(rows, 1, 1))
    dtx = (x.float() * dt.unsqueeze(-1)).view(rows, head_dim, 1)
    flat.baddbmm_(dtx, B.reshape(rows, 1, state_size))
    return torch.bmm(flat, C.reshape(rows, state_size, 1)).view(batch, num_heads, head_dim)


def gated_rms_norm(
    y: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """RMSNorm over groups of `group_size` channels, gated by silu(gate), in float32.

    norm_before_gate=False (Mamba2, Granite): norm(y * silu(gate)); True: norm(y) * silu(gate).
    Returns float32 (the caller casts)."""
    y, silu = y.float(), F.silu(gate.float())
    if not norm_before_gate:
        y = y * silu
    grouped = y.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    y = grouped.flatten(-2)
    if norm_before_gate:
        y = y * silu
    return y * weight.float()
