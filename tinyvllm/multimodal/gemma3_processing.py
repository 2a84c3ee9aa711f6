"""Gemma 3 image preprocessing (transformers' `Gemma3ImageProcessorPil`, without pan and scan)
and the prompt's image placeholders.

An image is converted to RGB (alpha composited onto white), resized to image_size x
image_size with Pillow's bilinear filter, rescaled and normalised (mean and std 0.5), giving
float32 [3, S, S]. In the prompt each `<start_of_image>` becomes "\\n\\n" `<start_of_image>`,
mm_tokens_per_image `<image_soft_token>`s, `<end_of_image>` "\\n\\n", as HF's processor writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tinyvllm.multimodal.qwen_vl_processing import _normalize, _to_rgb_array

_BILINEAR = 2  # PIL's resample code for bilinear, what preprocessor_config.json stores


@dataclass(frozen=True)
class Gemma3ImageConfig:
    size: int = 896
    rescale_factor: float = 1 / 255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: int = _BILINEAR
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, image_size: int) -> Gemma3ImageConfig:
        """preprocessor_config.json's fields (defaults where absent); the size must be the
        vision tower's image_size, and pan and scan is refused."""
        path = Path(model_dir) / "preprocessor_config.json"
        raw: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        if raw.get("do_pan_and_scan"):
            raise ValueError(
                f"{path}: do_pan_and_scan=true is not supported (tinyvllm feeds each image "
                "whole, resized to the vision tower's image_size); set it to false"
            )
        size = raw.get("size") or {"height": image_size, "width": image_size}
        if (size.get("height"), size.get("width")) != (image_size, image_size):
            raise ValueError(
                f"{path}: size {size} must be {image_size} x {image_size}, the vision tower's "
                "image_size"
            )
        return cls(
            size=image_size,
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            mean=tuple(raw.get("image_mean", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            std=tuple(raw.get("image_std", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            resample=int(raw.get("resample", _BILINEAR)),
        )


def process_image(image: Image.Image | np.ndarray, cfg: Gemma3ImageConfig, what: str) -> np.ndarray:
    """One image -> float32 [3, size, size]."""
    rgb = _to_rgb_array(image, what)
    if rgb.shape[0] < 1 or rgb.shape[1] < 1:
        raise ValueError(f"{what} is empty ({rgb.shape[1]}x{rgb.shape[0]})")
    if rgb.shape[:2] != (cfg.size, cfg.size):
        resample = Image.Resampling(cfg.resample)
        rgb = np.asarray(Image.fromarray(rgb).resize((cfg.size, cfg.size), resample))
    return np.ascontiguousarray(_normalize(rgb, cfg))  # type: ignore[arg-type]
