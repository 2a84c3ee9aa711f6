"""Multimodal prompts: `{"prompt": ..., "multi_modal_data": {"image": ..., "video": ...}}` ->
expanded token ids plus one MultiModalFeature per item, sized before the model runs.

Each `<|image_pad|>` / `<|video_pad|>` placeholder (one token, or a run already expanded to
the item's size) becomes as many tokens as the item gives the language model: merged patches
for an image, and for a video with EVS the retained count, which depends only on the grid
and the rate. So the scheduler sees the final length from the start. Items are preprocessed
here (tinyvllm.multimodal) and hashed by content: the hash is the prefix cache's extra key
and the runner's encoder-cache key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tinyvllm.multimodal.media import decode_video, load_image
from tinyvllm.multimodal.qwen_vl_processing import (
    QwenVLProcessorConfig,
    image_grid_thw,
    process_images,
    process_video,
    video_grid_thw,
)
from tinyvllm.request import MultiModalFeature
from tinyvllm.utils.content_parts import PLACEHOLDERS

if TYPE_CHECKING:
    from tinyvllm.models.qwen2_5_vl import MediaInput

_MODALITIES = ("image", "video")
# Frames sampled (spread over the clip) from a video file unless its metadata says otherwise:
# a fixed count keeps a long file to a bounded number of tokens.
VIDEO_FILE_FRAMES = 32


class MultiModalProcessor:
    """Turns a prompt's media into placeholder spans for one model (Qwen2.5-VL style)."""

    def __init__(
        self, hf_config: Any, model_path: str, max_model_len: int, video_pruning_rate: float
    ) -> None:
        vision = getattr(hf_config, "vision_config", None)
        self.enabled = vision is not None
        self.placeholders = PLACEHOLDERS  # one item's text in a chat message
        self.max_model_len = max_model_len
        self.pruning_rate = video_pruning_rate
        if not self.enabled:
            return
        self.merge: int = vision.spatial_merge_size
        self.tokens_per_second = float(getattr(vision, "tokens_per_second", 1) or 1)
        self.token_ids = {
            "image": int(hf_config.image_token_id),
            "video": int(hf_config.video_token_id),
        }
        self.configs = {
            "image": QwenVLProcessorConfig.from_model_dir(model_path),
            "video": QwenVLProcessorConfig.from_model_dir(model_path, video=True),
        }

    def process(
        self, prompt_ids: list[int], mm_data: Any
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """(expanded prompt ids, features in prompt order); ValueError naming what is wrong."""
        items = self._items(mm_data)
        runs = self._placeholder_runs(prompt_ids)
        # A clip that cannot fit fails before its frames are preprocessed.
        self._check_sizes_from_shapes(len(prompt_ids) - sum(e - s for s, e, _ in runs), items)
        # Each item's own problems first: they are the more specific message.
        media: dict[str, list[MediaInput]] = {
            m: [self._preprocess(m, item, i) for i, item in enumerate(items[m])]
            for m in _MODALITIES
        }
        for modality in _MODALITIES:
            found = sum(1 for _, _, m in runs if m == modality)
            given = len(items[modality])
            if found != given:
                pad = "<|image_pad|>" if modality == "image" else "<|video_pad|>"
                raise ValueError(
                    f"the prompt has {found} {modality} placeholder(s) ({pad}) but "
                    f"multi_modal_data gives {given} {modality}(s); put one "
                    f"<|vision_start|>{pad}<|vision_end|> in the prompt per {modality}"
                )
        out: list[int] = []
        features: list[MultiModalFeature] = []
        counters = dict.fromkeys(_MODALITIES, 0)
        index = 0
        for start, end, modality in runs:
            item = media[modality][counters[modality]]
            counters[modality] += 1
            size = self.num_tokens(item)
            if end - start not in (1, size):
                raise ValueError(
                    f"{modality} {counters[modality] - 1} has a run of {end - start} "
                    f"placeholder tokens; it needs one (expanded here) or exactly {size}"
                )
            out += prompt_ids[index:start]
            features.append(MultiModalFeature(modality, content_hash(item), len(out), size, item))
            out += [self.token_ids[modality]] * size
            index = end
        out += prompt_ids[index:]
        videos = [(f.data.grid_thw, f.length) for f in features if f.modality == "video"]
        self._check_length(len(out), videos)
        return out, features

    def check_text_prompt(self, prompt_ids: list[int]) -> None:
        """A prompt without media must not hold placeholders (they would have no embeddings)."""
        if self.enabled and self._placeholder_runs(prompt_ids):
            raise ValueError(
                "the prompt has image/video placeholder tokens but no multi_modal_data; pass "
                "the media as {'prompt': ..., 'multi_modal_data': {'image': ...}}"
            )

    def num_tokens(self, item: MediaInput) -> int:
        """Language-model tokens of one item: merged patches, and for a video with EVS the
        retained count."""
        return self._grid_tokens(item.modality, item.grid_thw)

    def _grid_tokens(self, modality: str, grid: tuple[int, int, int]) -> int:
        if modality == "video" and self.pruning_rate > 0:
            from tinyvllm.multimodal.evs import retained_tokens_for_grid

            return retained_tokens_for_grid(grid, self.merge, self.pruning_rate)
        t, h, w = grid
        return t * (h // self.merge) * (w // self.merge)

    # ---- internals -------------------------------------------------------------------------
    def _items(self, mm_data: Any) -> dict[str, list[Any]]:
        if not isinstance(mm_data, Mapping):
            raise TypeError(
                f"multi_modal_data must be a dict like {{'image': ...}} or {{'video': ...}}, "
                f"got {type(mm_data).__name__}"
            )
        unknown = sorted(set(mm_data) - set(_MODALITIES))
        if "audio" in unknown:
            raise ValueError(
                "this model cannot take audio in multi_modal_data; use a speech model such as "
                "Voxtral Realtime (VoxtralRealtimeForConditionalGeneration)"
            )
        if unknown:
            raise ValueError(
                f"multi_modal_data has unknown key(s) {unknown}; supported: 'image', 'video'"
            )
        if not self.enabled:
            kinds = " and ".join(sorted(mm_data))
            raise ValueError(
                f"this model is text-only: it cannot take the {kinds} in multi_modal_data; "
                "use a vision-language model such as Qwen2.5-VL"
            )
        items: dict[str, list[Any]] = {}
        for modality in _MODALITIES:
            value = mm_data.get(modality)
            if value is None:
                items[modality] = []
            elif modality == "image":
                items[modality] = list(value) if isinstance(value, list | tuple) else [value]
            else:
                items[modality] = _video_items(value)
        return items

    def _placeholder_runs(self, prompt_ids: list[int]) -> list[tuple[int, int, str]]:
        """(start, end, modality) of each maximal run of one placeholder token."""
        if not self.enabled:
            return []
        kinds = {v: k for k, v in self.token_ids.items()}
        runs: list[tuple[int, int, str]] = []
        i = 0
        while i < len(prompt_ids):
            modality = kinds.get(prompt_ids[i])
            if modality is None:
                i += 1
                continue
            j = i
            while j < len(prompt_ids) and prompt_ids[j] == prompt_ids[i]:
                j += 1
            runs.append((i, j, modality))
            i = j
        return runs

    def _preprocess(self, modality: str, item: Any, index: int) -> MediaInput:
        # Here, not at the top: every engine imports this module, and a text model has no
        # media (the vision model's module is ~20 ms of its start).
        from tinyvllm.models.qwen2_5_vl import MediaInput

        cfg = self.configs[modality]
        if modality == "image":
            if isinstance(item, str | Path | bytes):
                item = load_image(item)
            pixels, grid = process_images([item], cfg)
            return MediaInput("image", torch.from_numpy(pixels), _grid(grid[0]))
        frames, meta = item
        fps = meta.get("fps")
        if isinstance(frames, str | Path | bytes):
            clip = decode_video(frames, meta.get("num_frames", VIDEO_FILE_FRAMES))
            frames, fps = clip.frames, fps or clip.fps
        try:
            pixels, grid = process_video(frames, cfg)
        except ValueError as exc:
            raise ValueError(f"video {index}: {exc}") from None
        second_per_grid_t = cfg.temporal_patch_size / fps if fps else 1.0
        return MediaInput("video", torch.from_numpy(pixels), _grid(grid[0]), second_per_grid_t)

    def _check_sizes_from_shapes(self, num_text: int, items: dict[str, list[Any]]) -> None:
        """The length check from the items' shapes alone, when every item is an array or a
        PIL image (files and frame lists are checked once they are decoded)."""
        total = num_text
        videos: list[tuple[tuple[int, int, int], int]] = []
        for modality in _MODALITIES:
            for item in items[modality]:
                frames = item[0] if modality == "video" else item
                grid = self._shape_grid(modality, frames)
                if grid is None:
                    return
                size = self._grid_tokens(modality, grid)
                total += size
                if modality == "video":
                    videos.append((grid, size))
        self._check_length(total, videos)

    def _shape_grid(self, modality: str, item: Any) -> tuple[int, int, int] | None:
        from PIL import Image

        cfg = self.configs[modality]
        if modality == "image" and isinstance(item, Image.Image):
            return image_grid_thw(item.height, item.width, cfg)
        if not isinstance(item, np.ndarray) or item.ndim != (3 if modality == "image" else 4):
            return None
        if modality == "image":
            return image_grid_thw(item.shape[0], item.shape[1], cfg)
        return video_grid_thw(*item.shape[:3], cfg) if item.shape[0] else None

    def _check_length(self, total: int, videos: list[tuple[tuple[int, int, int], int]]) -> None:
        """ValueError when a prompt with videos exceeds max_model_len, saying how many frames
        of its longest video would fit."""
        if total <= self.max_model_len or not videos:
            return  # without videos the engine's own length check names the numbers
        grid, length = max(videos, key=lambda v: v[1])
        room = self.max_model_len - (total - length)
        tp = self.configs["video"].temporal_patch_size
        fit = next(
            (g * tp for g in range(grid[0], 0, -1)
             if self._grid_tokens("video", (g, grid[1], grid[2])) <= room),
            0,
        )  # fmt: skip
        raise ValueError(
            f"the prompt needs {total} tokens with its video of {grid[0] * tp} frames "
            f"({length} tokens), more than max_model_len={self.max_model_len}; at this size "
            f"{fit} frames fit (use fewer or smaller frames, raise max_model_len, or set "
            "video_pruning_rate)"
        )


def create_mm_processor(
    hf_config: Any, model_path: str, max_model_len: int, video_pruning_rate: float, tokenizer: Any
) -> Any:
    """The model's prompt-media processor: the realtime audio one for Voxtral Realtime, Gemma
    3's for Gemma 3 vision-language checkpoints, else the Qwen-VL style one (disabled for
    text-only models)."""
    if getattr(hf_config, "model_type", None) == "voxtral_realtime":
        from tinyvllm.engine.audio_inputs import RealtimeAudioProcessor

        return RealtimeAudioProcessor(hf_config, model_path)
    if getattr(hf_config, "model_type", None) == "gemma3" and hasattr(hf_config, "vision_config"):
        from tinyvllm.engine.gemma3_mm_inputs import Gemma3MultiModalProcessor

        return Gemma3MultiModalProcessor(hf_config, model_path, tokenizer)
    return MultiModalProcessor(hf_config, model_path, max_model_len, video_pruning_rate)


def content_hash(item: MediaInput) -> str:
    """What identifies an item's encoder output: modality, grid, timing and pixel values."""
    h = hashlib.sha256(f"{item.modality}:{item.grid_thw}:{item.second_per_grid_t}".encode())
    h.update(item.pixel_values.numpy().tobytes())
    return h.hexdigest()


def _grid(row: Sequence[int]) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in row)
    return t, h, w


def _video_items(value: Any) -> list[tuple[Any, Mapping[str, Any]]]:
    """One video or a list of them -> [(frames, metadata)]. A video is a (T, H, W, 3) array, a
    list of frames (PIL images or (H, W, 3) arrays), a file (path, file:// URL, bytes), or
    (any of those, {"fps": f, "num_frames": n}): fps spaces the M-RoPE time positions, and a
    file is sampled to num_frames frames spread over the clip."""

    def one(video: Any) -> tuple[Any, Mapping[str, Any]]:
        if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], Mapping):
            return video[0], video[1]
        return video, {}

    if isinstance(value, list) and value and all(_is_whole_video(v) for v in value):
        return [one(v) for v in value]
    return [one(value)]


def _is_whole_video(value: Any) -> bool:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        return True
    if isinstance(value, str | Path | bytes | list):  # a file, or one video's list of frames
        return True
    return isinstance(value, np.ndarray) and value.ndim == 4
