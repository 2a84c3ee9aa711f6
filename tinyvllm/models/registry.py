"""HF architecture name -> model class, plus the kind of per-request state it needs."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelEntry:
    """Where a model class lives and how the runner must treat it."""

    module: str
    class_name: str
    # Which runner model state (tinyvllm.runner.model_states) handles this model: "default"
    # (plain text), "mrope" (Qwen-VL: M-RoPE positions, vision inputs), "mamba_hybrid"
    # (recurrent state slots: short-conv / Mamba layers beside attention), "realtime" (audio
    # embeddings added to every position, prompt and decode: Voxtral Realtime).
    state_kind: str = "default"
    # What the model can run as: "generate" (text, with a KV cache) and/or "pooling"
    # (embeddings; decoders pool their hidden states, encoders have nothing else).
    runners: tuple[str, ...] = ("generate", "pooling")

    def load_class(self) -> type[nn.Module]:
        # Imported lazily so that listing architectures never pulls in every model file.
        return getattr(importlib.import_module(self.module), self.class_name)


_LLAMA = "tinyvllm.models.llama"
_BERT = "tinyvllm.models.bert"
_HYBRID = "mamba_hybrid"
# Hybrids generate only: the pooling runner keeps no recurrent state.
_GENERATE = ("generate",)

_MODELS: Mapping[str, ModelEntry] = MappingProxyType(
    {
        "BertModel": ModelEntry(_BERT, "BertModel", runners=("pooling",)),
        "Gemma3ForCausalLM": ModelEntry("tinyvllm.models.gemma3", "Gemma3ForCausalLM"),
        "Gemma3ForConditionalGeneration": ModelEntry(
            "tinyvllm.models.gemma3_mm",
            "Gemma3ForConditionalGeneration",
            "gemma3_mm",
            runners=("generate",),
        ),
        "GraniteMoeHybridForCausalLM": ModelEntry(
            "tinyvllm.models.granite_moe_hybrid",
            "GraniteMoeHybridForCausalLM",
            _HYBRID,
            _GENERATE,
        ),
        "LlamaForCausalLM": ModelEntry(_LLAMA, "LlamaForCausalLM"),
        "Lfm2ForCausalLM": ModelEntry(
            "tinyvllm.models.lfm2", "Lfm2ForCausalLM", _HYBRID, _GENERATE
        ),
        "MistralForCausalLM": ModelEntry(_LLAMA, "MistralForCausalLM"),
        "NemotronHForCausalLM": ModelEntry(
            "tinyvllm.models.nemotron_h", "NemotronHForCausalLM", _HYBRID, _GENERATE
        ),
        "Qwen2ForCausalLM": ModelEntry(_LLAMA, "Qwen2ForCausalLM"),
        "Qwen3ForCausalLM": ModelEntry(_LLAMA, "Qwen3ForCausalLM"),
        "VoxtralRealtimeForConditionalGeneration": ModelEntry(
            "tinyvllm.models.voxtral_realtime",
            "VoxtralRealtimeForConditionalGeneration",
            "realtime",
            _GENERATE,
        ),
        "Qwen2_5_VLForConditionalGeneration": ModelEntry(
            "tinyvllm.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "mrope"
        ),
    }
)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: Any) -> tuple[str, ModelEntry]:
    """The first of `config.architectures` we support, with its entry.

    Raises ValueError naming the architecture(s) and listing the supported ones.
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            return arch, _MODELS[arch]
    supported = ", ".join(supported_architectures())
    if not architectures:
        raise ValueError(
            "the model config has no 'architectures' field, so the model class is unknown; "
            f"supported architectures: {supported}"
        )
    named = ", ".join(repr(arch) for arch in architectures)
    raise ValueError(
        f"model architecture {named} is not supported; supported architectures: {supported}"
    )


def get_model_class(hf_config: Any) -> type[nn.Module]:
    return resolve_architecture(hf_config)[1].load_class()
