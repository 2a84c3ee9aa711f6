"""Qwen2-VL / Qwen2.5-VL preprocessing: images and video frames -> flattened patches + grids.

The steps follow transformers' PIL-backed `Qwen2VLImageProcessor` (and its video processor's
frame grouping), so an image gives the same `pixel_values` bit for bit:

1. `smart_resize`: the nearest size whose sides are multiples of patch_size * merge_size,
   scaled (keeping the aspect ratio) into [min_pixels, max_pixels];
2. Pillow bicubic resize of the uint8 RGB image (skipped when the size already fits);
3. rescale to [0, 1] (in float64, then float32) and normalise with the processor's mean/std;
4. group frames by temporal_patch_size (an image fills every slot of its group; a video
   short of a full group repeats its last frame);
5. patchify into rows ordered (t, h/m, w/m, m, m) and columns ordered (C, tp, p, p).

Videos are resized frame by frame with Pillow too (transformers' video processor uses
torchvision instead, whose bicubic differs slightly); grid-aligned frames are not resized.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

    ImageLike = Image.Image | np.ndarray

# CLIP's statistics: the Qwen-VL processors' defaults.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Beyond this the resized image would be a sliver a patch wide (Qwen's limit, kept as is).
_MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenVLProcessorConfig:
    """Preprocessing parameters, named as in preprocessor_config.json."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = _CLIP_MEAN
    std: tuple[float, float, float] = _CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"processor config {name}={getattr(self, name)!r} must be >= 1")
        if self.max_pixels < self.min_pixels:
            raise ValueError(
                f"processor config max_pixels={self.max_pixels} is below "
                f"min_pixels={self.min_pixels}"
            )
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(
                f"processor config needs 3 means and 3 positive stds (RGB), got "
                f"mean={self.mean!r}, std={self.std!r}"
            )

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one merged token)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> QwenVLProcessorConfig:
        """From a preprocessor_config.json mapping (old `min_pixels`/`max_pixels` keys or the
        newer `size: {shortest_edge, longest_edge}`); unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in values.items() if k in known}
        size = values.get("size") or {}
        if "min_pixels" not in values and "shortest_edge" in size:
            kwargs["min_pixels"] = size["shortest_edge"]
        if "max_pixels" not in values and "longest_edge" in size:
            kwargs["max_pixels"] = size["longest_edge"]
        if "image_mean" in values:
            kwargs["mean"] = values["image_mean"]
        if "image_std" in values:
            kwargs["std"] = values["image_std"]
        for key in ("mean", "std"):
            if key in kwargs:
                kwargs[key] = tuple(float(x) for x in kwargs[key])
        return cls(**kwargs)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, video: bool = False) -> QwenVLProcessorConfig:
        """Read a checkpoint's preprocessor_config.json (for `video=True`,
        video_preprocessor_config.json when the checkpoint has one); defaults when absent."""
        names = ["preprocessor_config.json"]
        if video:
            names.insert(0, "video_preprocessor_config.json")
        for name in names:
            path = Path(model_dir) / name
            if path.is_file():
                try:
                    return cls.from_dict(json.loads(path.read_text()))
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"{path}: {exc}") from None
        return cls()


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen's target size: sides multiples of `factor`, area in [min_pixels, max_pixels],
    aspect ratio kept as closely as rounding allows."""
    if min(height, width) < 1:
        raise ValueError(f"image size {width}x{height} is empty")
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ValueError(
            f"image size {width}x{height}: the aspect ratio must be at most "
            f"{_MAX_ASPECT_RATIO}:1 (crop or pad the image)"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _to_rgb_array(image: ImageLike, what: str) -> np.ndarray:
    """uint8 (H, W, 3); transparent images are composited onto white (as HF does)."""
    # Pillow is imported where images are handled: every engine imports this module, and
    # a text model never needs it (~15 ms of a start).
    from PIL import Image

    if isinstance(image, Image.Image):
        if "A" in image.getbands() or "transparency" in image.info:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, rgba)
        return np.asarray(image.convert("RGB"))
    if not isinstance(image, np.ndarray):
        raise TypeError(f"{what} must be a PIL image or a numpy array, got {type(image).__name__}")
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"{what} must be a (height, width, 3) RGB array, got shape {image.shape}")
    if image.dtype != np.uint8:
        raise ValueError(
            f"{what} must have dtype uint8 (values 0..255), got {image.dtype}; "
            "convert with (x * 255).round().astype(np.uint8) for [0, 1] floats"
        )
    return image


def _resize(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    if frame.shape[:2] == size:
        return frame
    height, width = size
    from PIL import Image

    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BICUBIC))


