"""MRopeModelState: Qwen-VL-style models (M-RoPE positions, a vision encoder whose outputs
replace the placeholder tokens).

Per request row it keeps the prompt's [3, P] M-RoPE positions (computed once, when the row
is added) and the delta that positions generated tokens (index + delta in all three
sections). Before each forward it runs the vision encoder for the media whose placeholder
tokens the step schedules and merges their embeddings into the token embeddings.

Encoder outputs are cached by the item's content hash, so an item whose tokens a chunked
prefill splits across steps is encoded once (and two requests with the same picture share
it); an entry is dropped once every request that needs it has computed the item's last token
(or left its row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.core.outputs import NewRequestData
from tinyvllm.models.qwen2_5_vl import MediaInput, media_positions, prompt_mrope_positions
from tinyvllm.request import MultiModalFeature
from tinyvllm.runner.input_batch import InputBatch
from tinyvllm.runner.model_states.interface import ModelInputs, ModelState


@dataclass
class _Row:
    features: list[MultiModalFeature]
    positions: torch.Tensor  # [3, num_prompt] int64, CPU
    starts: list[int]  # M-RoPE start position of each feature
    delta: int  # generated token at index i has position i + delta
    # Content hashes of the items whose tokens are not all computed yet.
    pending: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Span:
    """The part [lo, hi) of one media item that one row's scheduled tokens reach."""

    row: int
    last: int  # end of the row's scheduled tokens (sequence index)
    feature: MultiModalFeature
    at: int  # flat batch index of the item's token lo
    lo: int
    hi: int


@dataclass
class _CacheEntry:
    embeds: torch.Tensor  # [placeholder tokens, hidden] on the model's device
    rows: set[int] = field(default_factory=set)  # rows that still need it


