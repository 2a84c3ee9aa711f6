"""The Mamba2 mixer (SSD), shared by the hybrid families that use it (Granite 4.0-H; later
NemotronH, FalconH1, Zamba2): in_proj -> causal depthwise conv + SiLU -> selective scan with
dt bias/softplus/limits, A = -exp(A_log) and the D skip -> gated RMSNorm -> out_proj.

Parameter names follow HF checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
`out_proj`). The math lives in `ssd.py`; this module slices a packed batch into sequences and
reads / writes each sequence's recurrent state slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import ReplicatedLinear, new_parameter
from tinyvllm.models.layers.ssd import (
    causal_conv1d,
    causal_conv1d_step,
    gated_rms_norm,
    ssd_scan,
    ssd_step,
)
from tinyvllm.quant.config import QuantConfig


@dataclass(frozen=True)
class Mamba2Config:
    """The sizes and switches of one Mamba2 mixer (each family maps its HF config here)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    rms_norm_eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # Granite / Mamba2 gate before the norm; FalconH1 may normalise first.
    norm_before_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "n_groups", "state_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Mamba2 {name} must be a positive integer, got {value!r}")
        if self.conv_kernel < 2 or self.chunk_size < 1:
            raise ValueError(
                f"Mamba2 needs conv kernel >= 2 and chunk_size >= 1, got conv kernel "
                f"{self.conv_kernel} and chunk_size {self.chunk_size}"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"Mamba2 n_groups={self.n_groups} must divide the number of heads "
                f"{self.num_heads}"
            )

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the conv sees: x, then B and C of every group."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def conv_state_shape(self) -> tuple[int, int]:
        """Per-sequence conv window: the last K-1 conv inputs, oldest first."""
        return (self.conv_dim, self.conv_kernel - 1)

    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)


