"""Gemma 3 text models (`Gemma3ForCausalLM`), on the Llama family's layers.

What differs from Llama: RMSNorms scale by (1 + w) (`OffsetRMSNorm`), each layer normalises
the attention and MLP outputs again before the residual add ("sandwich" norms), the embedding
is multiplied by sqrt(hidden_size) in the model dtype, per-head q/k norms, the attention scale
comes from `query_pre_attn_scalar`, layers alternate between sliding-window attention with a
local rope base and full attention with the global rope (and its scaling), the MLP gates with
GeLU-tanh, and the final logits may be soft-capped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tinyvllm.models.layers.activation import GeluTanhAndMul
from tinyvllm.models.layers.embedding import VocabEmbedding
from tinyvllm.models.layers.linear import MergedColumnLinear, ReplicatedLinear
from tinyvllm.models.layers.norm import OffsetRMSNorm
from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding
from tinyvllm.models.llama import (
    FamilyOptions,
    LlamaAttention,
    LlamaForCausalLM,
    layer_sliding_windows,
    native_matrix,
)
from tinyvllm.native.decode_plan import DecodeLayerPlan, DecodePlan
from tinyvllm.quant.config import QuantConfig

if TYPE_CHECKING:
    from tinyvllm.attention.backend import AttentionMetadata

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
_SLIDING = "sliding_attention"


def _activation(config: Any) -> str:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"Gemma 3 hidden_activation={act!r} is not supported; use 'gelu_pytorch_tanh'"
        )
    return act


class Gemma3MLP(nn.Module):
    def __init__(self, config: Any, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        _activation(config)
        size = config.intermediate_size
        hidden = config.hidden_size
        self.gate_up_proj = MergedColumnLinear(hidden, [size, size], False, quant_config)
        self.act = GeluTanhAndMul()
        self.down_proj = ReplicatedLinear(size, hidden, False, quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(
            config,
            layer_idx,
            FamilyOptions(qk_norm=True),
            rotary_emb,
            sliding_window,
            quant_config,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            norm_class=OffsetRMSNorm,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )
        self.mlp = Gemma3MLP(config, quant_config)
        self.input_layernorm = OffsetRMSNorm(hidden, eps)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As in Llama, each residual add is fused into the norm that follows it; the outputs
        # of attention and MLP get their own (post) norm before that add.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def native_plan(self) -> DecodeLayerPlan | None:
        """This layer for the native decode program (None: it cannot run it)."""
        attn = self.self_attn
        kv_cache = attn.attn.kv_cache
        if kv_cache is None or attn.attn.logits_soft_cap or attn.q_norm is None:
            return None
        assert attn.k_norm is not None
        matrices = [
            native_matrix(layer, None)
            for layer in (attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        ]
        if any(m is None for m in matrices):
            return None
        qkv, o, gate_up, down = matrices
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        return DecodeLayerPlan(
            input_norm=self.input_layernorm.weight,
            post_attention_norm=self.post_attention_layernorm.weight,
            qkv=qkv,
            o=o,
            gate_up=gate_up,
            down=down,
            q_norm=attn.q_norm.weight,
            k_norm=attn.k_norm.weight,
            kv_cache=kv_cache,
            sliding_window=attn.attn.sliding_window or 0,
            pre_feedforward_norm=self.pre_feedforward_layernorm.weight,
            post_feedforward_norm=self.post_feedforward_layernorm.weight,
            cos_cache=attn.rotary_emb.cos_cache,
            sin_cache=attn.rotary_emb.sin_cache,
        )


class Gemma3Model(nn.Module):
    def __init__(
        self,
        config: Any,
        max_model_len: int,
        options: FamilyOptions,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, quant_config)
        self.embed_scale = math.sqrt(hidden)
        windows = layer_sliding_windows(config, "layer_types")
        layer_types = list(config.layer_types)[: config.num_hidden_layers]
        # One table per rope flavour: sliding layers use the local base, full layers the
        # global base with its scaling.
        self.rotary_local = RotaryEmbedding(
            RopeConfig.from_hf_config(config, layer_type=_SLIDING), max_model_len
        )
        self.rotary_global = RotaryEmbedding(
            RopeConfig.from_hf_config(config, layer_type="full_attention"), max_model_len
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config,
                i,
                self.rotary_local if layer_types[i] == _SLIDING else self.rotary_global,
                windows[i],
                quant_config,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(hidden, eps=config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF rounds the scale to the model dtype before the multiply (bf16: 25.25 for 640); a
        # Python float keeps the op free of host tensors (CUDA graph capture).
        scale = float(torch.tensor(self.embed_scale, dtype=hidden.dtype))
        return hidden * scale

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder; loading, tied head and quantization as in Llama."""

    model_class: ClassVar[type[nn.Module]] = Gemma3Model

    def __init__(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None = None
    ) -> None:
        super().__init__(config, max_model_len, quant_config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def native_decode_plan(self) -> DecodePlan | None:
        inner = self.model
        layers = [layer.native_plan() for layer in inner.layers]
        embed = native_matrix(inner.embed_tokens, None)
        if embed is None or any(layer is None for layer in layers):
            return None
        eps = {norm.eps for norm in inner.modules() if isinstance(norm, OffsetRMSNorm)}
        if len(eps) != 1:
            return None
        attn = inner.layers[0].self_attn.attn
        return DecodePlan(
            dtype=inner.norm.weight.dtype,
            embed=embed,
            final_norm=inner.norm.weight,
            cos_cache=inner.rotary_global.cos_cache,
            sin_cache=inner.rotary_global.sin_cache,
            layers=tuple(layer for layer in layers if layer is not None),
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            rotary_dim=inner.rotary_global.rotary_dim,
            intermediate_size=inner.layers[0].mlp.down_proj.input_size,
            eps=eps.pop(),
            scale=attn.scale,
            embed_scale=inner.embed_scale,
            activation="gelu_tanh",
        )
