"""Device and dtype resolution."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available; use 'cpu'")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def choose_dtype(requested: str, config_dtype: object, device: torch.device) -> str:
    """'auto' keeps the checkpoint's dtype, except fp16 on CPU (slow there) becomes bf16."""
    if requested != "auto":
        name = {"float": "float32", "half": "float16"}.get(requested, requested)
        if name == "float16" and device.type == "cpu":
            logger.warning("float16 on CPU is very slow here; bfloat16 is usually much faster")
        return name
    if isinstance(config_dtype, torch.dtype):
        config_dtype = str(config_dtype).removeprefix("torch.")
    name = config_dtype if config_dtype in _DTYPES else "bfloat16"
    name = {"float": "float32", "half": "float16"}.get(str(name), str(name))
    if name == "float16" and device.type == "cpu":
        return "bfloat16"
    return name
