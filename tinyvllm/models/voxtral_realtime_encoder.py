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
        self.q_proj = nn.Linear(hidden, heads * head_dim)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, hidden)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden)

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
        self.linear_1 = nn.Linear(audio.hidden_size * self.downsample, text.hidden_size, False)
        self.linear_2 = nn.Linear(text.hidden_size, text.hidden_size, bias=False)
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
        if mel.shape[1] % self.mel_frames_per_position:
            raise ValueError(
                f"an encoder chunk must be whole decoder positions of "
                f"{self.mel_frames_per_position} mel frames, got {mel.shape[1]}"
            )
        x = mel.to(state.conv1_tail.dtype)
        emb = self.embedder
        padded = torch.cat([state.conv1_tail, x], dim=1)
        state.conv1_tail = padded[:, -2:]
        h = F.gelu(emb.conv1(padded[None]))[0]
        padded = torch.cat([state.conv2_tail, h], dim=1)
        state.conv2_tail = padded[:, -1:]
        h = F.gelu(emb.conv2(padded[None]))[0].T  # [frames, hidden]
        h = self._layers(h, state)
        return self.project(self.norm(h))

    def project(self, frames: torch.Tensor) -> torch.Tensor:
        """Encoder frames [n * downsample, hidden] -> [n, text_hidden]."""
        grouped = frames.reshape(-1, self.hidden * self.downsample)
        return self.linear_2(F.gelu(self.linear_1(grouped)))

    def _layers(self, h: torch.Tensor, state: EncoderStreamState) -> torch.Tensor:
        n, start = h.shape[0], state.num_frames
        positions = torch.arange(start, start + n, device=h.device)
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        past = state.keys[0].shape[1] if state.keys else 0
        key_pos = torch.arange(start - past, start + n, device=h.device)
        mask = key_pos[None, :] <= positions[:, None]
        if self.window is not None:
            mask &= key_pos[None, :] > positions[:, None] - self.window
        keep = n + past if self.window is None else self.window - 1
        fresh = not state.keys
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(h)
            q = _rope(attn.q_proj(x).view(n, attn.heads, -1).transpose(0, 1), cos, sin)
            k = _rope(attn.k_proj(x).view(n, attn.heads, -1).transpose(0, 1), cos, sin)
            v = attn.v_proj(x).view(n, attn.heads, -1).transpose(0, 1)
            if not fresh:
                k = torch.cat([state.keys[i], k], dim=1)
                v = torch.cat([state.values[i], v], dim=1)
                state.keys[i], state.values[i] = k[:, -keep:], v[:, -keep:]
            else:
                state.keys.append(k[:, -keep:])
                state.values.append(v[:, -keep:])
            # 4-D operands: CPU torch runs its fused kernel (3-D ones take the math fallback).
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
            h = h + attn.o_proj(out.transpose(0, 1).reshape(n, -1))
            h = h + layer.mlp(layer.final_layer_norm(h))
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


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary embedding; x [heads, n, head_dim], cos/sin [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
