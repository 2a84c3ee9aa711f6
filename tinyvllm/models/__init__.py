"""Model implementations, the architecture registry and the weight loader."""

from __future__ import annotations

from tinyvllm.models.loader import iter_safetensors_weights, load_model, resolve_model_path
from tinyvllm.models.registry import (
    ModelEntry,
    get_model_class,
    resolve_architecture,
    supported_architectures,
)

__all__ = [
    "ModelEntry",
    "get_model_class",
    "iter_safetensors_weights",
    "load_model",
    "resolve_architecture",
    "resolve_model_path",
    "supported_architectures",
]
