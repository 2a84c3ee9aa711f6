"""LFM2 (Liquid AI): gated short convolutions interleaved with GQA attention layers.

`config.layer_types` says per layer "conv" (a `ShortConv` mixer with recurrent state: the
last `conv_L_cache - 1` inputs of its depthwise convolution) or "full_attention" (paged KV,
rope, per-head RMSNorm on q and k). Every layer is pre-norm (`operator_norm`) with a SwiGLU
feed-forward (`w1`, `w3`, `w2`) behind `ffn_norm`; the final norm is called `embedding_norm`
in the checkpoint. Parameter names follow HF except the fused q/k/v and w1/w3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tinyvllm.attention.layer import Attention
from tinyvllm.models.layers.activation import SiluAndMul
from tinyvllm.models.layers.embedding import VocabEmbedding
from tinyvllm.models.layers.gated_mlp import gated_mlp
from tinyvllm.models.layers.linear import (
    MergedColumnLinear,
    QKVLinear,
    ReplicatedLinear,
    new_parameter,
)
from tinyvllm.models.layers.norm import RMSNorm
from tinyvllm.models.layers.recurrent import RecurrentLayer, StateShape
from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding
from tinyvllm.models.llama import LlamaForCausalLM, _native_matrix
from tinyvllm.native.decode_plan import DecodeLayerPlan, DecodePlan, ShortConvPlan
from tinyvllm.quant.config import QuantConfig

if TYPE_CHECKING:
    from tinyvllm.attention.backend import AttentionMetadata

LAYER_TYPES = ("conv", "full_attention")


def lfm2_layer_types(config: Any) -> list[str]:
    """Per-layer "conv" / "full_attention", checked: ValueError naming the bad entry."""
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    attn_idxs = getattr(config, "full_attn_idxs", None)
    if layer_types is None:
        if attn_idxs is None:
            raise ValueError("the LFM2 config has neither 'layer_types' nor 'full_attn_idxs'")
        layer_types = ["full_attention" if i in attn_idxs else "conv" for i in range(num_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(
            f"the LFM2 config's layer_types has {len(layer_types)} entries but "
            f"num_hidden_layers is {num_layers}; give one type per layer"
        )
    for i, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise ValueError(
                f"the LFM2 config's layer_types[{i}] is {kind!r}, a hybrid layer type tinyvllm "
                f"does not support; supported: {', '.join(LAYER_TYPES)}"
            )
    if attn_idxs is not None:
        declared = sorted(int(i) for i in attn_idxs)
        actual = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        if declared != actual:
            raise ValueError(
                f"the LFM2 config is inconsistent: full_attn_idxs={declared} but layer_types "
                f"puts attention at {actual}; fix one of them"
            )
    if "full_attention" not in layer_types:
        raise ValueError(
            "the LFM2 config has no full_attention layer; tinyvllm sizes its cache in KV "
            "blocks and needs at least one"
        )
    return layer_types


def lfm2_intermediate_size(config: Any) -> int:
    """The feed-forward width, adjusted as HF does when `block_auto_adjust_ff_dim` is set."""
    size = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            size = int(multiplier * size)
            multiple = config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class _ConvWeight(nn.Module):
    """Holds the depthwise kernel under the checkpoint's name (`conv.conv.weight`)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = new_parameter(channels, 1, kernel)
        self.bias = new_parameter(channels) if bias else None


