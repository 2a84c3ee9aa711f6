"""tinyvllm: a compact, embeddable LLM inference engine with vLLM's core architecture."""

from __future__ import annotations

import importlib
from typing import Any

from tinyvllm.utils.omp import prefer_passive_omp_waits

# First, before anything imports torch: torch's OpenMP workers must not spin on the cores the
# native kernels' thread pool needs (see utils/omp.py).
prefer_passive_omp_waits()

from tinyvllm.config import EngineArgs, PoolerConfig  # noqa: E402
from tinyvllm.inputs import StreamingInput  # noqa: E402
from tinyvllm.llm import LLM  # noqa: E402
from tinyvllm.outputs import (  # noqa: E402
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from tinyvllm.pooling_params import PoolingParams  # noqa: E402
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

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
