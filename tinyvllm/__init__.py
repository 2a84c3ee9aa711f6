"""tinyvllm: a compact, embeddable LLM inference engine with vLLM's core architecture."""

from __future__ import annotations

from typing import Any

from tinyvllm.config import EngineArgs
from tinyvllm.llm import LLM
from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "Logprob",
    "RequestError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
__version__ = "0.1.0"

# Loaded on first use: the streaming engine pulls in asyncio and threading, which plain
# `import tinyvllm` (and LLM users) need not pay for.
_LAZY = frozenset({"AsyncLLM", "EngineDeadError", "RequestError"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from tinyvllm.engine import async_llm

        return getattr(async_llm, name)
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
