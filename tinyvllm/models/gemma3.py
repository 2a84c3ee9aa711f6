"""Gemma 3 text models (`Gemma3ForCausalLM`), on the Llama family's layers.

What differs from Llama: RMSNorms scale by (1 + w) (`OffsetRMSNorm`), each layer normalises
the attention and MLP outputs again before the residual add ("sandwich" norms), the embedding
is multiplied by sqrt(hidden_size) in the model dtype, per-head q/k norms, the attention scale
comes from `query_pre_attn_scalar`, layers alternate between sliding-window attention with a
local rope base and full attention with the global rope (and its scaling), the MLP gates with
GeLU-tanh, and the final logits may be soft-capped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tinyvllm.models.layers.activation import GeluTanhAndMul
from tinyvllm.models.layers.embedding import VocabEmbedding
from tinyvllm.models.layers.gated_mlp import gated_mlp
from tinyvllm.models.layers.linear import MergedColumnLinear, ReplicatedLinear
from tinyvllm.models.layers.norm import OffsetRMSNorm
from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding
from tinyvllm.models.llama import (
    FamilyOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    layer_sliding_windows,
)
from tinyvllm.native.decode_plan import DecodeLayerPlan
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
        return gated_mlp(self.gate_up_proj, self.act, self.down_proj, x)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (attribute names, native plan) with Gemma's four norms."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        nn.Module.__init__(self)  # Llama's constructor would build Llama's norms and MLP
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
        # Attention and MLP outputs get their own (post) norm before the residual add, which
        # is fused into the norm after it, as in Llama.
        hidden, residual = self.input_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def native_plan(self) -> DecodeLayerPlan | None:
        plan = super().native_plan()
        if plan is None:
            return None
        rope = self.self_attn.rotary_emb
        return dataclasses.replace(
            plan,
            pre_feedforward_norm=self.pre_feedforward_layernorm.weight,
            post_feedforward_norm=self.post_feedforward_layernorm.weight,
            cos_cache=rope.cos_cache,
            sin_cache=rope.sin_cache,
        )


class Gemma3Model(LlamaModel):
    """Llama's stack (forward, final norm) with the scaled embedding and two rope tables:
    `rotary_emb` global (full-attention layers), `rotary_local` for the sliding ones."""

    def __init__(
        self,
        config: Any,
        max_model_len: int,
        options: FamilyOptions,
        quant_config: QuantConfig | None = None,
    ) -> None:
        nn.Module.__init__(self)  # Llama's constructor would build Llama's layers
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma 3 with use_bidirectional_attention=True (an embedding model) is not "
                "supported: Gemma3ForCausalLM generates with causal attention"
            )
        hidden = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, quant_config)
        self.embed_scale = math.sqrt(hidden)
        windows = layer_sliding_windows(config, "layer_types")
        layer_types = list(config.layer_types)[: config.num_hidden_layers]
        self.rotary_emb = RotaryEmbedding(
            RopeConfig.from_hf_config(config, layer_type="full_attention"), max_model_len
        )
        self.rotary_local = RotaryEmbedding(
            RopeConfig.from_hf_config(config, layer_type=_SLIDING), max_model_len
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config,
                i,
                self.rotary_local if layer_types[i] == _SLIDING else self.rotary_emb,
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


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder; loading, tied head, quantization and the native decode plan as
    in Llama."""

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
