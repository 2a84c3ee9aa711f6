"""Qwen2.5-VL: the Qwen2 language model with M-RoPE, plus the vision tower whose merged patch
embeddings replace the image / video placeholder tokens.

The language model is the Llama family's decoder stack (`llama.py`) with a multimodal rotary
embedding (three position sections, `mrope_section`); the runner's "mrope" model state
computes the [3, T] positions and hands `forward` the merged input embeddings. Parameter names
follow the HF checkpoint: `model.*` (language model), `visual.*` (vision tower), `lm_head`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.models.layers.rotary import MRotaryEmbedding, RopeConfig
from tinyvllm.models.llama import FamilyOptions, LlamaForCausalLM, LlamaModel
from tinyvllm.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from tinyvllm.models.weights import load_language_and_towers
from tinyvllm.multimodal.evs import video_mrope_positions
from tinyvllm.native.decode_plan import DecodePlan
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.weight import finalize_quantized_weights

# transformers v5 saves these prefixes; older checkpoints (the hub's) use the short ones.
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    options: ClassVar[FamilyOptions] = FamilyOptions(qkv_bias=True, o_proj_bias=False)

    def __init__(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None = None
    ) -> None:
        from tinyvllm.models.checkpoint import lift_text_config

        config = lift_text_config(config)
        vision, text = config.vision_config, config.text_config
        if vision.out_hidden_size != text.hidden_size:
            raise ValueError(
                f"vision_config.out_hidden_size={vision.out_hidden_size} must equal the "
                f"language model's hidden_size={text.hidden_size}"
            )
        super().__init__(config, max_model_len, quant_config)
        # The vision tower stays in float weights whatever `quant_config` says (it is small
        # and runs once per image).
        self.visual = Qwen2_5_VisionTransformer(vision)
        self.spatial_merge_size: int = vision.spatial_merge_size

    def build_language_model(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None
    ) -> LlamaModel:
        text = config.text_config
        rope = RopeConfig.from_hf_config(text)
        section = list(rope.params.get("mrope_section") or ())
        if not section:
            raise ValueError("text_config.rope_parameters has no mrope_section (Qwen2.5-VL)")
        rotary = MRotaryEmbedding(rope, section)
        return LlamaModel(text, max_model_len, self.options, quant_config, rotary_emb=rotary)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """positions: [3, T] M-RoPE positions (or [T] for text); `inputs_embeds` (from the
        model state) carries the media embeddings merged into the token embeddings."""
        return self.model(input_ids, positions, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_media(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """One image's or video's merged patch embeddings [tokens, hidden], in (t, h, w)
        raster order of the merged grid."""
        param = next(self.visual.parameters())
        out = self.visual(pixel_values.to(param.device, param.dtype), grid_thw)
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    def native_decode_plan(self) -> DecodePlan | None:
        # The native decode program takes 1-D positions; M-RoPE runs the eager path.
        return None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_language_and_towers(self, weights, _canonical_name, {"visual.": self.visual})
        self._check_norms_finite()
        finalize_quantized_weights(self)


def _canonical_name(name: str) -> str:
    for long, short in _PREFIXES:
        if name.startswith(long):
            return short + name.removeprefix(long)
    return name


@dataclass(frozen=True, eq=False)
class MediaInput:
    """One processed image or video: what a prompt's MultiModalFeature carries as `data`."""

    modality: str  # "image" | "video"
    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch**2], CPU
    grid_thw: tuple[int, int, int]  # patch grid: temporal groups, height, width
    # Seconds one temporal group spans (videos): M-RoPE time advances tokens_per_second
    # per second.
    second_per_grid_t: float = 1.0


def media_positions(
    media: MediaInput, start: int, merge: int, tokens_per_second: float
) -> torch.Tensor:
    """M-RoPE positions [3, t * h * w] of all merged tokens of one item placed at `start`, in
    raster (t, h, w) order: time advances tokens_per_second * second_per_grid_t per temporal
    group for videos (0 for images), height and width by one per merged token."""
    interval = tokens_per_second * media.second_per_grid_t if media.modality == "video" else 0
    return video_mrope_positions(media.grid_thw, merge, interval) + start


def prompt_mrope_positions(
    num_prompt: int,
    spans: list[tuple[int, int, MediaInput]],
    merge: int,
    tokens_per_second: float,
) -> tuple[torch.Tensor, list[int], int]:
    """M-RoPE positions [3, num_prompt] of a prompt whose media fill `spans` (offset, length,
    item; in prompt order), the start position of each item, and the delta that positions
    generated tokens (index + delta).

    Text advances all three sections by one per token; an item occupies its grid, and the
    text after it continues one past the item's largest position. An item with fewer tokens
    than its grid (EVS) gets its grid's first positions here; the pruning state rewrites them
    with the kept tokens' positions once the encoder has run. Text after it continues where
    it would have without pruning."""
    positions = torch.empty(3, num_prompt, dtype=torch.int64)
    starts: list[int] = []
    index = next_pos = 0
    for offset, length, media in spans:
        if offset > index:
            positions[:, index:offset] = torch.arange(offset - index) + next_pos
            next_pos += offset - index
        grid = media_positions(media, next_pos, merge, tokens_per_second)
        positions[:, offset : offset + length] = grid[:, :length]
        starts.append(next_pos)
        next_pos = int(grid.max()) + 1
        index = offset + length
    if num_prompt > index:
        positions[:, index:] = torch.arange(num_prompt - index) + next_pos
        next_pos += num_prompt - index
    return positions, starts, next_pos - num_prompt
