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

    Returns (out [L, C] before the activation, the new window [C, K-1])."""
    width = weight.shape[1] - 1
    full = torch.cat([window.to(x.dtype), x.t()], dim=1)  # [C, K-1+L]
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return out[0].t(), full[:, full.shape[1] - width :]


def causal_conv1d_step(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: `x` [b, C], `windows` [b, C, K-1] -> (out [b, C], new
    windows [b, C, K-1]); the batched form of `causal_conv1d` with L = 1."""
    full = torch.cat([windows.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [b, C, K]
    out = (full * weight).sum(-1)
    if bias is not None:
        out = out + bias
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
    state_size = B.shape[-1]
    pad = (-length) % chunk_size
    # Padded steps get dt = 0: no decay, no input, so the final state is unchanged by them.
    x, dt = F.pad(x.float(), (0, 0, 0, 0, 0, pad)), F.pad(dt.float(), (0, 0, 0, pad))
    B = F.pad(_heads(B.float(), num_heads), (0, 0, 0, 0, 0, pad))
    C = F.pad(_heads(C.float(), num_heads), (0, 0, 0, 0, 0, pad))
    chunks = (length + pad) // chunk_size
    shape = (chunks, chunk_size, num_heads)
    xdt = (x * dt.unsqueeze(-1)).view(*shape, head_dim)
    B, C = B.view(*shape, state_size), C.view(*shape, state_size)
    # Log decay from the chunk's start to each step (inclusive): [c, l, h].
    cum = torch.cumsum((dt * A.float()).view(shape), dim=1)

    # Intra-chunk: y_l += sum_{s<=l} exp(cum_l - cum_s) (C_l . B_s) xdt_s. Differences for s > l
    # are positive and masked to -inf before exp, so nothing overflows.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    diff = cum.unsqueeze(2) - cum.unsqueeze(1)  # [c, l, s, h]
    decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)

    # Each chunk's own contribution to the state at its end: [c, h, p, n].
    to_end = torch.exp(cum[:, -1:] - cum)  # [c, l, h]
    chunk_states = torch.einsum("clh,clhn,clhp->chpn", to_end, B, xdt)
    chunk_decay = torch.exp(cum[:, -1])  # [c, h]: decay across a whole chunk

    # Inter-chunk: carry the state chunk by chunk (a few iterations: L / chunk_size).
    state = (
        torch.zeros(num_heads, head_dim, state_size, device=x.device)
        if initial_state is None
        else initial_state.float()
    )
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = state * chunk_decay[c][:, None, None] + chunk_states[c]
    start_states = torch.stack(starts)  # [c, h, p, n]
    y = y + torch.einsum("clhn,chpn->clhp", C, start_states) * torch.exp(cum).unsqueeze(-1)
    return y.reshape(-1, num_heads, head_dim)[:length], state


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step for b sequences, in float32: x [b, h, p], dt [b, h], A [h],
    B, C [b, g, n], state [b, h, p, n] -> (y [b, h, p] without the D skip, new state)."""
    num_heads = x.shape[1]
    dt = dt.float()
    B, C = _heads(B.float(), num_heads), _heads(C.float(), num_heads)
    decay = torch.exp(dt * A.float())[..., None, None]  # [b, h, 1, 1]
    update = (x.float() * dt.unsqueeze(-1)).unsqueeze(-1) * B.unsqueeze(-2)  # [b, h, p, n]
    new_state = state.float() * decay + update
    y = torch.einsum("bhpn,bhn->bhp", new_state, C)
    return y, new_state


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
