"""Gemma3MMModelState: Gemma 3 vision-language models (1-D positions, SigLIP image embeddings
merged into the token embeddings, bidirectional attention inside each image's token span).

The encoder cache and the merge are the M-RoPE state's (`mrope.py`), without M-RoPE: the
positions are the token indices, so text-only steps keep the fast paths (native decode
program, CUDA graphs). The step's `bidirectional_ranges` ([num_reqs, K, 2]) carries
[offset, end) of each image span a request's scheduled tokens hold: every backend lets a query
in a span see every key of that span (transformers' token_type_ids block mask; in sliding
layers the window still applies). The scheduler keeps each span whole inside one chunk.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.core.outputs import NewRequestData
from tinyvllm.request import MultiModalFeature
from tinyvllm.runner.input_batch import InputBatch
from tinyvllm.runner.model_states.interface import ModelInputs, ModelState
from tinyvllm.runner.model_states.mrope import MRopeModelState, _CacheEntry, _Row


class Gemma3MMModelState(MRopeModelState):
    flat_positions: ClassVar[bool] = True

    def __init__(self, model: nn.Module, max_num_reqs: int, device: torch.device) -> None:
        ModelState.__init__(self, model, max_num_reqs, device)
        self.rows: dict[int, _Row] = {}
        self.encoder_cache: dict[str, _CacheEntry] = {}
        self.num_encoded = 0

    def add_request(self, row: int, new: NewRequestData) -> None:
        if not new.mm_features:
            return
        pending = {f.identifier for f in new.mm_features if f.end > new.num_computed_tokens}
        empty = torch.empty(1, 0, dtype=torch.int64)
        self.rows[row] = _Row(list(new.mm_features), empty, [], 0, pending)
        for identifier in pending:
            if identifier in self.encoder_cache:
                self._hold(row, identifier)

    def model_inputs(self, batch: InputBatch) -> ModelInputs:
        metadata = batch.attn_metadata
        metadata.bidirectional_ranges = self._ranges(batch)
        return ModelInputs(batch.input_ids, batch.positions, metadata)

    def dummy_inputs(self, metadata: AttentionMetadata) -> ModelInputs:
        positions = torch.arange(metadata.num_actual_tokens, device=self.device)
        return ModelInputs(torch.zeros_like(positions), positions, metadata)

    def _ranges(self, batch: InputBatch) -> torch.Tensor | None:
        """[num_reqs, K, 2] int32: the image spans each request's scheduled tokens hold ((0,
        0) padding); None when no request's tokens reach an image."""
        if not self.rows:
            return None
        qsl = batch.attn_metadata.query_start_loc_cpu
        index = batch.positions.cpu()
        per_req: list[list[tuple[int, int]]] = []
        for i, row in enumerate(batch.rows.tolist()):
            state = self.rows.get(row)
            spans: list[tuple[int, int]] = []
            if state is not None and qsl[i + 1] > qsl[i]:
                first, last = int(index[qsl[i]]), int(index[qsl[i + 1] - 1]) + 1
                spans = _spans_within(state.features, first, last)
            per_req.append(spans)
        k = max(map(len, per_req), default=0)
        if k == 0:
            return None
        padded = [spans + [(0, 0)] * (k - len(spans)) for spans in per_req]
        return torch.tensor(padded, dtype=torch.int32, device=self.device)

    def _encode_missing(self, features: list[MultiModalFeature]) -> bool:
        """Run the vision tower and projector once over every image not cached yet."""
        missing = {f.identifier: f for f in features if f.identifier not in self.encoder_cache}
        if not missing:
            return False
        items = list(missing.values())
        pixels = torch.stack([f.data.pixel_values for f in items])
        embeds = self.model.embed_images(pixels)  # type: ignore[operator]
        for feature, item_embeds in zip(items, embeds, strict=True):
            self.encoder_cache[feature.identifier] = _CacheEntry(item_embeds)
            self.num_encoded += 1
            self._on_encoded(feature.identifier)
        return False


def _spans_within(
    features: list[MultiModalFeature], first: int, last: int
) -> list[tuple[int, int]]:
    """The image spans inside the scheduled tokens [first, last); RuntimeError when the
    scheduler broke its promise (a span cut by the chunk)."""
    spans = [(f.offset, f.end) for f in features if f.offset < last and f.end > first]
    for lo, hi in spans:
        if lo < first or hi > last:
            raise RuntimeError(
                f"image span [{lo}, {hi}) is split by the scheduled tokens [{first}, {last})"
            )
    return spans
