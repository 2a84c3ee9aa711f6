"""The Qwen2.5-VL vision tower: flattened patches -> merged tokens for the language model.

Parameter names follow transformers' `Qwen2_5_VisionTransformerPretrainedModel` (the
checkpoint's `visual.` prefix stripped) except that gate/up are fused (`gate_up_proj`);
`load_weights` maps the split tensors in and reshapes the Conv3d patch-embedding kernel.

Layout (as in HF, built in `qwen2_5_vl_layout`): the merged tokens are permuted into window
order before the blocks and back after the merger, so every window is a contiguous run.

On CPU each block runs over runs of whole attention segments (`VisionLayout.chunks`), about
`CPU_CHUNK_ROWS` patches at a time: attention never crosses a segment and every other op is
row-wise, so this equals one pass over all patches, while the run's activations stay in
cache and its temporaries are reused instead of freshly mapped (a 16-frame 448x448 clip is
8,192 patches: each full-width temporary would be 20-110 MB).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import MergedColumnLinear, ReplicatedLinear
from tinyvllm.models.layers.norm import RMSNorm
from tinyvllm.models.qwen2_5_vl_layout import varlen_attention, vision_layout
from tinyvllm.models.weights import load_named_weights

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}

# Patches per block pass on CPU: two 448x448 frames (2,048 patches, 32 windows of 64);
# measured on the 3B tower in benchmarks/README.md (evs.py).
CPU_CHUNK_ROWS = 2048

# The vision blocks and the merger use a fixed eps in every released checkpoint (HF too).
_NORM_EPS = 1e-6


def rotate_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """2-D rotary on q and k together: qk [N, 2, heads, head_dim] (any strides), cos/sin
    [N, head_dim / 2] float32 -> rotated, contiguous, in qk's dtype.

    HF computes q * cos + rotate_half(q) * sin in float32 with cos = [c | c]: per half that
    is x1 * c - x2 * s and x2 * c + x1 * s, the same float32 products and sums here (the
    bf16 -> float32 promotion is exact) with one rounding at the end, but without the
    float32 copies of q and k or the concatenated rotated half.
    """
    half = qk.shape[-1] // 2
    cos, sin = cos[:, None, None], sin[:, None, None]
    x1, x2 = qk[..., :half], qk[..., half:]
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    first = x1 * cos
    first -= x2 * sin
    out[..., :half] = first
    second = x2 * cos
    second += x1 * sin
    out[..., half:] = second
    return out


class VisionRotary(nn.Module):
    """2-D rotary: the first half of the frequencies encodes the row, the second the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.half = head_dim // 2
        self.theta = theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, 2] -> (cos, sin), each [N, head_dim / 2] in float32: the angles of
        both halves of a head (HF repeats them as [angles | angles])."""
        # Computed per call (head_dim / 4 values) rather than kept as a buffer, which
        # `model.to(torch.bfloat16)` would round.
        exponents = torch.arange(0, self.half, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.half))
        angles = (positions[..., None].float() * inv_freq).flatten(1)  # [rows | columns]
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        return f"head_dim={2 * self.half}, theta={self.theta}"


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True)
        self.proj = ReplicatedLinear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        q, k = rotate_qk(qkv[:, :2], *rope).unbind(1)
        return self.proj(varlen_attention(q, k, qkv[:, 2], seqlens, self.scale))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"vision_config.hidden_act={act!r} is not supported; "
                f"supported: {', '.join(sorted(_ACTIVATIONS))}"
            )
        self.act = _ACTIVATIONS[act]
        self.gate_up_proj = MergedColumnLinear(dim, [hidden, hidden], bias=True)
        self.down_proj = ReplicatedLinear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        hidden = self.act(gate)
        hidden *= up  # in place: one MLP-wide temporary instead of two
        return self.down_proj(hidden)


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, eps=_NORM_EPS)
        self.norm2 = RMSNorm(config.hidden_size, eps=_NORM_EPS)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self,
        x: torch.Tensor,
        chunks: list[tuple[int, int, list[int]]],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x [N, dim], updated in place one run of whole attention segments at a time (the
        in-place residual adds round like HF's `x + attn(...)`)."""
        cos, sin = rope
        for start, end, seqlens in chunks:
            part = x[start:end]
            part += self.attn(self.norm1(part), seqlens, (cos[start:end], sin[start:end]))
            part += self.mlp(self.norm2(part))
        return x


