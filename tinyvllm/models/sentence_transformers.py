"""What a sentence-transformers checkpoint says about pooling: modules.json, the Pooling
module's config.json, a Normalize module, and sentence_bert_config.json's max_seq_length."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
# 1_Pooling/config.json flag -> our pooling type (vLLM's names).
_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """None: the checkpoint does not say (it has no such module or file)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None


def is_sentence_transformers_dir(path: Path) -> bool:
    return (Path(path) / "modules.json").is_file()


def read_sentence_transformers_config(path: Path) -> SentenceTransformersConfig:
    """The pooling a sentence-transformers model directory declares (all None for any other
    checkpoint). Raises ValueError naming the file for a malformed or unsupported one."""
    path = Path(path)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return SentenceTransformersConfig()
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{str(modules_file)!r}: expected a list of module objects")
    types = [m.get("type") for m in modules]
    pooling_type = None
    for module in modules:
        if module.get("type") == _POOLING:
            pooling_type = _pooling_type(path / str(module.get("path", "")) / "config.json")
    max_seq_length = None
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        value = _read_json(st_config)
        length = value.get("max_seq_length") if isinstance(value, dict) else None
        if length is not None and (not isinstance(length, int) or length < 1):
            raise ValueError(
                f"{str(st_config)!r}: max_seq_length must be a positive integer, got {length!r}"
            )
        max_seq_length = length
    return SentenceTransformersConfig(pooling_type, _NORMALIZE in types, max_seq_length)


def _pooling_type(config_file: Path) -> str:
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{str(config_file)!r}: expected a JSON object")
    chosen = [kind for flag, kind in _MODES.items() if config.get(flag)]
    unsupported = [flag for flag in _UNSUPPORTED_MODES if config.get(flag)]
    if unsupported or len(chosen) != 1:
        flags = unsupported or [flag for flag in _MODES if config.get(flag)]
        raise ValueError(
            f"{str(config_file)!r}: pooling {flags or 'with no mode set'} is not supported; "
            f"exactly one of {', '.join(_MODES)} must be true"
        )
    return chosen[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from None
