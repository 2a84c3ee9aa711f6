"""The Mamba2 mixer (SSD), shared by the hybrid families that use it (Granite 4.0-H; later
NemotronH, FalconH1, Zamba2): in_proj -> causal depthwise conv + SiLU -> selective scan with
dt bias/softplus/limits, A = -exp(A_log) and the D skip -> gated RMSNorm -> out_proj.

Parameter names follow HF checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
`out_proj`). The math lives in `ssd.py`; this module slices a packed batch into sequences and
reads / writes each sequence's recurrent state slot.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import ReplicatedLinear, new_parameter
from tinyvllm.models.layers.recurrent import RecurrentLayer, StateShape
from tinyvllm.models.layers.ssd import (
    causal_conv1d,
    causal_conv1d_step,
    gated_rms_norm,
    ssd_scan,
    ssd_step,
)
from tinyvllm.quant.config import QuantConfig

if TYPE_CHECKING:
    from tinyvllm.attention.backend import AttentionMetadata
    from tinyvllm.attention.recurrent import RecurrentMetadata


MAX_SCAN_CHUNK = 64


@dataclass(frozen=True)
class Mamba2Config:
    """The sizes and switches of one Mamba2 mixer (each family maps its HF config here)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    # The checkpoint's SSD chunk; the scan runs at most MAX_SCAN_CHUNK of it (`scan_chunk`).
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
                f"Mamba2 n_groups={self.n_groups} must divide the number of heads {self.num_heads}"
            )

    @property
    def scan_chunk(self) -> int:
        """The chunk the prefill scan uses. The result does not depend on it (only rounding
        does); the intra-chunk work grows with it, so long chunks cost more on CPUs: a
        1,024-token scan of a Granite-4.0-H-sized layer took 357 ms in chunks of 256 and 68 ms
        in chunks of 64 (one thread)."""
        return min(self.chunk_size, MAX_SCAN_CHUNK)

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


