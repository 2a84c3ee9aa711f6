"""Token embedding table, also usable as a (tied) output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import ReplicatedLinear, new_parameter
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.weight import QuantizedWeight


class VocabEmbedding(nn.Module):
    """Looks up rows of a [vocab_size, hidden_size] table.

    With a `QuantConfig` the table is stored int8 per row (`qweight`), which a tied lm_head
    shares; lookups dequantize only the rows they gather.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, quant_config: QuantConfig | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.qweight: QuantizedWeight | None = None
        config = None if quant_config is None else quant_config.output_config()
        if config is None:
            self.weight = new_parameter(vocab_size, hidden_size)
        else:
            self.qweight = QuantizedWeight(hidden_size, vocab_size, config)
            self.weight = new_parameter(0, loader=self._load_quantized)

    def _load_quantized(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unfused parameter got a shard id {shard_id!r}")
        assert self.qweight is not None
        self.qweight.load_rows(loaded, 0, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.embedding(input_ids)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"


def output_head(
    embedding: VocabEmbedding, tie_word_embeddings: bool, quant_config: QuantConfig | None = None
) -> ReplicatedLinear:
    """The lm_head projecting hidden states onto the vocabulary; tied, it shares the embedding's
    table (named_parameters lists it once, as the embedding), quantized table included."""
    head_quant = None if quant_config is None else quant_config.output_config()
    head = ReplicatedLinear(
        embedding.hidden_size, embedding.vocab_size, bias=False, quant_config=head_quant
    )
    if tie_word_embeddings:
        head.weight = embedding.weight
        if embedding.qweight is not None:
            head.qweight = embedding.qweight
    return head
