"""Sampling: logits -> next tokens (penalties, temperature, min_p, top_k/top_p, seeds, logprobs)."""

from __future__ import annotations

from tinyvllm.sample.logprobs import LogprobsTensors, compute_token_logprobs
from tinyvllm.sample.metadata import SAMPLING_EPS, SamplingMetadata
from tinyvllm.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "SAMPLING_EPS",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_token_logprobs",
]
