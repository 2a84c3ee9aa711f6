"""NemotronH (`NemotronHForCausalLM`, dense variants): a stack of single-mixer blocks, each
RMSNorm -> one of Mamba2 / attention / MLP -> residual add, per `layers_block_type` (HF's
`hybrid_override_pattern` "M" / "*" / "-"). Attention has no positional embedding; the MLP is
up -> squared ReLU -> down. The Mamba2 mixer is the shared one (layers/mamba2.py).

Checkpoints name the trunk `backbone.` (HF: `model.`); both are accepted. The MoE blocks of
Nemotron 3 ("E") are not supported yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tinyvllm.attention.layer import Attention
from tinyvllm.models.layers.embedding import VocabEmbedding, output_head
from tinyvllm.models.layers.linear import QKVLinear, ReplicatedLinear
from tinyvllm.models.layers.mamba2 import Mamba2Config, Mamba2Mixer
from tinyvllm.models.layers.norm import RMSNorm
from tinyvllm.models.layers.recurrent import RecurrentLayer
from tinyvllm.models.weights import load_named_weights
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.weight import finalize_quantized_weights

if TYPE_CHECKING:
    from tinyvllm.attention.backend import AttentionMetadata
    from tinyvllm.gguf.weight import GGUFWeight

# HF's block names (transformers >= 5 renames the legacy ones on load) -> ours.
_BLOCK_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
}


def nemotron_h_block_kinds(config: Any) -> list[str]:
    """ "mamba", "attention" or "mlp" per block; ValueError naming the block otherwise."""
    kinds = list(getattr(config, "layers_block_type", None) or [])
    if len(kinds) != config.num_hidden_layers:
        raise ValueError(
            f"NemotronH config: layers_block_type has {len(kinds)} entries but "
            f"num_hidden_layers is {config.num_hidden_layers}; give one type per layer"
        )
    for i, kind in enumerate(kinds):
        if kind == "moe":
            raise ValueError(
                f"NemotronH config: layers_block_type[{i}] is 'moe' (Nemotron 3 MoE blocks), "
                "which tinyvllm does not support yet"
            )
        if kind not in _BLOCK_KINDS:
            raise ValueError(
                f"NemotronH config: layers_block_type[{i}] is {kind!r}; use one of "
                f"{sorted(_BLOCK_KINDS)}"
            )
    return [_BLOCK_KINDS[kind] for kind in kinds]


def nemotron_h_mamba2_config(config: Any) -> Mamba2Config:
    for name, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        value = getattr(config, name, want)
        if value != want:
            raise ValueError(f"NemotronH config: {name}={value!r} is not supported; use {want!r}")
    return Mamba2Config(
        hidden_size=config.hidden_size,
        num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        n_groups=config.n_groups,
        state_size=config.ssm_state_size,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        rms_norm_eps=config.layer_norm_epsilon,
        conv_bias=bool(config.use_conv_bias),
        proj_bias=bool(config.use_bias),
        # As HF's mixer: time_step_min is the lower dt limit, no upper one.
        time_step_limit=(float(config.time_step_min), float("inf")),
    )


class NemotronHAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, quant_config: QuantConfig | None) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv_proj = QKVLinear(
            config.hidden_size, head_dim, heads, kv_heads, False, quant_config
        )
        self.o_proj = ReplicatedLinear(heads * head_dim, config.hidden_size, False, quant_config)
        self.attn = Attention(layer_idx, heads, kv_heads, head_dim, scale=head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.o_proj(self.attn(q, k, v, metadata))


class NemotronHMLP(nn.Module):
    def __init__(self, config: Any, quant_config: QuantConfig | None) -> None:
        super().__init__()
        bias, size = bool(config.mlp_bias), config.intermediate_size
        self.up_proj = ReplicatedLinear(config.hidden_size, size, bias, quant_config)
        self.down_proj = ReplicatedLinear(size, config.hidden_size, bias, quant_config)

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, kind: str, quant_config: QuantConfig | None
    ) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer: nn.Module
        if kind == "mamba":
            self.mixer = Mamba2Mixer(nemotron_h_mamba2_config(config), quant_config)
        elif kind == "attention":
            self.mixer = NemotronHAttention(config, layer_idx, quant_config)
        else:
            self.mixer = NemotronHMLP(config, quant_config)

    def forward(self, residual: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return residual + self.mixer(self.norm(residual), metadata)


class NemotronHModel(nn.Module):
    def __init__(self, config: Any, quant_config: QuantConfig | None) -> None:
        super().__init__()
        kinds = nemotron_h_block_kinds(config)
        self.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, quant_config)
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i, kind, quant_config) for i, kind in enumerate(kinds)
        )
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, metadata)
        return self.norm_f(hidden)


class NemotronHForCausalLM(nn.Module):
    """Mixer blocks keep per-request state (`recurrent_layers`), attention blocks paged KV."""

    # What the checkpoint calls the embedding (checked against the config before building).
    embedding_tensor: ClassVar[str] = "backbone.embeddings.weight"
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
    )

    def __init__(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.model = NemotronHModel(config, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = output_head(self.model.embeddings, self.tie_word_embeddings, quant_config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, metadata)  # no positional embedding anywhere

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _mixers(self, kind: str) -> list[Any]:
        return [layer.mixer for layer in self.model.layers if layer.kind == kind]

    def attention_layers(self) -> list[Attention]:
        return [mixer.attn for mixer in self._mixers("attention")]

    def recurrent_layers(self) -> list[RecurrentLayer]:
        return self._mixers("mamba")

    @staticmethod
    def checkpoint_shapes(config: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """The first mamba block's projections (the config's sizes, checked before building)."""
        kinds = nemotron_h_block_kinds(config)
        if "mamba" not in kinds:
            return {}
        c = nemotron_h_mamba2_config(config)
        name = f"backbone.layers.{kinds.index('mamba')}.mixer"
        rows = c.intermediate_size + c.conv_dim + c.num_heads
        fields = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size")
        return {
            f"{name}.in_proj.weight": ((rows, c.hidden_size), (*fields, "hidden_size")),
            f"{name}.conv1d.weight": ((c.conv_dim, 1, c.conv_kernel), ("conv_kernel",)),
        }

    def _renamed(
        self, weights: Iterable[tuple[str, torch.Tensor | GGUFWeight]]
    ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        for name, tensor in weights:
            if name.startswith("backbone."):
                name = "model." + name.removeprefix("backbone.")
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFWeight]]) -> None:
        load_named_weights(
            self,
            self._renamed(weights),  # type: ignore[arg-type]
            stacked_params=self.stacked_params,
        )
        finalize_quantized_weights(self)
