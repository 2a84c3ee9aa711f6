"""The Qwen2.5-VL vision tower: flattened patches -> merged tokens for the language model.

Parameter names follow transformers' `Qwen2_5_VisionTransformerPretrainedModel` (the
checkpoint's `visual.` prefix stripped) except that gate/up are fused (`gate_up_proj`);
`load_weights` maps the split tensors in and reshapes the Conv3d patch-embedding kernel.

Layout (as in HF): patches of one item arrive ordered (t, h/m, w/m, m, m), so each run of
m*m consecutive patches is one merged token. Windowed blocks attend inside windows of
`window_size` pixels; to make every window a contiguous run, the merged tokens are permuted
into window order before the blocks and back after the merger. Full-attention blocks attend
within one temporal patch (frame pair) of one item.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import MergedColumnLinear, ReplicatedLinear
from tinyvllm.models.layers.norm import RMSNorm
from tinyvllm.models.weights import load_named_weights

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}

# The vision blocks and the merger use a fixed eps in every released checkpoint (HF too).
_NORM_EPS = 1e-6


@dataclass(frozen=True)
class VisionLayout:
    """Index bookkeeping for one forward call, derived from `grid_thw` alone.

    `window_index[i]` is the merged token (in input order) placed at position i of the
    window order; `window_seqlens` / `frame_seqlens` are the patch counts of the attention
    segments of the windowed and the full-attention blocks, in window order. `positions`
    holds each patch's (row, column) on its frame's patch grid, in window order.
    """

    window_index: torch.Tensor
    window_seqlens: list[int]
    frame_seqlens: list[int]
    positions: torch.Tensor


def _item_windows(
    t: int, h: int, w: int, window: int, offset: int
) -> tuple[torch.Tensor, list[int]]:
    """Window order of one item's merged tokens (grid t x h x w) and its window sizes."""
    ti, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    windows_h, windows_w = -(-h // window), -(-w // window)
    window_id = (ti * windows_h + hi // window) * windows_w + wi // window
    # Windows in row-major order per frame, tokens in row-major order inside each window.
    key = (window_id * window + hi % window) * window + wi % window
    order = torch.argsort(key.flatten())
    counts = torch.bincount(window_id.flatten(), minlength=t * windows_h * windows_w)
    return order + offset, counts[counts > 0].tolist()


def _item_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(row, column) of each patch of one item, in the processor's (t, h/m, w/m, m, m) order."""
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    frame = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    return frame.repeat(t, 1)


def vision_layout(
    grid_thw: torch.Tensor, merge: int, window: int, device: torch.device | None = None
) -> VisionLayout:
    """Build the permutation and attention segments for items with patch grids `grid_thw`.

    `window` is the window side in merged tokens (`window_size // merge // patch_size`).
    """
    unit = merge * merge
    window_index: list[torch.Tensor] = []
    window_seqlens: list[int] = []
    frame_seqlens: list[int] = []
    positions: list[torch.Tensor] = []
    offset = 0
    for t, h, w in grid_thw.tolist():
        if h % merge or w % merge:
            raise ValueError(
                f"grid_thw item {(t, h, w)}: height and width must be multiples of "
                f"spatial_merge_size={merge} (use the Qwen-VL processor to build the inputs)"
            )
        order, counts = _item_windows(t, h // merge, w // merge, window, offset)
        window_index.append(order)
        window_seqlens.extend(count * unit for count in counts)
        frame_seqlens.extend([h * w] * t)
        positions.append(_item_positions(t, h, w, merge))
        offset += t * (h // merge) * (w // merge)
    index = torch.cat(window_index)
    # Reorder patches in whole merged-token units, like the hidden states.
    patch_positions = torch.cat(positions).view(-1, unit, 2)[index].view(-1, 2)
    return VisionLayout(
        window_index=index.to(device),
        window_seqlens=window_seqlens,
        frame_seqlens=frame_seqlens,
        positions=patch_positions.to(device),
    )


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], scale: float
) -> torch.Tensor:
    """Bidirectional attention inside each segment; q/k/v [N, heads, head_dim] -> same shape.

    Segments of equal length are stacked into one batched SDPA call: windows share a few
    sizes, so a ~1k-patch image costs a handful of kernel launches instead of one per window.
    """
    out = torch.empty_like(q)
    starts = torch.tensor([0, *seqlens[:-1]], dtype=torch.long).cumsum(0)
    lengths = torch.tensor(seqlens, dtype=torch.long)
    for length in torch.unique(lengths).tolist():
        first = starts[lengths == length].to(q.device)
        rows = (first[:, None] + torch.arange(length, device=q.device)).flatten()
        shape = (first.numel(), length, q.shape[1], q.shape[2])
        qs, ks, vs = (x[rows].view(shape).transpose(1, 2) for x in (q, k, v))
        res = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[rows] = res.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class VisionRotary(nn.Module):
    """2-D rotary: the first half of the frequencies encodes the row, the second the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.half = head_dim // 2
        self.theta = theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, 2] -> (cos, sin), each [N, head_dim] in float32."""
        # Computed per call (head_dim / 4 values) rather than kept as a buffer, which
        # `model.to(torch.bfloat16)` would round.
        exponents = torch.arange(0, self.half, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.half))
        angles = (positions[..., None].float() * inv_freq).flatten(1)  # [rows | columns]
        angles = torch.cat([angles, angles], dim=-1)
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
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = (c[:, None, :] for c in rope)
        # Rotate in float32 like HF, then return to the activation dtype.
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = varlen_attention(q, k, v, seqlens, self.scale)
        return self.proj(out.reshape(n, -1))


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
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, eps=_NORM_EPS)
        self.norm2 = RMSNorm(config.hidden_size, eps=_NORM_EPS)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), seqlens, rope)
        return x + self.mlp(self.norm2(x))


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
        for i, block in enumerate(self.blocks):
            full = i in self.fullatt_block_indexes
            x = block(x, layout.frame_seqlens if full else layout.window_seqlens, rope)
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
