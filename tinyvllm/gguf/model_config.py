"""The model config of a GGUF file, without transformers.

Importing transformers' `LlamaConfig` alone costs over a second (it pulls in torch.distributed
and transformers' kernel hub), more than parsing and loading the whole GGUF model. Our model
classes read only plain attributes of their config, so for the architectures whose HF config
class only stores and derives values (Llama, Qwen2, Qwen3, Gemma 3 text) these dataclasses hold
the same values under the same names, and no attribute HF's class lacks (the models probe some
with `getattr` defaults). `tests/test_gguf_startup.py` checks every attribute tinyvllm reads
against transformers' own config built from the same metadata.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# model_type -> HF's default `max_window_layers` (only read when a sliding window is set).
_MAX_WINDOW_LAYERS = {"qwen2": 28, "qwen3": 28}
LLAMA_MODEL_TYPES = ("llama", "qwen2", "qwen3")
GEMMA3_MODEL_TYPE = "gemma3_text"
MODEL_TYPES = (*LLAMA_MODEL_TYPES, GEMMA3_MODEL_TYPE)


@dataclass
class GGUFModelConfig:
    """What `transformers.CONFIG_MAPPING[model_type](**kwargs)` would hold for these kwargs."""

    model_type: str
    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    dtype: str
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list[str] | None = field(default=None)

    @classmethod
    def from_kwargs(cls, model_type: str, **kwargs: Any) -> GGUFModelConfig:
        """The config for the kwargs `gguf_to_hf_config` builds (see there)."""
        if model_type not in LLAMA_MODEL_TYPES:
            raise ValueError(f"no tinyvllm config for model_type {model_type!r}")
        values = kwargs
        theta = values.pop("rope_theta")
        scaling = values.pop("rope_scaling", None)
        # transformers v5 merges the base into the scaling dict; HF's `rope_scaling` is the
        # same dict under its older name.
        rope = {"rope_theta": theta, "rope_type": "default"} if scaling is None else scaling
        rope.setdefault("rope_theta", theta)
        config = cls(model_type=model_type, rope_parameters=rope, **values)
        if model_type in _MAX_WINDOW_LAYERS:
            config.max_window_layers = _MAX_WINDOW_LAYERS[model_type]
            config.layer_types = ["full_attention"] * config.num_hidden_layers
        return config

    @property
    def rope_scaling(self) -> dict[str, Any]:
        return self.rope_parameters


@dataclass
class GGUFGemma3Config:
    """What transformers' `Gemma3TextConfig(**kwargs)` holds for the kwargs `gguf_to_hf_config`
    builds: its fields with its defaults (the token ids and the rest the file may not state);
    no `hidden_act` or `use_sliding_window`, which HF's class does not have either."""

    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict[str, dict[str, Any]]
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str
    hidden_activation: str
    query_pre_attn_scalar: int
    sliding_window: int | None
    layer_types: list[str]
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False
    pad_token_id: int | None = 0
    eos_token_id: int | None = 1
    bos_token_id: int | None = 2
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    model_type: str = GEMMA3_MODEL_TYPE

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> GGUFGemma3Config:
        config = cls(**kwargs)
        # HF's architecture check (its own error would be a transformers type).
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"the hidden size ({config.hidden_size}) is not a multiple of the number of "
                f"attention heads ({config.num_attention_heads})"
            )
        return config

    @property
    def rope_scaling(self) -> dict[str, dict[str, Any]]:
        return self.rope_parameters


def own_config_class(model_type: str) -> Callable[..., Any] | None:
    """tinyvllm's config constructor (taking `gguf_to_hf_config`'s kwargs) for `model_type`,
    None where only transformers' class will do."""
    if model_type in LLAMA_MODEL_TYPES:
        return functools.partial(GGUFModelConfig.from_kwargs, model_type)
    if model_type == GEMMA3_MODEL_TYPE:
        return GGUFGemma3Config.from_kwargs
    return None
