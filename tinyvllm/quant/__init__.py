"""Weight-only quantization (int8 / int4, GGUF blocks) for linear layers and embeddings.

A model built with a `QuantConfig` gives each linear layer a `QuantizedWeight`; the loader
streams float or GGUF tensors into it as usual, then `finalize_quantized_weights(model)`
checks that every quantized weight got all of its rows (layers pack themselves as soon as
their last shard arrives, so a streamed load never holds more than one layer's raw shards).
"""

from __future__ import annotations

from torch import nn

from tinyvllm.quant.config import QUANT_METHODS, QuantConfig
from tinyvllm.quant.weight import QuantizedWeight

__all__ = ["QUANT_METHODS", "QuantConfig", "QuantizedWeight", "finalize_quantized_weights"]


def finalize_quantized_weights(model: nn.Module) -> None:
    """Pack any quantized weight still holding raw shards; ValueError naming the module
    whose rows never all arrived."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            try:
                module.finalize()
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
