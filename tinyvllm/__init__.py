"""tinyvllm: a compact, embeddable LLM inference engine with vLLM's core architecture."""

from __future__ import annotations

import importlib
from typing import Any

from tinyvllm.config import EngineArgs, PoolerConfig
from tinyvllm.inputs import StreamingInput
from tinyvllm.llm import LLM
from tinyvllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "BlockInfo",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineStats",
    "LatencySummary",
    "Logprob",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StreamingInput",
]
__version__ = "0.1.0"

# Loaded on first use: the streaming engine pulls in asyncio and threading, which plain
# `import tinyvllm` (and LLM users) need not pay for; the statistics types are for front ends.
_LAZY = {
    "AsyncLLM": "tinyvllm.engine.async_llm",
    "EngineDeadError": "tinyvllm.engine.async_llm",
    "RequestError": "tinyvllm.engine.async_llm",
    "BlockInfo": "tinyvllm.stats",
    "EngineStats": "tinyvllm.stats",
    "LatencySummary": "tinyvllm.stats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