class PatchEmbedProj(ReplicatedLinear):
    """The Conv3d patch embedding as a matmul: kernel == stride == one patch, so the
    convolution is one dot product per patch. Loads the 5-D kernel by flattening it."""

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        super().weight_loader(param, loaded.reshape(loaded.shape[0], -1), shard_id)


class PatchEmbed(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.proj = PatchEmbedProj(patch_dim, config.hidden_size, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.proj.input_size:
            raise ValueError(
                f"pixel_values must be [num_patches, {self.proj.input_size}] "
                "(channels * temporal_patch_size * patch_size**2), got "
                f"{list(pixel_values.shape)}"
            )
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class PatchMerger(nn.Module):
    """RMSNorm, then m*m neighbouring patches concatenated and projected by a GELU MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.ln_q = RMSNorm(dim, eps=_NORM_EPS)
        self.mlp = nn.Sequential(
            ReplicatedLinear(self.merged_dim, self.merged_dim, bias=True),
            nn.GELU(),
            ReplicatedLinear(self.merged_dim, out_dim, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class Qwen2_5_VisionTransformer(nn.Module):
    """forward(pixel_values [num_patches, C*tp*p*p], grid_thw [items, 3]) ->
    [num_patches / merge**2, out_hidden_size], items concatenated in input order."""

    stacked_params = (
        ("mlp.gate_proj", "mlp.gate_up_proj", 0),
        ("mlp.up_proj", "mlp.gate_up_proj", 1),
    )

    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_size % config.num_heads:
            raise ValueError(
                f"vision_config.hidden_size={config.hidden_size} is not divisible by "
                f"num_heads={config.num_heads}"
            )
        self.merge = config.spatial_merge_size
        self.window = config.window_size // self.merge // config.patch_size
        if self.window < 1:
            raise ValueError(
                f"vision_config.window_size={config.window_size} is smaller than one merged "
                f"token (spatial_merge_size * patch_size = {self.merge * config.patch_size})"
            )
        self.fullatt_block_indexes = frozenset(config.fullatt_block_indexes)
        # Patches per block pass on CPU (see the module docstring); a GPU takes all at once.
        self.chunk_rows: int | None = CPU_CHUNK_ROWS
        self.patch_embed = PatchEmbed(config)
        head_dim = config.hidden_size // config.num_heads
        self.rotary_pos_emb = VisionRotary(head_dim, _rope_theta(config))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, self.merge)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or len(grid_thw) == 0:
            raise ValueError(f"grid_thw must be [num_items >= 1, 3], got {list(grid_thw.shape)}")
        if (grid_thw < 1).any():
            raise ValueError(f"grid_thw {grid_thw.tolist()} has an empty item (sizes must be >= 1)")
        expected = int(grid_thw.prod(-1).sum())
        if pixel_values.shape[0] != expected:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patches but grid_thw "
                f"{grid_thw.tolist()} describes {expected}"
            )
        layout = vision_layout(grid_thw.cpu(), self.merge, self.window, pixel_values.device)
        unit = self.merge * self.merge
        x = self.patch_embed(pixel_values)
        x = x.view(-1, unit, x.shape[-1])[layout.window_index].view(-1, x.shape[-1])
        rope = self.rotary_pos_emb(layout.positions)
        rows = self.chunk_rows if x.device.type == "cpu" else None
        chunks = {full: layout.chunks(full, rows) for full in (False, True)}
        for i, block in enumerate(self.blocks):
            x = block(x, chunks[i in self.fullatt_block_indexes], rope)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[layout.window_index] = merged  # back to the input order
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy `(name, tensor)` pairs named as in HF's vision model (checkpoint prefix
        `visual.` / `model.visual.` already stripped) into the parameters."""
        load_named_weights(self, weights, stacked_params=self.stacked_params)
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm) and not torch.isfinite(module.weight).all():
                raise ValueError(
                    f"vision tensor {name}.weight holds NaN or infinite values (a corrupt file?)"
                )