@dataclass(frozen=True)
class RecurrentBatch:
    """Where each sequence of a packed step starts and which state slot it owns.

    `query_start_loc` has one more entry than there are sequences (host ints: slicing must not
    sync the device); sequence i's tokens are [query_start_loc[i], query_start_loc[i+1]).
    `slots[i]` indexes the layer's state tensors; `has_initial_state[i]` is False for a
    sequence's first chunk (its slot holds stale values, read as zeros)."""

    query_start_loc: Sequence[int]
    slots: Sequence[int]
    has_initial_state: Sequence[bool]


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer over a packed batch; states are bound by the runner (`bind_state`)."""

    def __init__(self, config: Mamba2Config, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        c = config
        self.in_proj = ReplicatedLinear(
            c.hidden_size, c.intermediate_size + c.conv_dim + c.num_heads, c.proj_bias, quant_config
        )
        # Depthwise conv weight kept in the checkpoint's [C, 1, K] layout.
        self.conv1d = nn.Module()
        self.conv1d.weight = new_parameter(c.conv_dim, 1, c.conv_kernel)
        self.conv1d.bias = new_parameter(c.conv_dim) if c.conv_bias else None
        self.dt_bias = new_parameter(c.num_heads)
        self.A_log = new_parameter(c.num_heads)
        self.D = new_parameter(c.num_heads)
        self.norm = nn.Module()
        self.norm.weight = new_parameter(c.intermediate_size)
        self.out_proj = ReplicatedLinear(
            c.intermediate_size, c.hidden_size, c.proj_bias, quant_config
        )
        self.conv_state: torch.Tensor | None = None  # [slots, C, K-1]
        self.ssm_state: torch.Tensor | None = None  # [slots, h, p, n]

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        c = self.config
        if tuple(conv_state.shape[1:]) != c.conv_state_shape():
            raise ValueError(
                f"conv state {tuple(conv_state.shape)} does not fit {c.conv_state_shape()}"
            )
        if tuple(ssm_state.shape[1:]) != c.ssm_state_shape():
            raise ValueError(f"SSM state {tuple(ssm_state.shape)} does not fit {c.ssm_state_shape()}")
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        low, high = self.config.time_step_limit
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(low, high)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated conv output [..., C] -> x [..., h, p], B and C [..., g, n]."""
        c = self.config
        bc = c.n_groups * c.state_size
        x, B, C = xbc.split([c.intermediate_size, bc, bc], dim=-1)
        lead = xbc.shape[:-1]
        return (
            x.reshape(*lead, c.num_heads, c.head_dim),
            B.reshape(*lead, c.n_groups, c.state_size),
            C.reshape(*lead, c.n_groups, c.state_size),
        )

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """hidden [T, hidden_size] (all sequences packed) -> [T, hidden_size]; each
        sequence's conv window and SSM state are read from and written back to its slot."""
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("Mamba2Mixer has no recurrent state bound (bind_state)")
        c = self.config
        gate, xbc, dt = self.in_proj(hidden).split(
            [c.intermediate_size, c.conv_dim, c.num_heads], dim=-1
        )
        A = -torch.exp(self.A_log.float())
        y = torch.empty(hidden.shape[0], c.intermediate_size, device=hidden.device)
        bounds = batch.query_start_loc
        single = [i for i in range(len(batch.slots)) if bounds[i + 1] - bounds[i] == 1]
        if single:
            self._step(xbc, dt, A, batch, single, y)
        for i in range(len(batch.slots)):
            start, end = bounds[i], bounds[i + 1]
            if end - start > 1:
                self._scan(xbc[start:end], dt[start:end], A, batch, i, y[start:end])
        out = gated_rms_norm(
            y, gate, self.norm.weight, c.rms_norm_eps, c.intermediate_size // c.n_groups,
            c.norm_before_gate,
        )
        return self.out_proj(out.to(hidden.dtype))

    def _scan(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        batch: RecurrentBatch,
        i: int,
        y_out: torch.Tensor,
    ) -> None:
        """One sequence of several tokens: conv over its window, chunked SSD scan."""
        assert self.conv_state is not None and self.ssm_state is not None
        slot, carried = batch.slots[i], batch.has_initial_state[i]
        window = self.conv_state[slot] if carried else torch.zeros_like(self.conv_state[slot])
        conv, new_window = causal_conv1d(xbc, window, self.conv1d.weight[:, 0], self.conv1d.bias)
        x, B, C = self._split_xbc(F.silu(conv))
        initial = self.ssm_state[slot] if carried else None
        y, state = ssd_scan(x, self._dt(dt), A, B, C, self.config.chunk_size, initial)
        y_out.copy_((y + x.float() * self.D.float()[:, None]).flatten(-2))
        self.conv_state[slot] = new_window
        self.ssm_state[slot] = state

    def _step(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        batch: RecurrentBatch,
        rows: list[int],
        y: torch.Tensor,
    ) -> None:
        """All one-token sequences at once (decode): the recurrent update of their slots."""
        assert self.conv_state is not None and self.ssm_state is not None
        device = xbc.device
        tokens = torch.tensor([batch.query_start_loc[i] for i in rows], device=device)
        slots = torch.tensor([batch.slots[i] for i in rows], device=device)
        carried = torch.tensor([batch.has_initial_state[i] for i in rows], device=device)
        keep = carried.view(-1, 1, 1)
        windows = torch.where(keep, self.conv_state[slots], 0)
        conv, new_windows = causal_conv1d_step(
            xbc[tokens], windows, self.conv1d.weight[:, 0], self.conv1d.bias
        )
        x, B, C = self._split_xbc(F.silu(conv))
        states = torch.where(keep.unsqueeze(-1), self.ssm_state[slots].float(), 0)
        out, new_states = ssd_step(x, self._dt(dt[tokens]), A, B, C, states)
        y[tokens] = (out + x.float() * self.D.float()[:, None]).flatten(-2)
        self.conv_state[slots] = new_windows.to(self.conv_state.dtype)
        self.ssm_state[slots] = new_states.to(self.ssm_state.dtype)


def mamba2_config_from_hf(config: Any, prefix: str = "mamba_") -> Mamba2Config:
    """A Mamba2Config from HF fields named `{prefix}n_heads`, `{prefix}d_head`, ... (Granite
    4.0-H, NemotronH and FalconH1 use the "mamba_" prefix)."""
    heads = getattr(config, f"{prefix}n_heads")
    head_dim = getattr(config, f"{prefix}d_head", "auto")
    expand = getattr(config, f"{prefix}expand", 2)
    if head_dim in (None, "auto"):
        head_dim = expand * config.hidden_size // heads
    limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
    return Mamba2Config(
        hidden_size=config.hidden_size,
        num_heads=heads,
        head_dim=head_dim,
        n_groups=getattr(config, f"{prefix}n_groups", 1),
        state_size=getattr(config, f"{prefix}d_state"),
        conv_kernel=getattr(config, f"{prefix}d_conv", 4),
        chunk_size=getattr(config, f"{prefix}chunk_size", 256),
        rms_norm_eps=config.rms_norm_eps,
        conv_bias=bool(getattr(config, f"{prefix}conv_bias", True)),
        proj_bias=bool(getattr(config, f"{prefix}proj_bias", False)),
        time_step_limit=(float(limit[0]), float(limit[1])),
        norm_before_gate=bool(getattr(config, f"{prefix}norm_before_gate", False)),
    )
