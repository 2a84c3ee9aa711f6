"""Building blocks shared by the model files."""

from __future__ import annotations

from tinyvllm.models.layers.activation import SiluAndMul
from tinyvllm.models.layers.embedding import VocabEmbedding
from tinyvllm.models.layers.linear import (
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    ReplicatedLinear,
    default_weight_loader,
)
from tinyvllm.models.layers.norm import RMSNorm
from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding, compute_inv_freq

__all__ = [
    "LinearBase",
    "MergedColumnLinear",
    "QKVLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RopeConfig",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "compute_inv_freq",
    "default_weight_loader",
]
