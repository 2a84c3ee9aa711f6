"""Token embedding table, also usable as a (tied) output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import new_parameter


class VocabEmbedding(nn.Module):
    """Looks up rows of a [vocab_size, hidden_size] table."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = new_parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"
