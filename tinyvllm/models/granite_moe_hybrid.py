"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 mixer layers and attention layers
per `layer_types`, each followed by a shared SiLU-gated MLP plus, in the MoE variants, top-k
routed experts.

Granite's scalars: embeddings are multiplied by `embedding_multiplier`, every block's output
by `residual_multiplier` before the residual add, attention scores use `attention_multiplier`
as their scale, and logits are divided by `logits_scaling`. Attention layers use rope only when
`position_embedding_type == "rope"` (otherwise no positions: the mamba layers order tokens).
Parameter names follow HF checkpoints except the fused q/k/v projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tinyvllm.attention.layer import Attention
from tinyvllm.models.layers.activation import SiluAndMul
from tinyvllm.models.layers.embedding import VocabEmbedding
from tinyvllm.models.layers.gated_mlp import gated_mlp
from tinyvllm.models.layers.linear import QKVLinear, ReplicatedLinear
from tinyvllm.models.layers.mamba2 import Mamba2Mixer, mamba2_config_from_hf
from tinyvllm.models.layers.moe import StackedExperts, TopKRouter
from tinyvllm.models.layers.norm import RMSNorm
from tinyvllm.models.layers.recurrent import RecurrentLayer
from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding
from tinyvllm.models.llama import LlamaForCausalLM
from tinyvllm.quant.config import QuantConfig

if TYPE_CHECKING:
    from tinyvllm.attention.backend import AttentionMetadata

# HF's names for the two layer kinds (transformers >= 5 renames the checkpoints' legacy
# "mamba" / "attention" on load; both spellings are accepted).
_LAYER_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
}


