"""BERT encoders (BertModel checkpoints such as all-MiniLM-L6-v2) for pooling.

Absolute position + token-type embeddings, post-LayerNorm residual blocks, GELU MLP,
bidirectional attention. Like the decoder models it takes the flattened tokens of every
request (no padding) with positions and `AttentionMetadata`; the pooling runner binds an
attention backend that sees only each request's own tokens, so there is no KV cache.
Parameter names follow HF checkpoints except that query/key/value are fused (`qkv_proj`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.attention.layer import Attention
from tinyvllm.models.checkpoint_check import (
    TensorDirectory,
    check_config_values,
    check_layer_count,
    check_shape,
)
from tinyvllm.models.layers.embedding import VocabEmbedding
from tinyvllm.models.layers.linear import QKVLinear, ReplicatedLinear
from tinyvllm.models.weights import load_named_weights

if TYPE_CHECKING:
    from tinyvllm.attention.backend import AttentionMetadata
    from tinyvllm.quant.config import QuantConfig

# HF activation name -> (function, its approximate= argument).
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# Checkpoints saved from BertFor* heads carry the encoder under this prefix.
_PREFIX = "bert."


def _check_supported(config: Any) -> None:
    act = getattr(config, "hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"BertModel with hidden_act={act!r} is not supported; supported: "
            f"{', '.join(_ACTIVATIONS)}"
        )
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(
            f"BertModel with position_embedding_type={kind!r} is not supported; only 'absolute' is"
        )


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden)
        self.position_embeddings = VocabEmbedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = VocabEmbedding(getattr(config, "type_vocab_size", 2), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Every prompt is one segment: token type 0 throughout, as sentence-transformers feeds.
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])


class BertAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        self.qkv_proj = QKVLinear(hidden, head_dim, heads, heads, bias=True)
        self.attn = Attention(layer_idx, heads, heads, head_dim, scale=head_dim**-0.5)
        self.output = BertOutput(hidden, hidden, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.output(self.attn(q, k, v, metadata), hidden)


class BertOutput(nn.Module):
    """dense -> LayerNorm(x + residual): the post-norm end of both sub-blocks."""

    def __init__(self, input_size: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(input_size, hidden, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.approximate = _ACTIVATIONS[getattr(config, "hidden_act", "gelu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.attention = BertAttention(config, layer_idx)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(
            config.intermediate_size, config.hidden_size, config.layer_norm_eps
        )

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, metadata)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i) for i in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """Encoder-only: `forward` returns every token's last hidden state [T, hidden]."""

    is_encoder_only: ClassVar[bool] = True
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        (".attention.self.query.", ".attention.qkv_proj.", "q"),
        (".attention.self.key.", ".attention.qkv_proj.", "k"),
        (".attention.self.value.", ".attention.qkv_proj.", "v"),
    )

    def __init__(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None = None
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError(
                f"quantization={quant_config.method!r} is not supported for BertModel; "
                "pass quantization=None"
            )
        _check_supported(config)
        self.config = config
        self.max_model_len = max_model_len
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, metadata)
        return hidden

    def attention_layers(self) -> list[Attention]:
        return [layer.attention.attn for layer in self.encoder.layer]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(
            self,
            _encoder_weights(weights),
            stacked_params=self.stacked_params,
            ignore=lambda name: name == "embeddings.position_ids" or name.startswith("pooler."),
        )

    @staticmethod
    def check_checkpoint(config: Any, directory: TensorDirectory) -> None:
        """The config's sizes agree with the checkpoint's tensors (see checkpoint_check)."""
        check_config_values(config, directory.origin, directory.describe)
        check_layer_count(config.num_hidden_layers, directory)
        prefix = (
            _PREFIX if f"{_PREFIX}embeddings.word_embeddings.weight" in directory.shapes else ""
        )
        hidden, inter = config.hidden_size, config.intermediate_size
        if hidden % config.num_attention_heads:
            raise ValueError(
                f"{directory.origin}: hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={config.num_attention_heads}"
            )
        expected = {
            "embeddings.word_embeddings.weight": ((config.vocab_size, hidden), "vocab_size"),
            "embeddings.position_embeddings.weight": (
                (config.max_position_embeddings, hidden),
                "max_position_embeddings",
            ),
            "encoder.layer.0.attention.self.query.weight": ((hidden, hidden), "hidden_size"),
            "encoder.layer.0.intermediate.dense.weight": ((inter, hidden), "intermediate_size"),
        }
        for name, (shape, field) in expected.items():
            check_shape(directory, prefix + name, shape, (field, "hidden_size"))


def _encoder_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under BertModel's names: a BertFor* head's prefix dropped, its head
    tensors (cls.*) skipped."""
    for name, tensor in weights:
        if name.startswith("cls."):
            continue
        yield name.removeprefix(_PREFIX), tensor