class Mamba2Mixer(RecurrentLayer):
    """One Mamba2 layer over a packed batch. Its states (bound by the runner) are the conv
    window [slots, C, K-1] in the model dtype and the SSM state [slots, h, p, n] in
    `ssm_state_dtype` (float32 by default: the recurrence accumulates over the whole
    sequence, as HF's cache does)."""

    def __init__(
        self,
        config: Mamba2Config,
        quant_config: QuantConfig | None = None,
        ssm_state_dtype: torch.dtype = torch.float32,
    ) -> None:
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
        self.conv_dtype = torch.get_default_dtype()  # the model dtype while it is built
        self.ssm_state_dtype = ssm_state_dtype
        # Chosen once, for the device the model is built on: on CUDA the decode step is two
        # Triton launches (mamba2_triton.py) instead of a dozen small torch ops per layer.
        self.triton_decode = (
            torch.get_default_device().type == "cuda"
            and importlib.util.find_spec("triton") is not None
        )

    def set_ssm_state_dtype(self, dtype: torch.dtype) -> None:
        self.ssm_state_dtype = dtype

    def state_shapes(self) -> list[StateShape]:
        c = self.config
        return [
            StateShape(c.conv_state_shape(), self.conv_dtype),
            StateShape(c.ssm_state_shape(), self.ssm_state_dtype),
        ]

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

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden_size] (all requests packed) -> [T, hidden_size]; each request's
        conv window and SSM state are read from and written back to its slot."""
        recurrent = metadata.recurrent
        if recurrent is None or len(self.states) != 2:
            raise RuntimeError(
                "Mamba2Mixer needs its recurrent states bound and AttentionMetadata.recurrent "
                "set (the runner's mamba_hybrid model state does both)"
            )
        c = self.config
        gate, xbc, dt = self.in_proj(hidden).split(
            [c.intermediate_size, c.conv_dim, c.num_heads], dim=-1
        )
        A = -torch.exp(self.A_log.float())
        y = torch.empty(
            hidden.shape[0], c.intermediate_size, dtype=torch.float32, device=hidden.device
        )
        if recurrent.decode_indices_cpu:
            self._step(xbc, dt, A, metadata, recurrent, y)
        bounds = metadata.query_start_loc_cpu
        for i in recurrent.prefill_indices_cpu:
            start, end = bounds[i], bounds[i + 1]
            slot = recurrent.state_indices_cpu[i]
            carried = recurrent.has_initial_state_cpu[i]
            self._scan(xbc[start:end], dt[start:end], A, slot, carried, y[start:end])
        out = gated_rms_norm(
            y,
            gate,
            self.norm.weight,
            c.rms_norm_eps,
            c.intermediate_size // c.n_groups,
            c.norm_before_gate,
        )
        return self.out_proj(out.to(hidden.dtype))

    def _scan(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        slot: int,
        carried: bool,
        y_out: torch.Tensor,
    ) -> None:
        """One request's chunk: conv over its window, chunked SSD scan, state written back."""
        conv_state, ssm_state = self.states
        # Zeros when not carried, whatever the slot holds (the runner zeroes it too).
        window = conv_state[slot] if carried else torch.zeros_like(conv_state[slot])
        conv, new_window = causal_conv1d(xbc, window, self.conv1d.weight[:, 0], self.conv1d.bias)
        x, B, C = self._split_xbc(F.silu(conv))
        initial = ssm_state[slot] if carried else None
        y, state = ssd_scan(x, self._dt(dt), A, B, C, self.config.scan_chunk, initial)
        y_out.copy_((y + x.float() * self.D.float()[:, None]).flatten(-2))
        conv_state[slot] = new_window
        ssm_state[slot] = state

    def _step(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        metadata: AttentionMetadata,
        recurrent: RecurrentMetadata,
        y: torch.Tensor,
    ) -> None:
        """All decode requests at once (one token each, continuing their slot's state)."""
        conv_state, ssm_state = self.states
        rows = recurrent.decode_indices
        tokens = metadata.query_start_loc[rows].long()
        slots = recurrent.state_indices[rows]
        if self.triton_decode:
            from tinyvllm.models.layers.mamba2_triton import mamba2_decode_step

            c = self.config
            weight, bias = self.conv1d.weight, self.conv1d.bias
            states = (conv_state, ssm_state)
            params = (weight, bias, A, self.D, self.dt_bias)
            mamba2_decode_step(
                xbc, dt, tokens, slots, *states, *params, c.time_step_limit, c.n_groups, y
            )
            return
        conv, new_windows = causal_conv1d_step(
            xbc[tokens], conv_state[slots], self.conv1d.weight[:, 0], self.conv1d.bias
        )
        conv_state[slots] = new_windows.to(conv_state.dtype)
        x, B, C = self._split_xbc(F.silu(conv))
        # Consecutive slots (always so for one request) are updated in place through a view;
        # others through a gathered copy written back.
        slot_list = [recurrent.state_indices_cpu[i] for i in recurrent.decode_indices_cpu]
        first, count = slot_list[0], len(slot_list)
        in_place = ssm_state.dtype == torch.float32 and slot_list == [*range(first, first + count)]
        states = ssm_state[first : first + count] if in_place else ssm_state[slots].float()
        out = ssd_step(x, self._dt(dt[tokens]), A, B, C, states)
        if not in_place:
            ssm_state[slots] = states.to(ssm_state.dtype)
        y[tokens] = (out + x.float() * self.D.float()[:, None]).flatten(-2)


def mamba2_config_from_hf(config: Any, prefix: str = "mamba_") -> Mamba2Config:
    """A Mamba2Config from HF fields named `{prefix}n_heads`, `{prefix}d_head`, ... (Granite
    4.0-H, Bamba and FalconH1 use the "mamba_" prefix; NemotronH names them differently)."""
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