class ShortConv(RecurrentLayer):
    """y = out_proj(C * conv(B * x)) with B, C, x = in_proj(h): a causal depthwise conv of
    kernel L whose state is the last L - 1 inputs `B * x` (per channel)."""

    def __init__(self, config: Any, dtype: torch.dtype, quant_config: QuantConfig | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "conv_bias", False))
        self.hidden_size = hidden
        self.kernel = int(config.conv_L_cache)
        if self.kernel < 2:
            raise ValueError(f"LFM2 conv_L_cache must be at least 2, got {self.kernel}")
        self.state_dtype = dtype
        self.in_proj = ReplicatedLinear(hidden, 3 * hidden, bias, quant_config)
        self.out_proj = ReplicatedLinear(hidden, hidden, bias, quant_config)
        self.conv = _ConvWeight(hidden, self.kernel, bias)

    def state_shapes(self) -> list[StateShape]:
        return [StateShape((self.hidden_size, self.kernel - 1), self.state_dtype)]

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        bx = b * x
        out = torch.empty_like(bx)
        recurrent = metadata.recurrent
        if recurrent is None:
            raise RuntimeError("ShortConv ran without recurrent-state metadata")
        state = self.states[0]
        weight = self.conv.weight[:, 0, :]  # [H, L]
        bias = self.conv.bias
        qsl = metadata.query_start_loc_cpu
        if recurrent.decode_indices_cpu:
            # One token per request: window = [state | new input], one dot product per channel.
            tokens = metadata.query_start_loc[recurrent.decode_indices]
            slots = recurrent.state_indices[recurrent.decode_indices]
            window = torch.cat([state[slots], bx[tokens].unsqueeze(-1)], dim=-1)  # [D, H, L]
            out[tokens] = self._taps(window.transpose(1, 2), weight, bias)[:, -1]
            state[slots] = window[:, :, 1:]
        for i in recurrent.prefill_indices_cpu:
            start, end = qsl[i], qsl[i + 1]
            slot = recurrent.state_indices_cpu[i]
            init = state[slot] if recurrent.has_initial_state_cpu[i] else state[slot].zero_()
            seq = torch.cat([init.t(), bx[start:end]])  # [L - 1 + n, H]
            out[start:end] = self._taps(seq.unsqueeze(0), weight, bias)[0]
            state[slot] = seq[seq.shape[0] - (self.kernel - 1) :].t()
        return self.out_proj(c * out)

    def _taps(
        self, seq: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The causal depthwise conv over `seq` [B, L - 1 + n, H] -> [B, n, H]: L shifted
        multiply-adds in fp32, rounded once (a bf16 conv1d runs a slow generic kernel on CPUs
        without bf16 units, and the kernel is only L taps long)."""
        n = seq.shape[1] - (self.kernel - 1)
        acc = seq[:, :n].float() * weight[:, 0].float()
        for k in range(1, self.kernel):
            acc += seq[:, k : k + n].float() * weight[:, k].float()
        if bias is not None:
            acc += bias.float()
        return acc.to(seq.dtype)


class Lfm2Attention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantConfig | None,
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.head_dim = head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, head_dim, num_heads, num_kv_heads, False, quant_config
        )
        self.out_proj = ReplicatedLinear(
            num_heads * head_dim, config.hidden_size, False, quant_config
        )
        self.q_layernorm = RMSNorm(head_dim, eps=config.norm_eps)
        self.k_layernorm = RMSNorm(head_dim, eps=config.norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(layer_idx, num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        # Each head is normalised on its own, before rope.
        q = self.q_layernorm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        k = self.k_layernorm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.out_proj(self.attn(q, k, v, metadata))


class Lfm2MLP(nn.Module):
    def __init__(self, config: Any, quant_config: QuantConfig | None) -> None:
        super().__init__()
        size = lfm2_intermediate_size(config)
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size, [size, size], False, quant_config
        )
        self.act = SiluAndMul()
        self.w2 = ReplicatedLinear(size, config.hidden_size, False, quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.gate_up_proj, self.act, self.w2, x)


class Lfm2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        kind: str,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        quant_config: QuantConfig | None,
    ) -> None:
        super().__init__()
        self.operator_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attn: Lfm2Attention | None = None
        self.conv: ShortConv | None = None
        if kind == "full_attention":
            self.self_attn = Lfm2Attention(config, layer_idx, rotary_emb, quant_config)
        else:
            self.conv = ShortConv(config, dtype, quant_config)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.feed_forward = Lfm2MLP(config, quant_config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.operator_norm(hidden)
        else:
            hidden, residual = self.operator_norm(hidden, residual)
        if self.self_attn is not None:
            hidden = self.self_attn(positions, hidden, metadata)
        else:
            assert self.conv is not None
            hidden = self.conv(hidden, metadata)
        hidden, residual = self.ffn_norm(hidden, residual)
        return self.feed_forward(hidden), residual

    def native_plan(self) -> DecodeLayerPlan | None:
        """This layer for the native decode program (None: it cannot run it); call after the
        KV caches and recurrent states are bound."""
        mlp = self.feed_forward
        gate_up = _native_matrix(mlp.gate_up_proj, mlp.gate_up_proj.bias)
        down = _native_matrix(mlp.w2, mlp.w2.bias)
        q_norm = k_norm = kv_cache = short_conv = None
        if self.self_attn is not None:
            attn = self.self_attn
            mixer_in, mixer_out = attn.qkv_proj, attn.out_proj
            q_norm, k_norm = attn.q_layernorm.weight, attn.k_layernorm.weight
            kv_cache = attn.attn.kv_cache
            if kv_cache is None:
                return None
        else:
            conv = self.conv
            assert conv is not None
            if not conv.states:
                return None
            mixer_in, mixer_out = conv.in_proj, conv.out_proj
            short_conv = ShortConvPlan(conv.conv.weight[:, 0, :], conv.conv.bias, conv.states[0])
        qkv = _native_matrix(mixer_in, mixer_in.bias)
        o = _native_matrix(mixer_out, mixer_out.bias)
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        return DecodeLayerPlan(
            input_norm=self.operator_norm.weight,
            post_attention_norm=self.ffn_norm.weight,
            qkv=qkv,
            o=o,
            gate_up=gate_up,
            down=down,
            q_norm=q_norm,
            k_norm=k_norm,
            kv_cache=kv_cache,
            sliding_window=0,
            short_conv=short_conv,
        )


class Lfm2Model(nn.Module):
    def __init__(self, config: Any, max_model_len: int, quant_config: QuantConfig | None) -> None:
        super().__init__()
        layer_types = lfm2_layer_types(config)
        dtype = torch.get_default_dtype()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, quant_config)
        self.rotary_emb = RotaryEmbedding(RopeConfig.from_hf_config(config), max_model_len)
        self.layers = nn.ModuleList(
            Lfm2DecoderLayer(config, i, kind, self.rotary_emb, dtype, quant_config)
            for i, kind in enumerate(layer_types)
        )
        self.embedding_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        assert residual is not None
        return self.embedding_norm(hidden, residual)[0]


class Lfm2ForCausalLM(LlamaForCausalLM):
    """The Llama family's head, loading and weight checks around the LFM2 decoder stack."""

    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".w1.", ".gate_up_proj.", 0),
        (".w3.", ".gate_up_proj.", 1),
    )

    def build_language_model(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None
    ) -> nn.Module:
        return Lfm2Model(config, max_model_len, quant_config)

    def attention_layers(self) -> list[Attention]:
        return [m.self_attn.attn for m in self.model.layers if m.self_attn is not None]

    def recurrent_layers(self) -> list[RecurrentLayer]:
        return [m.conv for m in self.model.layers if m.conv is not None]

    def native_decode_plan(self) -> DecodePlan | None:
        """Every tensor the native decode program reads (attention and short-conv layers);
        None when it cannot run this model. Call after the KV caches and states are bound."""
        inner = self.model
        layers = [layer.native_plan() for layer in inner.layers]
        embed = _native_matrix(inner.embed_tokens, None)
        if embed is None or any(layer is None for layer in layers):
            return None
        attn_layer = next(m.self_attn for m in inner.layers if m.self_attn is not None)
        attn, rope = attn_layer.attn, inner.rotary_emb
        return DecodePlan(
            dtype=inner.embedding_norm.weight.dtype,
            embed=embed,
            final_norm=inner.embedding_norm.weight,
            cos_cache=rope.cos_cache,
            sin_cache=rope.sin_cache,
            layers=tuple(layer for layer in layers if layer is not None),
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            rotary_dim=rope.rotary_dim,
            intermediate_size=inner.layers[0].feed_forward.w2.input_size,
            eps=inner.embedding_norm.eps,  # every LFM2 norm uses config.norm_eps
            scale=attn.scale,
            activation=inner.layers[0].feed_forward.act.name,
        )

    @staticmethod
    def checkpoint_shapes(config: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """Tensors whose shapes the config fixes, checked before the model is built."""
        hidden = config.hidden_size
        inter = lfm2_intermediate_size(config)
        layer_types = lfm2_layer_types(config)
        conv = layer_types.index("conv") if "conv" in layer_types else None
        shapes = {
            "model.layers.0.feed_forward.w1.weight": (
                (inter, hidden), ("intermediate_size", "hidden_size")
            ),
        }  # fmt: skip
        if conv is not None:
            shapes[f"model.layers.{conv}.conv.conv.weight"] = (
                (hidden, 1, config.conv_L_cache), ("hidden_size", "conv_L_cache")
            )  # fmt: skip
        return shapes
