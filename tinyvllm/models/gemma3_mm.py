"""Gemma 3 vision-language model (`Gemma3ForConditionalGeneration`): a SigLIP vision tower, the
multimodal projector, and the Gemma 3 text decoder (`gemma3.py`) fed merged embeddings.

An image (image_size x image_size, normalised) becomes (image_size / patch_size)^2 SigLIP
patch embeddings, average-pooled to `mm_tokens_per_image`, normalised by a (1 + w) RMSNorm and
projected to the text width; they replace the image's `<image_soft_token>` run, which the
runner's "gemma3_mm" model state attends bidirectionally (`bidirectional_ranges`).
Checkpoint names: `[model.]language_model.*`, `[model.]vision_tower[.vision_model].*`,
`[model.]multi_modal_projector.*` (transformers v4 and v5 layouts both load).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.models.checkpoint_check import TensorDirectory, check_renamed_checkpoint
from tinyvllm.models.gemma3 import Gemma3ForCausalLM, Gemma3Model
from tinyvllm.models.layers.norm import OffsetRMSNorm
from tinyvllm.models.llama import FamilyOptions, LlamaModel
from tinyvllm.models.weights import load_language_and_towers
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.weight import finalize_quantized_weights


class SiglipEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer block: full (non-causal) attention, GeLU-tanh MLP."""

    def __init__(self, hidden: int, intermediate: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)  # checkpoint q_proj, k_proj, v_proj
        self.out_proj = nn.Linear(hidden, hidden)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, hidden = x.shape
        q, k, v = self.qkv(self.layer_norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(n, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, length, hidden)
        x = x + self.out_proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class SiglipVisionTower(nn.Module):
    """Patch embedding (the conv as one matmul over flattened patches), learned position
    embeddings, the encoder blocks and the post-LayerNorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh",):
            raise ValueError(
                f"vision_config.hidden_act={config.hidden_act!r} is not supported; "
                "SigLIP in Gemma 3 uses 'gelu_pytorch_tanh'"
            )
        hidden, channels = config.hidden_size, getattr(config, "num_channels", 3)
        self.patch = config.patch_size
        self.side = config.image_size // config.patch_size
        self.patch_embedding = nn.Linear(channels * self.patch**2, hidden)
        self.position_embedding = nn.Parameter(torch.zeros(self.side**2, hidden))
        eps = config.layer_norm_eps
        self.layers = nn.ModuleList(
            SiglipEncoderLayer(hidden, config.intermediate_size, config.num_attention_heads, eps)
            for _ in range(config.num_hidden_layers)
        )
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> [N, (S / patch)^2, hidden], patches in raster order."""
        n, c, _, _ = pixels.shape
        p, side = self.patch, self.side
        # [N, C, side, p, side, p] -> [N, side, side, C, p, p]: the conv weight's (c, y, x).
        patches = pixels.view(n, c, side, p, side, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_embedding(patches.reshape(n, side * side, c * p * p))
        x = x + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        qkv: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            tensor = torch.as_tensor(tensor)
            name = name.removeprefix("embeddings.").removeprefix("encoder.")
            if name == "patch_embedding.weight":
                tensor = tensor.reshape(tensor.shape[0], -1)
            elif name == "position_embedding.weight":
                name = "position_embedding"
            for part in ("q_proj", "k_proj", "v_proj"):
                if f".self_attn.{part}." in name:
                    prefix, kind = name.split(f".self_attn.{part}.")
                    qkv.setdefault(f"{prefix}.qkv.{kind}", {})[part] = tensor
                    break
            else:
                name = name.replace(".self_attn.", ".").replace(".mlp.", ".")
                self._copy(params, name, tensor)
                loaded.add(name)
        for name, parts in qkv.items():
            if len(parts) != 3:
                raise ValueError(f"vision tower: {name} lacks one of q_proj/k_proj/v_proj")
            self._copy(params, name, torch.cat([parts[k] for k in ("q_proj", "k_proj", "v_proj")]))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks vision tower tensors: {missing[:5]}")

    @staticmethod
    def _copy(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected vision tower tensor {name!r} in the checkpoint")
        if param.shape != tensor.shape:
            raise ValueError(
                f"vision tower tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)


class Gemma3MultiModalProjector(nn.Module):
    """Average-pool the patch grid to mm_tokens_per_image, (1 + w) RMSNorm, project."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.side = vision.image_size // vision.patch_size
        tokens_side = round(config.mm_tokens_per_image**0.5)
        if tokens_side**2 != config.mm_tokens_per_image or self.side % tokens_side:
            raise ValueError(
                f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square whose side "
                f"divides the patch grid side {self.side}"
            )
        self.kernel = self.side // tokens_side
        self.mm_soft_emb_norm = OffsetRMSNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, text.hidden_size)
        )

    def load_weights(self, weights: list[tuple[str, Any]]) -> None:
        names = {n.removeprefix("multi_modal_projector."): t for n, t in weights}
        expected = {"mm_input_projection_weight", "mm_soft_emb_norm.weight"}
        if set(names) != expected:
            raise ValueError(
                f"multi_modal_projector tensors {sorted(names)} in the checkpoint; expected "
                f"{sorted(expected)}"
            )
        SiglipVisionTower._copy(
            dict(self.named_parameters()), "mm_input_projection_weight",
            torch.as_tensor(names["mm_input_projection_weight"]),
        )  # fmt: skip
        with torch.no_grad():  # the norm's loader stores 1 + w
            norm = self.mm_soft_emb_norm.weight
            norm.weight_loader(norm, torch.as_tensor(names["mm_soft_emb_norm.weight"]))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(n, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None = None
    ) -> None:
        from tinyvllm.models.checkpoint import lift_text_config

        config = lift_text_config(config)
        if getattr(config, "tie_word_embeddings", None) is None:
            config.tie_word_embeddings = config.text_config.tie_word_embeddings
        super().__init__(config, max_model_len, quant_config)
        self.final_logit_softcapping = getattr(config.text_config, "final_logit_softcapping", None)
        # The vision side stays in float weights whatever `quant_config` says (it runs once
        # per image).
        self.vision_tower = SiglipVisionTower(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.mm_tokens_per_image: int = config.mm_tokens_per_image

    @staticmethod
    def check_checkpoint(config: Any, directory: TensorDirectory) -> None:
        """The language model's sizes against its tensors, under the canonical names."""
        from tinyvllm.models.checkpoint import lift_text_config

        check_renamed_checkpoint(lift_text_config(config), directory, _canonical_name)

    def build_language_model(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None
    ) -> LlamaModel:
        return Gemma3Model(config.text_config, max_model_len, FamilyOptions(), quant_config)

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

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> [N, mm_tokens_per_image, hidden] in the model dtype."""
        param = self.multi_modal_projector.mm_input_projection_weight
        out = self.multi_modal_projector(self.vision_tower(pixels.to(param.device, param.dtype)))
        return out.to(self.model.norm.weight.dtype)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        towers = {
            "vision_tower.": self.vision_tower,
            "multi_modal_projector.": self.multi_modal_projector,
        }
        load_language_and_towers(self, weights, _canonical_name, towers)
        self._check_norms_finite()
        finalize_quantized_weights(self)


def _canonical_name(name: str) -> str:
    """transformers v5 (`model.language_model.layers...`) and the hub's v4 layout
    (`language_model.model.layers...`, `vision_tower.vision_model...`) -> one naming."""
    name = name.removeprefix("model.")
    if name.startswith("language_model."):
        rest = name.removeprefix("language_model.")
        if rest.startswith("lm_head."):
            return rest
        return "model." + rest.removeprefix("model.")
    return name.replace("vision_tower.vision_model.", "vision_tower.")
