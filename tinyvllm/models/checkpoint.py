"""Finding a checkpoint and reading its config: one path for the target and the draft model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyvllm.gguf.config import hf_field_names, load_gguf_config
from tinyvllm.gguf.paths import resolve_gguf_path
from tinyvllm.models.checkpoint_check import (
    TensorDirectory,
    check_config_values,
    check_layer_count,
)
from tinyvllm.models.loader import resolve_model_path, tensor_directory
from tinyvllm.models.registry import get_model_class


@dataclass(frozen=True)
class Checkpoint:
    """A model on disk: `path` is its directory or .gguf file, `hf_config` its checked config."""

    path: Path
    hf_config: Any
    is_gguf: bool


def resolve_checkpoint(
    model: str,
    gguf_file: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
) -> Checkpoint:
    """A local directory, .gguf file or hub id (downloaded if needed) -> its checkpoint.

    The architecture must be registered and the config's sizes sane; both fail here, before
    any weights load.
    """
    # A GGUF checkpoint is one file: config, tokenizer and weights all come from it.
    gguf_path = resolve_gguf_path(model, gguf_file, revision, download_dir)
    if gguf_path is not None:
        checkpoint = Checkpoint(gguf_path, load_gguf_config(gguf_path), is_gguf=True)
    else:
        path = resolve_model_path(model, revision, download_dir)
        _check_layer_count_first(path)
        config = lift_text_config(_read_hf_config(path, trust_remote_code))
        checkpoint = Checkpoint(path, config, is_gguf=False)
    get_model_class(checkpoint.hf_config)
    _check_config(checkpoint)
    return checkpoint


def _read_hf_config(model_path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a bad config.json
        detail = str(exc).splitlines()[-1].strip() if str(exc) else type(exc).__name__
        raise ValueError(
            f"cannot read the model config {str(model_path / 'config.json')!r}: {detail}"
        ) from exc


# Language-model fields the engine reads from the top-level config.
_TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "hidden_act",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "eos_token_id",
    "bos_token_id",
)


def lift_text_config(config: Any) -> Any:
    """A vision-language (or speech) config keeps its language model's sizes in `text_config`
    (transformers v5); copy the ones the engine reads (KV sizing, context length, checks) onto
    the top level, where text models have them, so every reader looks in one place."""
    text = getattr(config, "text_config", None)
    towers = getattr(config, "vision_config", None) or getattr(config, "audio_config", None)
    if text is None or towers is None:
        return config
    for name in _TEXT_FIELDS:
        if getattr(config, name, None) is None and getattr(text, name, None) is not None:
            setattr(config, name, getattr(text, name))
    return config


def _check_layer_count_first(model_path: Path) -> None:
    """transformers builds per-layer lists while it reads config.json (Qwen's `layer_types`),
    so an absurd layer count must meet the checkpoint's tensors before AutoConfig runs."""
    try:
        raw = json.loads((model_path / "config.json").read_text())
        directory = tensor_directory(model_path)
    except (OSError, ValueError):
        return  # AutoConfig or the loader reports these, in their order
    layers = raw.get("num_hidden_layers") if isinstance(raw, dict) else None
    if isinstance(layers, int) and not isinstance(layers, bool):
        check_layer_count(layers, directory)


def _check_config(checkpoint: Checkpoint) -> None:
    config = checkpoint.hf_config
    if checkpoint.is_gguf:
        names = hf_field_names(config.model_type)
        where = TensorDirectory(f"GGUF file {str(checkpoint.path)!r}", {}, names)
    else:
        where = TensorDirectory(repr(str(checkpoint.path / "config.json")), {})
    check_config_values(config, where.origin, where.describe)
