"""Voxtral Realtime's causal audio encoder and projector, encoding a stream chunk by chunk.

Log-mel frames -> two causal convolutions (kernel 3; the second with stride 2) with GELU ->
RMSNorm transformer layers with RoPE and causal sliding-window attention -> RMSNorm. Every
`downsample_factor` consecutive encoder frames are concatenated and projected (linear, GELU,
linear) to one text-width embedding: the audio of one decoder position.

Everything is causal, so a stream is encoded incrementally: `EncoderStreamState` keeps what
the next chunk reads from the past (the last input frames of each convolution and each
layer's keys/values within the attention window), and encoding audio in chunks gives the same
frames as encoding it whole. A chunk is a whole number of decoder positions (2 x
downsample_factor mel frames each), which keeps the stride-2 convolution aligned.
Module and parameter names follow the HF checkpoint (`audio_tower.*`,
`multi_modal_projector.*`), so the towers load with `load_state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import ReplicatedLinear


class _RMSNorm(nn.Module):
    """x / rms(x) in float32, cast back, times the weight (HF's order of roundings)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class _Embedder(nn.Module):
    def __init__(self, mel_bins: int, hidden: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(mel_bins, hidden, 3)
        self.conv2 = nn.Conv1d(hidden, hidden, 3, stride=2)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = ReplicatedLinear(hidden, heads * head_dim, True)
        self.k_proj = ReplicatedLinear(hidden, heads * head_dim, False)
        self.v_proj = ReplicatedLinear(hidden, heads * head_dim, True)
        self.o_proj = ReplicatedLinear(heads * head_dim, hidden, True)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = ReplicatedLinear(hidden, intermediate, False)
        self.up_proj = ReplicatedLinear(hidden, intermediate, False)
        self.down_proj = ReplicatedLinear(intermediate, hidden, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = _Attention(hidden, config.num_attention_heads, config.head_dim)
        self.self_attn_layer_norm = _RMSNorm(hidden, eps)
        self.final_layer_norm = _RMSNorm(hidden, eps)
        self.mlp = _MLP(hidden, config.intermediate_size)


@dataclass
class EncoderStreamState:
    """What encoding the next chunk of one stream needs from the chunks before it."""

    conv1_tail: torch.Tensor  # [mel_bins, 2]: the last mel frames (zeros before the start)
    conv2_tail: torch.Tensor  # [hidden, 1]: the last conv1 output frame
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [heads, n, head_dim]
    values: list[torch.Tensor] = field(default_factory=list)
    num_frames: int = 0  # encoder frames done (their positions are 0 .. num_frames - 1)


class VoxtralRealtimeAudioTower(nn.Module):
    """The audio encoder (`audio_tower.*`) plus the projector (`multi_modal_projector.*`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio, text = config.audio_config, config.text_config
        if getattr(audio, "hidden_act", "silu") != "silu" or config.projector_hidden_act != "gelu":
            raise ValueError(
                f"audio_config.hidden_act={audio.hidden_act!r} / projector_hidden_act="
                f"{config.projector_hidden_act!r} are not supported; Voxtral Realtime uses "
                "'silu' and 'gelu'"
            )
        self.hidden = audio.hidden_size
        self.window = audio.sliding_window  # None: full causal attention
        self.downsample = config.downsample_factor
        self.embedder = _Embedder(audio.num_mel_bins, audio.hidden_size)
        self.layers = nn.ModuleList(_Layer(audio) for _ in range(audio.num_hidden_layers))
        self.norm = _RMSNorm(audio.hidden_size, audio.rms_norm_eps)
        self.linear_1 = ReplicatedLinear(
            audio.hidden_size * self.downsample, text.hidden_size, False
        )
        self.linear_2 = ReplicatedLinear(text.hidden_size, text.hidden_size, False)
        theta = float(audio.rope_parameters["rope_theta"])
        dim = audio.head_dim
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim), persistent=False
        )

    @property
    def mel_frames_per_position(self) -> int:
        return 2 * self.downsample  # conv2 halves the frame rate

    def new_state(self) -> EncoderStreamState:
        w = self.embedder.conv1.weight
        return EncoderStreamState(
            torch.zeros(w.shape[1], 2, dtype=w.dtype, device=w.device),
            torch.zeros(w.shape[0], 1, dtype=w.dtype, device=w.device),
        )

    def encode(self, mel: torch.Tensor, state: EncoderStreamState) -> torch.Tensor:
        """mel [mel_bins, k * mel_frames_per_position] (the frames after the state's) ->
        [k, text_hidden] audio embeddings; advances `state`."""
        return self.encode_many([mel], [state])[0]

    def encode_many(
        self, mels: list[torch.Tensor], states: list[EncoderStreamState]
    ) -> list[torch.Tensor]:
        """`encode` for several streams in one batch (one call per layer for all of them:
        concurrent streams each bring one position per step); every mel chunk has the same
        number of frames, the streams' histories may differ."""
        frames = mels[0].shape[1]
        if frames % self.mel_frames_per_position or any(m.shape[1] != frames for m in mels):
            raise ValueError(
                f"encoder chunks must be whole decoder positions of "
                f"{self.mel_frames_per_position} mel frames, all of one size; got "
                f"{[m.shape[1] for m in mels]}"
            )
        dtype = states[0].conv1_tail.dtype
        x = torch.stack([m.to(dtype) for m in mels])  # [R, mel_bins, frames]
        emb = self.embedder
        padded = torch.cat([torch.stack([s.conv1_tail for s in states]), x], dim=2)
        h = F.gelu(emb.conv1(padded))
        for state, row in zip(states, padded, strict=True):
            state.conv1_tail = row[:, -2:]
        padded = torch.cat([torch.stack([s.conv2_tail for s in states]), h], dim=2)
        # Contiguous rows: the layers' norms and residual adds keep this layout, and the native
        # GEMV (a live stream's few frames per step) takes only contiguous rows.
        h = F.gelu(emb.conv2(padded)).transpose(1, 2).contiguous()  # [R, frames / 2, hidden]
        for state, row in zip(states, padded, strict=True):
            state.conv2_tail = row[:, -1:]
        h = self._layers(h, states)
        return list(self.project(self.norm(h)).unbind(0))

    def project(self, frames: torch.Tensor) -> torch.Tensor:
        """Encoder frames [..., n * downsample, hidden] -> [..., n, text_hidden]."""
        grouped = frames.reshape(*frames.shape[:-2], -1, self.hidden * self.downsample)
        return self.linear_2(F.gelu(self.linear_1(grouped)))

    def _layers(self, h: torch.Tensor, states: list[EncoderStreamState]) -> torch.Tensor:
        rows, n = h.shape[:2]
        device = h.device
        starts = torch.tensor([s.num_frames for s in states], device=device)
        positions = starts[:, None] + torch.arange(n, device=device)  # [R, n]
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [R, 1, n, head_dim]
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        pasts = [s.keys[0].shape[1] if s.keys else 0 for s in states]
        most = max(pasts)
        # Key slot j of row r holds position start_r - most + j; the slots before the row's
        # own past are padding.
        slot = torch.arange(most + n, device=device)
        key_pos = starts[:, None] - most + slot
        short = torch.tensor([most - p for p in pasts], device=device)
        mask = (slot[None, :] >= short[:, None])[:, None, :]
        mask = mask & (key_pos[:, None, :] <= positions[:, :, None])
        if self.window is not None:
            mask &= key_pos[:, None, :] > positions[:, :, None] - self.window
        keep = None if self.window is None else self.window - 1
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: all rows' keys, values
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(h)
            q = _rope(attn.q_proj(x).view(rows, n, attn.heads, -1).transpose(1, 2), cos, sin)
            k = _rope(attn.k_proj(x).view(rows, n, attn.heads, -1).transpose(1, 2), cos, sin)
            v = attn.v_proj(x).view(rows, n, attn.heads, -1).transpose(1, 2)
            if most:
                k = torch.cat([_padded_past(states, pasts, i, most, "keys", k), k], dim=2)
                v = torch.cat([_padded_past(states, pasts, i, most, "values", v), v], dim=2)
            cache.append((k, v))
            # 4-D operands: CPU torch runs its fused kernel (3-D ones take the math fallback).
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
            h = h + attn.o_proj(out.transpose(1, 2).reshape(rows, n, -1))
            h = h + layer.mlp(layer.final_layer_norm(h))
        for r, state in enumerate(states):
            # Each row's own frames (no padding), the last window - 1 of them.
            lo = most - pasts[r]
            state.keys = [_last(k[r, :, lo:], keep) for k, _ in cache]
            state.values = [_last(v[r, :, lo:], keep) for _, v in cache]
            state.num_frames += n
        return h

    def load_weights(self, weights: list[tuple[str, Any]]) -> None:
        """`audio_tower.*` names as the tower's own, `multi_modal_projector.*` as linear_1/2
        (the caller strips the prefixes and marks the projector's with "projector.")."""
        tensors = {n.removeprefix("projector."): torch.as_tensor(t) for n, t in weights}
        own = self.state_dict()
        missing = sorted(set(own) - set(tensors))
        unexpected = sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"audio tower tensors do not match the checkpoint: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for name, tensor in tensors.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"audio tower tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(own[name].shape)}"
                )
        self.load_state_dict(tensors)


def _padded_past(
    states: list[EncoderStreamState],
    pasts: list[int],
    layer: int,
    most: int,
    kind: str,
    like: torch.Tensor,
) -> torch.Tensor:
    """The streams' cached keys or values of one layer, left-padded to `most` frames (a fresh
    stream: all padding): [R, heads, most, head_dim]."""
    rows = []
    for state, past in zip(states, pasts, strict=True):
        if past:
            rows.append(F.pad(getattr(state, kind)[layer], (0, 0, most - past, 0)))
        else:
            rows.append(like.new_zeros(like.shape[1], most, like.shape[3]))
    return torch.stack(rows)


def _last(frames: torch.Tensor, keep: int | None) -> torch.Tensor:
    """The last `keep` frames of [heads, n, head_dim] (None: all)."""
    return frames if keep is None else frames[:, max(0, frames.shape[1] - keep) :]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary embedding; x [heads, n, head_dim], cos/sin [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
