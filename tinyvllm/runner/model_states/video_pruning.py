"""VideoPruningModelState: M-RoPE with EVS (Efficient Video Sampling), vLLM MRv2 style.

The engine already sized each video's placeholders to the retained count (it depends only on
the grid and the rate). This state owns what needs the encoder's output: after a video is
encoded it computes the retention mask (tinyvllm.multimodal.evs), keeps the selected
embeddings in the encoder cache, and rewrites the positions of every row holding the video,
so each kept token keeps its original (t, h, w) M-RoPE position. The text after the video
was placed where it would be without pruning when the row was added, so only the video's
span changes. The mask is computed once per item, before any of its tokens runs, so a
chunked prefill that splits the video sees one consistent layout.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyvllm.models.qwen2_5_vl import MediaInput
from tinyvllm.multimodal.evs import compute_retention_mask
from tinyvllm.request import MultiModalFeature
from tinyvllm.runner.model_states.mrope import MRopeModelState


class VideoPruningModelState(MRopeModelState):
    def __init__(
        self, model: nn.Module, max_num_reqs: int, device: torch.device, pruning_rate: float
    ) -> None:
        super().__init__(model, max_num_reqs, device)
        self.pruning_rate = pruning_rate
        # Content hash -> retention mask over the video's unpruned merged tokens (CPU),
        # kept as long as the item's encoder-cache entry.
        self.masks: dict[str, torch.Tensor] = {}

    def select_tokens(self, feature: MultiModalFeature, embeds: torch.Tensor) -> torch.Tensor:
        media: MediaInput = feature.data
        if media.modality != "video":
            return embeds
        mask = compute_retention_mask(embeds, media.grid_thw, self.merge, self.pruning_rate)
        if int(mask.sum()) != feature.length:  # the engine sized the span by the same rule
            raise RuntimeError(
                f"EVS kept {int(mask.sum())} tokens of a video whose placeholder span has "
                f"{feature.length}"
            )
        self.masks[feature.identifier] = mask.cpu()
        return embeds[mask.to(embeds.device)]

    def on_cached_item(self, row: int, k: int) -> bool:
        state = self.rows[row]
        feature = state.features[k]
        mask = self.masks.get(feature.identifier)
        if mask is None:
            return False
        kept = self.full_grid_positions(row, k)[:, mask]
        span = state.positions[:, feature.offset : feature.end]
        if torch.equal(span, kept):
            return False
        state.positions[:, feature.offset : feature.end] = kept
        return True

    def _release(self, identifier: str, row: int) -> None:
        super()._release(identifier, row)
        if identifier not in self.encoder_cache:
            self.masks.pop(identifier, None)
