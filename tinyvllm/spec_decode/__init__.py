"""Speculative decoding: draft proposers, the rejection sampler and the per-step K choice."""

from __future__ import annotations

from tinyvllm.spec_decode.dynamic_k import KController, SpeculativeConfig
from tinyvllm.spec_decode.ngram import NgramProposer
from tinyvllm.spec_decode.rejection_sampler import (
    RejectionSampler,
    RejectionSamplerOutput,
    max_draft_tokens,
)

__all__ = [
    "KController",
    "NgramProposer",
    "RejectionSampler",
    "RejectionSamplerOutput",
    "SpeculativeConfig",
    "max_draft_tokens",
]
