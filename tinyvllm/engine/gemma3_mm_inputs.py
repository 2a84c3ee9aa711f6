"""Gemma 3 multimodal prompts: each `<start_of_image>` in the prompt, one per image, is
expanded as HF's Gemma3Processor does ("\\n\\n" boi, mm_tokens_per_image image tokens, eoi
"\\n\\n"); one MultiModalFeature covers each image's run of image tokens, the span the model
state attends bidirectionally. Same interface as `MultiModalProcessor` (Qwen-VL)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from tinyvllm.engine.mm_inputs import content_hash
from tinyvllm.models.qwen2_5_vl import MediaInput
from tinyvllm.multimodal.gemma3_processing import Gemma3ImageConfig, process_image
from tinyvllm.multimodal.media import load_image
from tinyvllm.request import MultiModalFeature


def _token_id(config: Any, name: str) -> int:
    value = getattr(config, f"{name}_token_id", None)
    if value is None:
        value = getattr(config, f"{name}_token_index", None)
    if value is None:
        raise ValueError(f"the Gemma 3 config has no {name}_token_id (or {name}_token_index)")
    return int(value)


class Gemma3MultiModalProcessor:
    enabled = True
    # One image's text in a chat message (Gemma's chat template writes the same for an image
    # part).
    placeholders: Mapping[str, str] = MappingProxyType({"image": "<start_of_image>"})

    def __init__(self, hf_config: Any, model_path: str, tokenizer: Any) -> None:
        vision = hf_config.vision_config
        self.cfg = Gemma3ImageConfig.from_model_dir(model_path, vision.image_size)
        self.num_image_tokens: int = int(hf_config.mm_tokens_per_image)
        self.boi = _token_id(hf_config, "boi")
        self.eoi = _token_id(hf_config, "eoi")
        self.image = _token_id(hf_config, "image")
        self.newlines: list[int] = (
            list(tokenizer.encode("\n\n", add_special_tokens=False)) if tokenizer else []
        )

    def process(
        self, prompt_ids: list[int], mm_data: Any
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """(expanded prompt ids, one feature per image); ValueError naming what is wrong."""
        images = self._images(mm_data)
        media = [self._preprocess(item, i) for i, item in enumerate(images)]
        sites = [i for i, t in enumerate(prompt_ids) if t == self.boi]
        if len(sites) != len(media):
            raise ValueError(
                f"the prompt has {len(sites)} image placeholder(s) (<start_of_image>) but "
                f"multi_modal_data gives {len(media)} image(s); put one <start_of_image> in "
                "the prompt per image"
            )
        n = self.num_image_tokens
        out: list[int] = []
        features: list[MultiModalFeature] = []
        index = 0
        for k, (site, item) in enumerate(zip(sites, media, strict=True)):
            run = site + 1
            while run < len(prompt_ids) and prompt_ids[run] == self.image:
                run += 1
            out += prompt_ids[index:site]
            if run > site + 1:  # already expanded: keep it, if it has the right size
                if run - site - 1 != n or run >= len(prompt_ids) or prompt_ids[run] != self.eoi:
                    raise ValueError(
                        f"image {k} has {run - site - 1} image tokens after <start_of_image>; "
                        f"it needs none (expanded here) or exactly {n} followed by <end_of_image>"
                    )
                out.append(self.boi)
                index = run + 1
            else:
                out += [*self.newlines, self.boi]
                index = site + 1
            identifier = content_hash(item)
            features.append(MultiModalFeature("image", identifier, len(out), n, item))
            out += [self.image] * n + [self.eoi]
            if index == site + 1:
                out += self.newlines
        out += prompt_ids[index:]
        return out, features

    def check_text_prompt(self, prompt_ids: list[int]) -> None:
        if self.image in prompt_ids:
            raise ValueError(
                "the prompt has image tokens (<image_soft_token>) but no multi_modal_data; "
                "pass the images as {'prompt': ..., 'multi_modal_data': {'image': ...}}"
            )

    def _images(self, mm_data: Any) -> list[Any]:
        if not isinstance(mm_data, Mapping):
            raise TypeError(
                f"multi_modal_data must be a dict like {{'image': ...}}, got "
                f"{type(mm_data).__name__}"
            )
        unknown = sorted(set(mm_data) - {"image"})
        if unknown:
            raise ValueError(
                f"multi_modal_data has unsupported key(s) {unknown}: Gemma 3 takes 'image' only"
            )
        value = mm_data.get("image")
        if value is None:
            return []
        return list(value) if isinstance(value, list | tuple) else [value]

    def _preprocess(self, item: Any, index: int) -> MediaInput:
        if isinstance(item, str | Path | bytes):
            try:
                item = load_image(item)
            except ValueError as exc:
                raise ValueError(f"image {index}: {exc}") from None
        pixels = process_image(item, self.cfg, f"image {index}")
        side = self.cfg.size
        return MediaInput("image", torch.from_numpy(pixels), (1, side, side))