def _normalize(frames: np.ndarray, cfg: QwenVLProcessorConfig) -> np.ndarray:
    """uint8 (..., H, W, 3) -> float32 (..., 3, H, W), rescaled then normalised.

    A uint8 channel has 256 levels, so each channel's output is a 256-entry table computed
    with HF's exact arithmetic (rescale in float64, round to float32, then (x - mean) / std in
    float32); a lookup then replaces per-pixel float64 work and its 8-byte-per-value peak.
    """
    levels = (np.arange(256, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.mean, dtype=np.float32)[:, None]
    std = np.asarray(cfg.std, dtype=np.float32)[:, None]
    table = (levels[None, :] - mean) / std  # [channel, level]
    return np.moveaxis(table[np.arange(3), frames], -1, -3)


def _patchify(frames: np.ndarray, cfg: QwenVLProcessorConfig) -> tuple[np.ndarray, list[int]]:
    """float32 (T, 3, H, W) with T a multiple of temporal_patch_size -> (patches, [t, h, w])."""
    num_frames, channels, height, width = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_t, grid_h, grid_w = num_frames // tp, height // p, width // p
    patches = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    # -> (t, h/m, w/m, m_h, m_w, C, tp, p_h, p_w)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
    return np.ascontiguousarray(flat), [grid_t, grid_h, grid_w]


def _target_size(frame: np.ndarray, cfg: QwenVLProcessorConfig) -> tuple[int, int]:
    height, width = frame.shape[:2]
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def process_images(
    images: Sequence[ImageLike], cfg: QwenVLProcessorConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Images -> (pixel_values float32 [patches, 3*tp*p*p], image_grid_thw int64 [n, 3])."""
    from PIL import Image

    if isinstance(images, (Image.Image, np.ndarray)):
        images = [images]
    if len(images) == 0:
        raise ValueError("process_images got no images")
    all_patches: list[np.ndarray] = []
    grids: list[list[int]] = []
    for i, image in enumerate(images):
        rgb = _to_rgb_array(image, f"image {i}")
        rgb = _resize(rgb, _target_size(rgb, cfg))
        # An image is one temporal patch: the same frame in every slot.
        frames = np.broadcast_to(_normalize(rgb, cfg), (cfg.temporal_patch_size, 3, *rgb.shape[:2]))
        patches, grid = _patchify(frames, cfg)
        all_patches.append(patches)
        grids.append(grid)
    return np.concatenate(all_patches), np.asarray(grids, dtype=np.int64)


def _video_frames(frames: np.ndarray | Sequence[ImageLike]) -> np.ndarray:
    """Validate and stack frames into uint8 (T, H, W, 3)."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(
                "video frames must be a (num_frames, height, width, 3) RGB array, got shape "
                f"{frames.shape}"
            )
        if frames.dtype != np.uint8:
            raise ValueError(f"video frames must have dtype uint8 (0..255), got {frames.dtype}")
        stacked = frames
    else:
        arrays = [_to_rgb_array(frame, f"video frame {i}") for i, frame in enumerate(frames)]
        sizes = {a.shape for a in arrays}
        if len(sizes) > 1:
            raise ValueError(f"video frames must all have one size, got {sorted(sizes)}")
        stacked = np.stack(arrays) if arrays else np.zeros((0, 1, 1, 3), np.uint8)
    if stacked.shape[0] == 0:
        raise ValueError("the video has zero frames; pass at least one frame")
    return stacked


def process_video(
    frames: np.ndarray | Sequence[ImageLike], cfg: QwenVLProcessorConfig
) -> tuple[np.ndarray, np.ndarray]:
    """One video -> (pixel_values_videos float32 [patches, 3*tp*p*p], video_grid_thw [1, 3]).

    `frames`: uint8 array (T, H, W, 3), or a list of PIL images / (H, W, 3) uint8 arrays.
    """
    video = _video_frames(frames)
    size = _target_size(video[0], cfg)
    if video.shape[1:3] != size:
        video = np.stack([_resize(frame, size) for frame in video])
    pad = -video.shape[0] % cfg.temporal_patch_size
    if pad:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    patches, grid = _patchify(_normalize(video, cfg), cfg)
    return patches, np.asarray([grid], dtype=np.int64)


def num_merged_tokens(grid_thw: Sequence[int], cfg: QwenVLProcessorConfig) -> int:
    """Language-model tokens of one item with patch grid (t, h, w)."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (cfg.merge_size * cfg.merge_size)


def video_grid_thw(
    num_frames: int, height: int, width: int, cfg: QwenVLProcessorConfig
) -> tuple[int, int, int]:
    """The patch grid `process_video` produces for a clip of this shape, without the pixels
    (for sizing placeholders before preprocessing)."""
    if num_frames < 1:
        raise ValueError("the video has zero frames; pass at least one frame")
    rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    grid_t = -(-num_frames // cfg.temporal_patch_size)
    return grid_t, rh // cfg.patch_size, rw // cfg.patch_size


def image_grid_thw(height: int, width: int, cfg: QwenVLProcessorConfig) -> tuple[int, int, int]:
    """The patch grid `process_images` produces for an image of this size."""
    rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return 1, rh // cfg.patch_size, rw // cfg.patch_size
