"""Sampling defaults for chat: the checkpoint's own generation_config.json where it sets them
(as vLLM's generation_config="auto" does), else greedy decoding.

The fallback is measured on the catalog default, SmolLM2-135M-Instruct as a Q4_1 GGUF (GGUF
files carry no generation_config), by benchmarks/chat_temperature.py: eight factual questions,
five seeds. Greedy answers 40/40; temperature 0.2, 0.3 and 0.5 (top_p 0.9) 37/40, every miss
the capital of France, whose first answer token is nearly a four-way tie ("The" 15%, "L" 13%,
"La" 10%, ...) so any temperature starts a broken-French answer about half the time; 0.7 gets
34/40 with misses spread over four questions. `/set temperature=...` brings variety back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FALLBACK_TEMPERATURE = 0.0
# A cap so a small model cannot ramble through its whole context.
DEFAULT_MAX_TOKENS = 1024
# generation_config.json keys that mean the same as the SamplingParams field of that name.
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_path: str | Path) -> dict[str, Any]:
    """The sampling values `model_path`'s generation_config.json sets; {} for a GGUF file, a
    checkpoint without the file, or one that sets none (e.g. only token ids)."""
    path = Path(model_path)
    if not path.is_dir():
        return {}
    try:
        data = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        key: data[key]
        for key in _GENERATION_CONFIG_KEYS
        if isinstance(data.get(key), int | float) and not isinstance(data[key], bool)
    }


def default_chat_params(llm: Any = None, **overrides: Any) -> SamplingParams:
    """Sampling for conversation: tinyvllm's fallback, then what `llm`'s checkpoint sets, then
    `overrides` (None values ignored). Raises ValueError naming a bad override."""
    values: dict[str, Any] = {"temperature": FALLBACK_TEMPERATURE, "max_tokens": DEFAULT_MAX_TOKENS}
    engine = getattr(llm, "engine", None)
    if engine is not None:
        model_path = engine.config.model.model_path
        from_model = {**values, **model_sampling_defaults(model_path)}
        try:
            SamplingParams(**from_model)
            values = from_model
        except ValueError as exc:  # a checkpoint's odd value must not stop the chat
            logger.warning("ignoring the sampling values in %s: %s", model_path, exc)
    values.update({key: value for key, value in overrides.items() if value is not None})
    return SamplingParams(**values)
