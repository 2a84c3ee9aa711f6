"""The weight plan a model hands the native decode program (see llama_decode.py).

A model that can run as one native call describes itself here (`native_decode_plan()` on
the model): every tensor the program reads, per layer, with the format code of each weight.
The model decides what it can express (no soft cap, one norm epsilon, weights the kernels can
read); the program checks only what the kernels assume (dtypes, contiguity, limits), so the
native side never reaches into a model's modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm.native.abi import format_code


@dataclass(frozen=True)
class NativeMatrix:
    """A weight [out_features, in_features] as the kernels read it: dense rows (format codes
    of `abi.DTYPE_CODES`) or a GGUF block matrix (`abi.GGUF_FORMATS`), plus its bias."""

    data: torch.Tensor
    fmt: int
    bias: torch.Tensor | None = None

    @classmethod
    def dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> NativeMatrix | None:
        """A float weight's matrix; None for a dtype the kernels do not read."""
        code = format_code(weight.dtype)
        return None if code is None else cls(weight, code, bias)


@dataclass(frozen=True)
class ShortConvPlan:
    """LFM2's gated short convolution in place of attention: y = out_proj(C * conv(B * x))
    with B, C, x = in_proj(h) (the layer plan's `qkv` holds in_proj, `o` out_proj)."""

    weight: torch.Tensor  # [hidden, kernel] depthwise taps
    bias: torch.Tensor | None
    state: torch.Tensor  # [num_slots, hidden, kernel - 1]: each request's last inputs B * x


@dataclass(frozen=True)
class DecodeLayerPlan:
    """One pre-norm decoder layer: attention (fused qkv, optional per-head q/k norms, rope,
    paged KV), or a short convolution (`short_conv`), then a gated MLP (fused gate/up,
    activation, down).

    With `pre_feedforward_norm` (Gemma) `post_attention_norm` normalises the attention output
    before the residual add, `pre_feedforward_norm` the sum, and `post_feedforward_norm` the
    MLP output; without it `post_attention_norm` normalises the sum (Llama). A layer's own
    cos/sin tables override the model's (Gemma's local rope base on sliding layers)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: NativeMatrix
    o: NativeMatrix
    gate_up: NativeMatrix
    down: NativeMatrix
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    kv_cache: torch.Tensor | None  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    sliding_window: int  # 0: full attention
    pre_feedforward_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None
    cos_cache: torch.Tensor | None = None
    sin_cache: torch.Tensor | None = None
    short_conv: ShortConvPlan | None = None  # set: a conv layer (no kv_cache, no q/k norms)


@dataclass(frozen=True)
class DecodePlan:
    """A whole Llama-family (or Gemma, or LFM2) model: embedding, layers, final norm and the
    shapes they share (every RMSNorm uses `eps`); at least one layer is attention."""

    dtype: torch.dtype
    embed: NativeMatrix
    final_norm: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    layers: tuple[DecodeLayerPlan, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    intermediate_size: int
    eps: float
    scale: float
    embed_scale: float = 1.0  # multiplies the embedding rows, rounded to `dtype` (Gemma)
    activation: str = "silu"  # or "gelu_tanh"
