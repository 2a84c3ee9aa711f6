"""Qwen-VL preprocessing against transformers' PIL-backed Qwen2-VL image processor.

transformers' video processor needs torchvision (not usable here), so the video path is
checked against the image processor piece by piece: each temporal slot of a video patch
must hold exactly the image processor's patch of that frame.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from tinyvllm.multimodal.qwen_vl_processing import (
    QwenVLProcessorConfig,
    image_grid_thw,
    process_images,
    process_video,
    smart_resize,
    video_grid_thw,
)

CFG = QwenVLProcessorConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)


def _hf(cfg: QwenVLProcessorConfig = CFG) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size,
        image_mean=list(cfg.mean),
        image_std=list(cfg.std),
    )


def _hf_images(images: list, cfg: QwenVLProcessorConfig = CFG) -> tuple[np.ndarray, np.ndarray]:
    out = _hf(cfg)(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def _random_image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("height", "width"),
    [(56, 84), (50, 70), (300, 41), (10, 10), (500, 500), (1000, 30), (56, 5599)],
)
def test_smart_resize_matches_hf(height: int, width: int) -> None:
    ours = smart_resize(height, width, 28, CFG.min_pixels, CFG.max_pixels)
    assert ours == hf_smart_resize(height, width, 28, CFG.min_pixels, CFG.max_pixels)
    assert ours[0] % 28 == 0 and ours[1] % 28 == 0


def test_smart_resize_rejects_extreme_aspect_ratio() -> None:
    with pytest.raises(ValueError, match="aspect ratio must be at most 200:1"):
        smart_resize(10, 2010, 28, CFG.min_pixels, CFG.max_pixels)


def test_images_match_hf_exactly() -> None:
    # Grid-aligned, resized up (below min_pixels), resized down (above max_pixels), odd
    # sizes, a PIL grayscale image and an RGBA image (composited onto white).
    rgba = Image.fromarray(
        np.random.default_rng(9).integers(0, 256, (60, 90, 4), dtype=np.uint8), "RGBA"
    )
    images = [
        _random_image(56, 84, 0),
        _random_image(30, 40, 1),
        _random_image(400, 300, 2),
        Image.fromarray(_random_image(97, 131, 3)),
        Image.fromarray(_random_image(70, 70, 4)[..., 0], "L"),
        rgba,
    ]
    pixels, grids = process_images(images, CFG)
    hf_pixels, hf_grids = _hf_images(images)
    np.testing.assert_array_equal(grids, hf_grids)
    assert pixels.dtype == np.float32
    np.testing.assert_array_equal(pixels, hf_pixels)
    for image, grid in zip(images, grids, strict=True):
        width, height = image.size if isinstance(image, Image.Image) else image.shape[1::-1]
        assert image_grid_thw(height, width, CFG) == tuple(grid)


def test_default_config_matches_hf_defaults() -> None:
    image = _random_image(123, 77, 5)
    pixels, grids = process_images([image], QwenVLProcessorConfig())
    out = Qwen2VLImageProcessorPil()(images=[image], return_tensors="np")
    np.testing.assert_array_equal(grids, out["image_grid_thw"])
    np.testing.assert_array_equal(pixels, out["pixel_values"])


def _slot(pixels: np.ndarray, cfg: QwenVLProcessorConfig, slot: int) -> np.ndarray:
    p = cfg.patch_size
    return pixels.reshape(len(pixels), 3, cfg.temporal_patch_size, p, p)[:, :, slot]


def test_grid_aligned_video_matches_hf_frame_by_frame() -> None:
    # 5 frames of 56x84: no resize; the last temporal patch repeats frame 4 (as HF pads).
    frames = np.stack([_random_image(56, 84, 10 + i) for i in range(5)])
    pixels, grid = process_video(frames, CFG)
    assert grid.tolist() == [[3, 4, 6]]
    assert video_grid_thw(5, 56, 84, CFG) == (3, 4, 6)
    per_frame = 4 * 6
    padded = [*range(5), 4]
    for i, frame_index in enumerate(padded):
        hf_pixels, _ = _hf_images([frames[frame_index]])
        group, slot = divmod(i, CFG.temporal_patch_size)
        ours = _slot(pixels[group * per_frame : (group + 1) * per_frame], CFG, slot)
        np.testing.assert_array_equal(ours, _slot(hf_pixels, CFG, 0))


def test_video_from_list_equals_video_from_array() -> None:
    frames = np.stack([_random_image(84, 56, 20 + i) for i in range(4)])
    as_array = process_video(frames, CFG)
    as_list = process_video([Image.fromarray(f) for f in frames], CFG)
    np.testing.assert_array_equal(as_array[0], as_list[0])
    np.testing.assert_array_equal(as_array[1], as_list[1])


def test_video_is_resized_like_an_image() -> None:
    # A static clip of a non-aligned size: every slot equals the image path's patches.
    frame = _random_image(100, 150, 30)
    pixels, grid = process_video(np.stack([frame] * 2), CFG)
    image_pixels, image_grid = process_images([frame], CFG)
    np.testing.assert_array_equal(grid, image_grid)
    np.testing.assert_array_equal(pixels, image_pixels)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (np.zeros((0, 56, 56, 3), np.uint8), "zero frames"),
        ([], "zero frames"),
        (np.zeros((56, 56, 3), np.uint8), r"\(num_frames, height, width, 3\)"),
        (np.zeros((2, 56, 56, 4), np.uint8), r"got shape \(2, 56, 56, 4\)"),
        (np.zeros((2, 56, 56, 3), np.float32), "dtype uint8"),
        ([np.zeros((56, 56, 3), np.uint8), np.zeros((28, 56, 3), np.uint8)], "one size"),
        ([np.zeros((56, 56), np.uint8)], r"video frame 0 must be a \(height, width, 3\)"),
        (["frame.png"], "PIL image or a numpy array, got str"),
    ],
)
def test_bad_video_input(frames: object, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        process_video(frames, CFG)  # type: ignore[arg-type]


def test_bad_image_input() -> None:
    with pytest.raises(ValueError, match="image 1 must have dtype uint8"):
        process_images([_random_image(56, 56, 0), np.zeros((56, 56, 3))], CFG)
    with pytest.raises(ValueError, match="no images"):
        process_images([], CFG)


def test_config_from_model_dir(tmp_path: Path) -> None:
    assert QwenVLProcessorConfig.from_model_dir(tmp_path) == QwenVLProcessorConfig()
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 12845056,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.25, 0.25, 0.25],
                "image_processor_type": "Qwen2VLImageProcessor",
            }
        )
    )
    cfg = QwenVLProcessorConfig.from_model_dir(tmp_path, video=True)
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 12845056)
    assert cfg.mean == (0.5, 0.5, 0.5) and cfg.std == (0.25, 0.25, 0.25)
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 100352, "longest_edge": 602112}})
    )
    video_cfg = QwenVLProcessorConfig.from_model_dir(tmp_path, video=True)
    assert (video_cfg.min_pixels, video_cfg.max_pixels) == (100352, 602112)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 10}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: .*max_pixels=10"):
        QwenVLProcessorConfig.from_model_dir(tmp_path)
