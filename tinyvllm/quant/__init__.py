"""Weight-only quantization (int8 / int4, GGUF blocks) for linear layers and embeddings.

A model built with a `QuantConfig` gives each linear layer a `QuantizedWeight`; the loader
streams float or GGUF tensors into it as usual, then `finalize_quantized_weights(model)`
checks that every quantized weight got all of its rows (layers pack themselves as soon as
their last shard arrives, so a streamed load never holds more than one layer's raw shards).

Importing the package (and parsing `quantization=` with `tinyvllm.quant.config`) does not
import torch; the weight classes load on first use.
"""

from __future__ import annotations

from typing import Any

from tinyvllm.quant.config import QUANT_METHODS, QuantConfig

__all__ = ["QUANT_METHODS", "QuantConfig", "QuantizedWeight", "finalize_quantized_weights"]

_LAZY = frozenset({"QuantizedWeight", "finalize_quantized_weights"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from tinyvllm.quant import weight

        return getattr(weight, name)
    raise AttributeError(f"module 'tinyvllm.quant' has no attribute {name!r}")
