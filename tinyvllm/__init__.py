"""tinyvllm: a compact, embeddable LLM inference engine with vLLM's core architecture."""

from __future__ import annotations

from tinyvllm.config import EngineArgs
from tinyvllm.llm import LLM
from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
__version__ = "0.1.0"
