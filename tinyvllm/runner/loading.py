"""Loading the engine's model onto its platform: shared by the generate and pooling runners."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tinyvllm.config import EngineConfig
from tinyvllm.models.loader import load_model, module_bytes
from tinyvllm.platforms import Platform, select_platform

logger = logging.getLogger(__name__)


def load_target_model(
    config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> tuple[Platform, nn.Module]:
    """The platform (chosen once: every device-specific kernel, see tinyvllm/platforms/) and
    the configured model loaded and prepared for it."""
    mc = config.model
    platform = select_platform(
        device, dtype, config.device.enforce_eager, config.device.fp32_weight_copy_bytes
    )
    model = load_model(
        mc.model_path,
        mc.hf_config,
        dtype,
        device,
        mc.max_model_len,
        mc.quantization,
        platform.quant_kernels,
    )
    logger.info(
        "model weights: %.1f MiB (quantization=%s)", module_bytes(model) / 2**20, mc.quantization
    )
    if mc.runner_type == "generate" and not getattr(model, "has_lm_head", True):
        raise ValueError(
            f"{mc.model_path!r} has no lm_head.weight: it is a headless backbone (an embedding "
            "checkpoint such as Qwen3-Embedding), which cannot generate; load it with "
            "runner='pooling'"
        )
    platform.prepare_model(model)
    return platform, model
