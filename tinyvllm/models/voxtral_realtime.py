"""Voxtral Realtime (`VoxtralRealtimeForConditionalGeneration`): streaming speech-to-text.

A causal audio encoder (`voxtral_realtime_encoder.py`) turns every 80 ms of audio (8 mel
frames) into one embedding; decoder position p's input is the text embedding of its token
plus the audio embedding of position p, for prompt and generated tokens alike, so the model
emits one token per audio position (mostly padding tokens, words when it has heard them).
The decoder is Mistral with one change: the MLP input of each layer is scaled by
1 + ada_rms_norm(t_cond), where t_cond is a sinusoidal embedding of the number of delay
tokens. That number is fixed per model (`default_num_delay_tokens`), so the scale is a
constant vector per layer and is folded into `post_attention_layernorm.weight` at load: the
decoder is then a plain Mistral stack (paged attention, sliding window) fed `inputs_embeds`.

The runner's "realtime" model state (`runner/model_states/realtime.py`) runs the encoder as
audio arrives and adds the audio embeddings to every scheduled row.
Checkpoint names (transformers v5): `[model.]language_model.[model.]*`, `[model.]audio_tower.*`,
`[model.]multi_modal_projector.*`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.models.checkpoint_check import TensorDirectory, check_renamed_checkpoint
from tinyvllm.models.llama import FamilyOptions, LlamaForCausalLM, LlamaModel
from tinyvllm.models.voxtral_realtime_encoder import VoxtralRealtimeAudioTower
from tinyvllm.models.weights import load_language_and_towers
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.weight import finalize_quantized_weights

_ADA = re.compile(r"^model\.layers\.(\d+)\.ada_rms_norm\.")


class _AdaNorms(nn.Module):
    """The checkpoint's per-layer ada_rms_norm (linear1: hidden -> 32, GELU, linear2) weights,
    held only until they are folded into the decoder's norms."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: list[tuple[str, Any]]) -> None:
        self.tensors = {name: torch.as_tensor(t) for name, t in weights}


class VoxtralRealtimeForConditionalGeneration(LlamaForCausalLM):
    options: ClassVar[FamilyOptions] = FamilyOptions(sliding_window_mode="all")

    def __init__(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None = None
    ) -> None:
        from tinyvllm.models.checkpoint import lift_text_config

        config = lift_text_config(config)
        super().__init__(config, max_model_len, quant_config)
        # The encoder stays in float weights whatever `quant_config` says.
        self.audio_tower = VoxtralRealtimeAudioTower(config)
        self.num_delay_tokens: int = config.default_num_delay_tokens
        self.audio_length_per_tok: int = config.audio_length_per_tok
        if self.audio_length_per_tok != self.audio_tower.mel_frames_per_position:
            raise ValueError(
                f"audio_length_per_tok={self.audio_length_per_tok} must be 2 x "
                f"downsample_factor={config.downsample_factor} (the encoder's stride-2 "
                "convolution halves the mel frame rate)"
            )

    @staticmethod
    def check_checkpoint(config: Any, directory: TensorDirectory) -> None:
        """The language model's sizes against its tensors, under the canonical names."""
        from tinyvllm.models.checkpoint import lift_text_config

        check_renamed_checkpoint(lift_text_config(config), directory, _canonical_name)

    def build_language_model(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None
    ) -> LlamaModel:
        return LlamaModel(config.text_config, max_model_len, self.options, quant_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        ada = _AdaNorms()
        towers = {"audio_tower.": self.audio_tower, "ada_norms.": ada}
        load_language_and_towers(self, weights, _canonical_name, towers)
        self._fold_time_conditioning(ada.tensors)
        self._check_norms_finite()
        finalize_quantized_weights(self)

    def _fold_time_conditioning(self, tensors: dict[str, torch.Tensor]) -> None:
        """post_attention_layernorm.weight *= 1 + ada_rms_norm(t_cond) per layer, computed
        in the model dtype as HF's forward does."""
        norm = self.model.norm.weight
        dtype, hidden = norm.dtype, norm.shape[0]
        t_cond = time_embedding(self.num_delay_tokens, hidden, dtype).to(norm.device)
        for i, layer in enumerate(self.model.layers):
            try:
                w1, w2 = tensors[f"{i}.linear1.weight"], tensors[f"{i}.linear2.weight"]
            except KeyError:
                raise ValueError(
                    f"the checkpoint lacks layer {i}'s ada_rms_norm.linear1/linear2 weights "
                    "(the time conditioning of Voxtral Realtime)"
                ) from None
            w1, w2 = w1.to(norm.device, dtype), w2.to(norm.device, dtype)
            scale = 1 + F.linear(F.gelu(F.linear(t_cond, w1)), w2)
            with torch.no_grad():
                weight = layer.post_attention_layernorm.weight
                weight.copy_(weight * scale)


def time_embedding(num_delay_tokens: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The sinusoidal embedding [dim] of the delay (HF's VoxtralRealtimeTimeEmbedding, theta
    10000): cos then sin of t * exp(-ln(theta) * i / (dim / 2))."""
    half = dim // 2
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(half).float() / half)
    t = torch.full((1,), float(num_delay_tokens), dtype=dtype)
    emb = t * inv_freq.to(dtype)
    return torch.cat((emb.cos(), emb.sin()))


def _canonical_name(name: str) -> str:
    """HF names -> ours: `model.*` for the language model, `audio_tower.*`,
    `audio_tower.projector.*` for the projector and `ada_norms.N.*` for the time
    conditioning (set aside and folded after loading)."""
    name = name.removeprefix("model.")
    if name.startswith("multi_modal_projector."):
        return "audio_tower.projector." + name.removeprefix("multi_modal_projector.")
    if name.startswith("language_model."):
        rest = name.removeprefix("language_model.")
        if rest.startswith("lm_head."):
            return rest
        name = "model." + rest.removeprefix("model.")
        match = _ADA.match(name)
        if match:
            return f"ada_norms.{match.group(1)}." + name[match.end() :]
    return name
