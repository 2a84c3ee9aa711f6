"""Rotary position embeddings, including the scaled variants real checkpoints use.

The frequencies follow transformers' `ROPE_INIT_FUNCTIONS` (default, linear, dynamic,
yarn, longrope, llama3); a test checks them against it. Rotation uses the HF "neox"
layout: the first half of the rotary dims pairs with the second half (`rotate_half`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from tinyvllm.native.ops import NativeCpuOps


@dataclass(frozen=True)
class RopeConfig:
    """Everything needed to compute rotary frequencies, normalised from an HF config."""

    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int
    max_position_embeddings: int
    # The raw scaling parameters (factor, original_max_position_embeddings, beta_fast, ...).
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_config(
        cls, config: Any, head_dim: int | None = None, layer_type: str | None = None
    ) -> RopeConfig:
        """Read `config.rope_parameters` (transformers v5), falling back to the older
        `config.rope_scaling` + `config.rope_theta` pair. Models whose rope differs per layer
        type (Gemma 3: "sliding_attention" / "full_attention") name the `layer_type`."""
        raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        raw = dict(raw or {})
        if layer_type is not None and isinstance(raw.get(layer_type), Mapping):
            raw = dict(raw[layer_type])
        if any(isinstance(value, Mapping) for value in raw.values()):
            raise ValueError(
                f"per-layer-type rope_parameters ({sorted(raw)}) are not supported by this model"
            )
        rope_type = raw.get("rope_type") or raw.get("type") or "default"
        if rope_type not in _INV_FREQ_FUNCTIONS:
            raise ValueError(
                f"rope_type={rope_type!r} is not supported; "
                f"supported: {sorted(_INV_FREQ_FUNCTIONS)}"
            )
        theta = raw.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
        if head_dim is None:
            head_dim = getattr(config, "head_dim", None) or (
                config.hidden_size // config.num_attention_heads
            )
        partial = raw.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
        rotary_dim = int(head_dim * (partial or 1.0))
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"rotary dimension must be even and within head_dim={head_dim}; "
                f"got {rotary_dim} (partial_rotary_factor={partial})"
            )
        max_pos = config.max_position_embeddings
        if rope_type in ("llama3", "yarn", "longrope"):
            # Like HF, an `original_max_position_embeddings` on the config itself (Phi-3) wins.
            original = getattr(config, "original_max_position_embeddings", None)
            if original is not None:
                raw["original_max_position_embeddings"] = original
            elif raw.get("original_max_position_embeddings") is None:
                raw["original_max_position_embeddings"] = max_pos
        return cls(
            rope_type=rope_type,
            theta=float(theta),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            max_position_embeddings=max_pos,
            params=MappingProxyType(raw),
        )


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (theta**exponents)


def _default(rope: RopeConfig, seq_len: int | None) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope.theta, rope.rotary_dim), 1.0


def _linear(rope: RopeConfig, seq_len: int | None) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope.theta, rope.rotary_dim) / rope.params["factor"], 1.0


def _dynamic(rope: RopeConfig, seq_len: int | None) -> tuple[torch.Tensor, float]:
    # NTK-aware: the base grows with the sequence length once it exceeds the trained one.
    dim, max_pos = rope.rotary_dim, rope.max_position_embeddings
    seq_len = max(seq_len or max_pos, max_pos)
    factor = rope.params["factor"]
    base = rope.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, seq_len: int | None) -> tuple[torch.Tensor, float]:
    p, dim, base = rope.params, rope.rotary_dim, rope.theta
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or rope.max_position_embeddings / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # The rotary dim whose wavelength completes `num_rotations` turns over `original`.
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(p.get("beta_fast") or 32)
    high = correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope(rope: RopeConfig, seq_len: int | None) -> tuple[torch.Tensor, float]:
    p, dim = rope.params, rope.rotary_dim
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or rope.max_position_embeddings / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    use_long = seq_len is not None and seq_len > original
    ext = torch.tensor(
        p["long_factor" if use_long else "short_factor"], dtype=torch.float32, device="cpu"
    )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext * rope.theta**exponents), float(attention_factor)


def _llama3(rope: RopeConfig, seq_len: int | None) -> tuple[torch.Tensor, float]:
    p = rope.params
    inv_freq = _base_inv_freq(rope.theta, rope.rotary_dim)
    factor, low_ff, high_ff = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low_ff, old_context / high_ff
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


_InvFreqFn = Callable[[RopeConfig, int | None], tuple[torch.Tensor, float]]
_INV_FREQ_FUNCTIONS: Mapping[str, _InvFreqFn] = MappingProxyType(
    {
        "default": _default,
        "linear": _linear,
        "dynamic": _dynamic,
        "yarn": _yarn,
        "longrope": _longrope,
        "llama3": _llama3,
    }
)


def _doubled(half: torch.Tensor, factor: float, device: torch.device) -> torch.Tensor:
    """[positions, rotary_dim]: `half` (cos or sin of [positions, rotary_dim / 2]) times
    `factor`, twice side by side: HF's cos(cat(freqs, freqs)) * factor element for element,
    built without full-width temporaries (a 32k-position table of head_dim 256 is 32 MiB,
    and the temporaries stayed in the C heap after the load)."""
    half = half.mul_(factor) if factor != 1.0 else half
    return torch.cat((half, half), dim=-1).to(device)


def compute_inv_freq(rope: RopeConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (float32, CPU) and the attention factor that
    scales cos/sin. `seq_len` only matters for dynamic and longrope."""
    return _INV_FREQ_FUNCTIONS[rope.rope_type](rope, seq_len)