class MRopeModelState(ModelState):
    flat_positions: ClassVar[bool] = False

    def __init__(self, model: nn.Module, max_num_reqs: int, device: torch.device) -> None:
        super().__init__(model, max_num_reqs, device)
        config: Any = model.config
        self.merge: int = config.vision_config.spatial_merge_size
        self.tokens_per_second: float = float(
            getattr(config.vision_config, "tokens_per_second", 1) or 1
        )
        self.rows: dict[int, _Row] = {}
        self.encoder_cache: dict[str, _CacheEntry] = {}
        self.num_encoded = 0  # items run through the vision encoder (tests, stats)

    # ---- per-request state -------------------------------------------------------------
    def add_request(self, row: int, new: NewRequestData) -> None:
        if not new.mm_features:
            return  # text: positions are token indices in all three sections
        spans = [(f.offset, f.length, f.data) for f in new.mm_features]
        positions, starts, delta = prompt_mrope_positions(
            len(new.prompt_token_ids), spans, self.merge, self.tokens_per_second
        )
        pending = {f.identifier for f in new.mm_features if f.end > new.num_computed_tokens}
        self.rows[row] = _Row(list(new.mm_features), positions, starts, delta, pending)
        for identifier in pending:
            if identifier in self.encoder_cache:
                self._hold(row, identifier)

    def remove_request(self, row: int) -> None:
        state = self.rows.pop(row, None)
        if state is None:
            return
        for identifier in state.pending:
            self._release(identifier, row)

    # ---- inputs --------------------------------------------------------------------------
    def model_inputs(self, batch: InputBatch) -> ModelInputs:
        return ModelInputs(batch.input_ids, self._positions(batch), batch.attn_metadata)

    def dummy_inputs(self, metadata: AttentionMetadata) -> ModelInputs:
        positions = torch.arange(metadata.num_actual_tokens, device=self.device)
        return ModelInputs(torch.zeros_like(positions), positions.expand(3, -1), metadata)

    def _positions(self, batch: InputBatch) -> torch.Tensor:
        """[3, T]: a prompt token's stored M-RoPE position, a generated token's index plus
        the row's delta; text rows use the index itself."""
        index = batch.positions.cpu()
        out = index.expand(3, -1).clone()
        qsl = batch.attn_metadata.query_start_loc_cpu
        for i, row in enumerate(batch.rows.tolist()):
            state = self.rows.get(row)
            if state is None:
                continue
            start, end = qsl[i], qsl[i + 1]
            seg = index[start:end]
            in_prompt = seg < state.positions.shape[1]
            block = seg.expand(3, -1) + state.delta
            block[:, in_prompt] = state.positions[:, seg[in_prompt]]
            out[:, start:end] = block
        return out.to(self.device)

    # ---- around the forward --------------------------------------------------------------
    def pre_forward(self, batch: InputBatch, inputs: ModelInputs) -> None:
        """Encode the media the step's tokens reach (once per item, all in one encoder call),
        then merge their embeddings into the token embeddings at the scheduled positions."""
        spans = self._scheduled_spans(batch)
        rewritten = self._encode_missing([span.feature for span in spans])
        done: list[tuple[str, int]] = []
        for row, last in {(span.row, span.last) for span in spans}:
            state = self.rows[row]
            for identifier in list(state.pending):
                if all(f.end <= last for f in state.features if f.identifier == identifier):
                    state.pending.discard(identifier)
                    done.append((identifier, row))
        if spans:
            embeds = self.model.embed_input_ids(inputs.input_ids)  # type: ignore[operator]
            for span in spans:
                emb = self.encoder_cache[span.feature.identifier].embeds[span.lo : span.hi]
                embeds[span.at : span.at + span.hi - span.lo] = emb.to(embeds.dtype)
            inputs.inputs_embeds = embeds
        if rewritten:
            inputs.positions = self._positions(batch)
        for identifier, row in done:  # after the gather: the embeddings are read above
            self._release(identifier, row)

    def _scheduled_spans(self, batch: InputBatch) -> list[_Span]:
        """The parts of media items the step's tokens reach."""
        spans = []
        qsl = batch.attn_metadata.query_start_loc_cpu
        index = batch.positions.cpu()
        for i, row in enumerate(batch.rows.tolist()):
            state = self.rows.get(row)
            if state is None or qsl[i + 1] == qsl[i]:
                continue
            first, last = int(index[qsl[i]]), int(index[qsl[i + 1] - 1]) + 1
            for f in state.features:
                lo, hi = max(first, f.offset), min(last, f.end)
                if lo < hi:
                    at = qsl[i] + lo - first
                    spans.append(_Span(row, last, f, at, lo - f.offset, hi - f.offset))
        return spans

    # ---- encoder cache ---------------------------------------------------------------------
    def _encode_missing(self, features: list[MultiModalFeature]) -> bool:
        """Run the vision encoder once over every item not cached yet (items never attend
        to each other, so one call equals one per item); True when positions changed."""
        missing = {f.identifier: f for f in features if f.identifier not in self.encoder_cache}
        if not missing:
            return False
        items = list(missing.values())
        media: list[MediaInput] = [f.data for f in items]
        pixels = torch.cat([m.pixel_values for m in media])
        grid = torch.tensor([m.grid_thw for m in media], dtype=torch.int64)
        embeds = self.model.embed_media(pixels, grid)  # type: ignore[operator]
        sizes = [t * h * w // self.merge**2 for t, h, w in grid.tolist()]
        changed = False
        for feature, item_embeds in zip(items, embeds.split(sizes), strict=True):
            entry = _CacheEntry(self.select_tokens(feature, item_embeds))
            self.encoder_cache[feature.identifier] = entry
            self.num_encoded += 1
            changed |= self._on_encoded(feature.identifier)
        return changed

    def select_tokens(self, feature: MultiModalFeature, embeds: torch.Tensor) -> torch.Tensor:
        """The encoder's tokens that fill the item's placeholders (all of them here; the
        pruning state keeps a subset)."""
        return embeds

    def _on_encoded(self, identifier: str) -> bool:
        """An item was encoded: every row still needing it holds the cache entry (so a
        request that reaches the item later does not encode it again) and updates its
        positions; True when any position changed."""
        changed = False
        for row, state in self.rows.items():
            if identifier in state.pending:
                changed |= self._hold(row, identifier)
        return changed

    def _hold(self, row: int, identifier: str) -> bool:
        """Row `row` needs the cached item `identifier`; True when its positions changed."""
        self.encoder_cache[identifier].rows.add(row)
        changed = False
        for k, feature in enumerate(self.rows[row].features):
            if feature.identifier == identifier:
                changed |= self.on_cached_item(row, k)
        return changed

    def on_cached_item(self, row: int, k: int) -> bool:
        """Row `row`'s feature `k` now has encoder output; True when its positions changed
        (nothing to do without pruning)."""
        return False

    def full_grid_positions(self, row: int, k: int) -> torch.Tensor:
        """[3, t*h*w] positions of every merged token of the row's feature `k`, unpruned."""
        state = self.rows[row]
        return media_positions(
            state.features[k].data, state.starts[k], self.merge, self.tokens_per_second
        )

    def _release(self, identifier: str, row: int) -> None:
        entry = self.encoder_cache.get(identifier)
        if entry is None:
            return
        entry.rows.discard(row)
        if not entry.rows:
            del self.encoder_cache[identifier]
