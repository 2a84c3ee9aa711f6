"""Qwen2.5-VL: the Qwen2 language model with M-RoPE, plus the vision tower whose merged patch
embeddings replace the image / video placeholder tokens.

The language model is the Llama family's decoder stack (`llama.py`) with a multimodal rotary
embedding (three position sections, `mrope_section`); the runner's "mrope" model state
computes the [3, T] positions and hands `forward` the merged input embeddings. Parameter names
follow the HF checkpoint: `model.*` (language model), `visual.*` (vision tower), `lm_head`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.models.layers.linear import default_weight_loader
from tinyvllm.models.layers.rotary import MRotaryEmbedding, RopeConfig
from tinyvllm.models.llama import FamilyOptions, LlamaForCausalLM, LlamaModel
from tinyvllm.native.decode_plan import DecodePlan
from tinyvllm.quant.config import QuantConfig

# transformers v5 saves these prefixes; older checkpoints (the hub's) use the short ones.
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def build_vision_tower(vision_config: Any) -> nn.Module:
    """The Qwen2.5-VL vision transformer: `forward(pixel_values, grid_thw)` -> merged patch
    embeddings [patches / merge_size**2, out_hidden_size]."""
    try:
        from tinyvllm.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
    except ImportError:  # TEMPORARY stand-in until the own vision tower lands
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config)
    return Qwen2_5_VisionTransformer(vision_config)


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):  # noqa: N801 - the HF name
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
        self.visual = build_vision_tower(vision)
        self.spatial_merge_size: int = vision.spatial_merge_size

    def build_language_model(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None
    ) -> LlamaModel:
        text = config.text_config
        rope = RopeConfig.from_hf_config(text)
        section = list(rope.params.get("mrope_section") or ())
        if not section:
            raise ValueError("text_config.rope_parameters has no mrope_section (Qwen2.5-VL)")
        rotary = MRotaryEmbedding(rope, _rope_table_len(config, max_model_len), section)
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
        visual = dict(self.visual.named_parameters())
        pending = set(visual)

        def language_weights() -> Iterator[tuple[str, Any]]:
            # Vision tensors are copied as they stream past; the rest goes to the LM loader
            # (whose fused q/k/v and gate/up mapping must not touch the vision MLPs).
            for name, tensor in weights:
                name = _canonical_name(name)
                if not name.startswith("visual."):
                    yield name, tensor
                    continue
                key = name.removeprefix("visual.")
                param = visual.get(key)
                if param is None:
                    raise ValueError(
                        f"unexpected tensor {name!r} in the checkpoint: the Qwen2.5-VL vision "
                        "tower has no such parameter"
                    )
                with torch.no_grad():
                    default_weight_loader(param, tensor)
                pending.discard(key)

        super().load_weights(language_weights())
        if pending:
            missing = sorted(f"visual.{n}" for n in pending)
            raise ValueError(
                f"the checkpoint is missing {len(missing)} vision tensor(s): {missing[:8]}"
            )


def _canonical_name(name: str) -> str:
    for long, short in _PREFIXES:
        if name.startswith(long):
            return short + name.removeprefix(long)
    return name


def _rope_table_len(config: Any, max_model_len: int) -> int:
    """M-RoPE positions of a video can run past the token count (time advances by
    tokens_per_second per frame group), but never past max_model_len times the larger of
    that step and 1: the table covers it."""
    step = max(1, int(getattr(config.vision_config, "tokens_per_second", 1)))
    return max_model_len * step