class RotaryEmbedding(nn.Module):
    """Applies rope to flattened q/k using a cos/sin table for `max_position` positions.

    The table is fixed at construction, which matters for the two length-dependent types.
    HF recomputes `dynamic` frequencies from the longest sequence in the current batch, but
    a paged KV cache stores keys already rotated, so frequencies that change with the batch
    would leave old keys inconsistent with new queries. We therefore fix them for the longest
    sequence we will serve, max(max_position, max_position_embeddings): identical to HF (and
    to default rope) whenever max_model_len <= max_position_embeddings. `longrope` likewise
    picks its long factors once, when max_position exceeds the original training length.
    """

    native: NativeCpuOps | None = None

    def __init__(self, rope: RopeConfig, max_position: int) -> None:
        super().__init__()
        self.head_dim = rope.head_dim
        self.rotary_dim = rope.rotary_dim
        self.max_position = max_position
        self.rope_type = rope.rope_type
        # Computed on the CPU whatever the default device, so every device gets the same
        # table (and the same one HF builds).
        inv_freq, attention_factor = compute_inv_freq(rope, seq_len=max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cpu"), inv_freq)
        device = torch.get_default_device()
        # float32 on purpose: cos/sin of large positions lose too much in half precision,
        # so they are cast to the activation dtype only at use (as HF does).
        self.register_buffer("cos_cache", _doubled(freqs.cos(), attention_factor, device),
                             persistent=False)  # fmt: skip
        self.register_buffer("sin_cache", _doubled(freqs.sin(), attention_factor, device),
                             persistent=False)  # fmt: skip
        self._step_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.unflatten(-1, (-1, self.head_dim))
        rot = x[..., : self.rotary_dim]
        x1, x2 = rot.chunk(2, dim=-1)
        out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        if self.rotary_dim < self.head_dim:
            out = torch.cat((out, x[..., self.rotary_dim :]), dim=-1)
        return out.reshape(num_tokens, -1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq * head_dim]; k [T, Hkv * head_dim] -> rotated (q, k)."""
        native = self.native
        if (
            native is not None
            and native.elementwise_fits(q)
            and q.dtype == k.dtype
            and k.stride(1) == 1
            and positions.dtype == torch.int64
            and positions.is_contiguous()
        ):
            # In place: q and k are views of this step's fresh qkv projection.
            native.rope_(q, k, self.head_dim, self.rotary_dim, positions, self.cos_cache,
                         self.sin_cache)  # fmt: skip
            return q, k
        # Every layer of one forward passes the same positions tensor: look cos/sin up once.
        cached = self._step_cache
        if cached is not None and cached[0] is positions and cached[1].dtype == q.dtype:
            cos, sin = cached[1], cached[2]
        else:
            cos = self.cos_cache.index_select(0, positions).to(q.dtype).unsqueeze(1)
            sin = self.sin_cache.index_select(0, positions).to(q.dtype).unsqueeze(1)
            self._step_cache = (positions, cos, sin)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"rope_type={self.rope_type}, head_dim={self.head_dim}, "
            f"rotary_dim={self.rotary_dim}, max_position={self.max_position}"
        )


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rope (Qwen2-VL / Qwen2.5-VL): positions [3, T] (time, height, width), and
    the rotary frequencies split into `mrope_section` parts, part i rotated by section i's
    position. Text tokens carry the same position in all three sections, which is plain rope.

    cos/sin are computed per step from the positions (no table): a video's time positions
    advance by tokens_per_second * seconds per frame group, so they are not bounded by the
    context length. Same float32 product as HF's.
    """

    def __init__(self, rope: RopeConfig, mrope_section: list[int]) -> None:
        super().__init__(rope, max_position=1)
        half = self.rotary_dim // 2
        if sum(mrope_section) != half or len(mrope_section) != 3:
            raise ValueError(
                f"mrope_section={mrope_section} must be three parts summing to rotary_dim / 2 "
                f"= {half}"
            )
        inv_freq, self.attention_factor = compute_inv_freq(rope)
        device = torch.get_default_device()
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        sections = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("section_of_freq", sections.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (or [T] for text); q, k as in RotaryEmbedding."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        cached = self._step_cache
        if cached is not None and cached[0] is positions and cached[1].dtype == q.dtype:
            cos, sin = cached[1], cached[2]
        else:
            # Frequency i turns with the position of its section.
            freqs = positions[self.section_of_freq].T.float() * self.inv_freq  # [T, half]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.attention_factor).to(q.dtype).unsqueeze(1)
            sin = (emb.sin() * self.attention_factor).to(q.dtype).unsqueeze(1)
            self._step_cache = (positions, cos, sin)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