def granite_layer_kinds(config: Any) -> list[str]:
    """ "mamba" or "attention" per layer, from `config.layer_types`; ValueError naming the
    layer and the value for anything else or a list of the wrong length."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    num_layers = config.num_hidden_layers
    if len(layer_types) != num_layers:
        raise ValueError(
            f"GraniteMoeHybrid config: layer_types has {len(layer_types)} entries but "
            f"num_hidden_layers is {num_layers}; give one type per layer"
        )
    kinds = []
    for i, layer_type in enumerate(layer_types):
        if layer_type not in _LAYER_KINDS:
            raise ValueError(
                f"GraniteMoeHybrid config: layer_types[{i}] is {layer_type!r}, which is not a "
                f"supported hybrid layer type; use one of {sorted(_LAYER_KINDS)}"
            )
        kinds.append(_LAYER_KINDS[layer_type])
    return kinds


def _uses_rope(config: Any) -> bool:
    kind = getattr(config, "position_embedding_type", None)
    if kind not in (None, "nope", "rope"):
        raise ValueError(
            f"GraniteMoeHybrid config: position_embedding_type={kind!r} is not supported; "
            "use 'rope' or leave it unset (no positional embedding)"
        )
    return kind == "rope"


class GraniteAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding | None,
        quant_config: QuantConfig | None,
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(
            config.hidden_size, head_dim, num_heads, num_kv_heads, bias, quant_config
        )
        self.o_proj = ReplicatedLinear(num_heads * head_dim, config.hidden_size, bias, quant_config)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            layer_idx, num_heads, num_kv_heads, head_dim, scale=config.attention_multiplier
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, metadata))


class GraniteSharedMLP(nn.Module):
    """The dense MLP every layer has: input_linear gives [gate | up] in one tensor."""

    def __init__(self, config: Any, quant_config: QuantConfig | None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; use 'silu'")
        size = config.shared_intermediate_size
        self.input_linear = ReplicatedLinear(config.hidden_size, 2 * size, False, quant_config)
        self.act = SiluAndMul()
        self.output_linear = ReplicatedLinear(size, config.hidden_size, False, quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.input_linear, self.act, self.output_linear, x)


class GraniteMoE(StackedExperts):
    """Routed experts; the checkpoint keeps the stacked expert weights directly on the block
    (`block_sparse_moe.input_linear`) and the router as `block_sparse_moe.router.layer`.
    Expert weights stay in floating point under quantization (weight-only quantization covers
    the dense linear layers)."""

    def __init__(self, config: Any) -> None:
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        super().__init__(config.hidden_size, config.intermediate_size, experts)
        self.router = nn.Module()
        self.router.layer = TopKRouter(config.hidden_size, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        weights, ids = self.router.layer(x)
        return super().forward(x, weights, ids)


class GraniteHybridLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        kind: str,
        rotary_emb: RotaryEmbedding | None,
        quant_config: QuantConfig | None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.residual_multiplier = float(config.residual_multiplier)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: GraniteAttention | None = None
        if kind == "mamba":
            self.mamba = Mamba2Mixer(mamba2_config_from_hf(config), quant_config)
        else:
            self.self_attn = GraniteAttention(config, layer_idx, rotary_emb, quant_config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.shared_mlp = GraniteSharedMLP(config, quant_config)
        self.block_sparse_moe = GraniteMoE(config) if config.num_local_experts > 0 else None

    def forward(
        self, positions: torch.Tensor, residual: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`residual` is the stream entering the layer; returns the stream leaving it."""
        x = self.input_layernorm(residual)
        if self.mamba is not None:
            x = self.mamba(x, metadata)
        else:
            assert self.self_attn is not None
            x = self.self_attn(positions, x, metadata)
        # The fused norm adds its first argument to the stream: residual + block * multiplier.
        x, residual = self.post_attention_layernorm(x * self.residual_multiplier, residual)
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        return residual + out * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config: Any, max_model_len: int, quant_config: QuantConfig | None) -> None:
        super().__init__()
        kinds = granite_layer_kinds(config)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, quant_config)
        self.rotary_emb = (
            RotaryEmbedding(RopeConfig.from_hf_config(config), max_model_len)
            if _uses_rope(config)
            else None
        )
        self.layers = nn.ModuleList(
            GraniteHybridLayer(config, i, kind, self.rotary_emb, quant_config)
            for i, kind in enumerate(kinds)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        residual = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            residual = layer(positions, residual, metadata)
        return self.norm(residual)


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    """The Llama family's head, loading and weight checks around the Granite hybrid stack;
    logits are divided by `logits_scaling`. Mixer layers keep per-request state
    (`recurrent_layers`), attention layers paged KV (`attention_layers`)."""

    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
    )

    def __init__(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None = None
    ) -> None:
        super().__init__(config, max_model_len, quant_config)
        self.logits_scaling = float(config.logits_scaling)

    def build_language_model(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None
    ) -> nn.Module:
        return GraniteMoeHybridModel(config, max_model_len, quant_config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float() / self.logits_scaling

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn is not None]

    def recurrent_layers(self) -> list[RecurrentLayer]:
        return [layer.mamba for layer in self.model.layers if layer.mamba is not None]

    def native_decode_plan(self) -> None:
        """The native decode program runs Llama layers only."""
        return None

    @classmethod
    def checkpoint_shapes(cls, config: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """Tensor shapes the config implies for the first mamba and attention layers and the
        experts (checked against the checkpoint before anything is allocated)."""
        kinds = granite_layer_kinds(config)
        hidden, heads = config.hidden_size, config.num_attention_heads
        shapes: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
        if "mamba" in kinds:
            c = mamba2_config_from_hf(config)
            name = f"model.layers.{kinds.index('mamba')}.mamba"
            rows = c.intermediate_size + c.conv_dim + c.num_heads
            fields = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state")
            shapes[f"{name}.in_proj.weight"] = ((rows, hidden), (*fields, "hidden_size"))
            shapes[f"{name}.conv1d.weight"] = ((c.conv_dim, 1, c.conv_kernel), ("mamba_d_conv",))
            shapes[f"{name}.A_log"] = ((c.num_heads,), ("mamba_n_heads",))
        if "attention" in kinds:
            head_dim = getattr(config, "head_dim", None) or hidden // heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            name = f"model.layers.{kinds.index('attention')}.self_attn"
            shapes[f"{name}.q_proj.weight"] = ((heads * head_dim, hidden), ("num_attention_heads",))
            shapes[f"{name}.k_proj.weight"] = (
                (kv_heads * head_dim, hidden),
                ("num_key_value_heads",),
            )
        size = config.shared_intermediate_size
        shapes["model.layers.0.shared_mlp.input_linear.weight"] = (
            (2 * size, hidden),
            ("shared_intermediate_size", "hidden_size"),
        )
        if config.num_local_experts > 0:
            experts, inter = config.num_local_experts, config.intermediate_size
            shapes["model.layers.0.block_sparse_moe.input_linear.weight"] = (
                (experts, 2 * inter, hidden),
                ("num_local_experts", "intermediate_size", "hidden_size"),
            )
        return shapes
