"""RealtimeModelState: speech models whose every decoder position, prompt and decode, gets the
audio embedding of its own 80 ms added to its token embedding (Voxtral Realtime; vLLM MRv2's
realtime models).

Each request row keeps an encoder cache: its AudioStream (the received samples, growing while
the request runs), the causal encoder's streaming state (convolution tails, attention keys and
values in the window) and the audio embeddings computed but not yet consumed. Before a forward
the state encodes what the scheduled positions need (once per new audio; up to
`ENCODE_AHEAD` positions more when their audio is in, so an offline request encodes in a few
larger chunks rather than one position per step; rows encoding chunks of one size, such
as concurrent streams each bringing one position, share one batched encoder call), gathers
each row's slice and passes `inputs_embeds` = token embeddings + audio embeddings, on decode
steps too. The runner therefore never takes the CUDA-graph or native-decode fast paths for
this model (`flat_positions` False: they embed token ids themselves).

A preempted or finished row drops its cache; a resumed request re-encodes from the start of
its received audio (the encoder is causal: later frames need the earlier ones' state), which
also covers a prefix-cache hit. A scheduled position whose audio has not arrived is the
scheduler's error (it gates on `AudioStream.positions_ready()`): RuntimeError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.core.outputs import NewRequestData
from tinyvllm.models.voxtral_realtime_encoder import EncoderStreamState
from tinyvllm.multimodal.audio_stream import AudioStream, audio_stream_of
from tinyvllm.multimodal.log_mel import LogMel
from tinyvllm.runner.input_batch import InputBatch
from tinyvllm.runner.model_states.interface import ModelInputs, ModelState

# Positions encoded beyond what a step needs, when their audio is in (bounds one encoder
# call's size too: its attention is over ENCODE_AHEAD x 4 frames plus the window).
ENCODE_AHEAD = 32


@dataclass
class _Row:
    stream: AudioStream
    encoder: EncoderStreamState
    embeds: torch.Tensor  # [n, hidden]: audio embeddings of positions [base, base + n)
    base: int = 0

    @property
    def encoded(self) -> int:
        return self.base + self.embeds.shape[0]


class RealtimeModelState(ModelState):
    flat_positions: ClassVar[bool] = False

    def __init__(self, model: nn.Module, max_num_reqs: int, device: torch.device) -> None:
        super().__init__(model, max_num_reqs, device)
        self.tower = model.audio_tower
        self.hidden: int = model.model.norm.weight.shape[0]
        self.rows: dict[int, _Row] = {}
        self._log_mel: LogMel | None = None
        self.num_encoded_positions = 0  # positions run through the encoder (for tests, stats)

    # ---- per-request state ---------------------------------------------------------------
    def add_request(self, row: int, new: NewRequestData) -> None:
        stream = audio_stream_of(new.mm_features)
        if stream is None:
            raise ValueError(
                f"request {new.req_id} has no audio; this speech model needs "
                "multi_modal_data={'audio': ...}"
            )
        empty = torch.empty(0, self.hidden, dtype=self._dtype, device=self.device)
        self.rows[row] = _Row(stream, self.tower.new_state(), empty)

    def remove_request(self, row: int) -> None:
        self.rows.pop(row, None)

    # ---- inputs ----------------------------------------------------------------------------
    def model_inputs(self, batch: InputBatch) -> ModelInputs:
        return ModelInputs(batch.input_ids, batch.positions, batch.attn_metadata)

    def dummy_inputs(self, metadata: AttentionMetadata) -> ModelInputs:
        n = metadata.num_actual_tokens
        positions = torch.arange(n, device=self.device)
        embeds = torch.zeros(n, self.hidden, dtype=self._dtype, device=self.device)
        return ModelInputs(torch.zeros_like(positions), positions, metadata, embeds)

    def pre_forward(self, batch: InputBatch, inputs: ModelInputs) -> None:
        qsl = batch.attn_metadata.query_start_loc_cpu
        positions = batch.positions.cpu()
        spans: list[tuple[int, int, int]] = []  # (row, first position, end)
        for i, row in enumerate(batch.rows.tolist()):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if hi > lo:
                first = int(positions[lo])
                spans.append((row, first, first + hi - lo))
        self._encode({row: end for row, _, end in spans})
        embeds = self.model.embed_input_ids(inputs.input_ids)  # type: ignore[operator]
        if spans:
            audio = torch.cat([self._take(row, first, end) for row, first, end in spans])
            embeds[: audio.shape[0]] += audio
        inputs.inputs_embeds = embeds

    # ---- encoder cache ---------------------------------------------------------------------
    @property
    def _dtype(self) -> torch.dtype:
        return self.model.model.norm.weight.dtype  # type: ignore[union-attr]

    def _take(self, row: int, first: int, end: int) -> torch.Tensor:
        """Audio embeddings [end - first, hidden] of decoder positions [first, end)."""
        state = self.rows[row]
        if first < state.base:
            raise RuntimeError(
                f"position {first} was scheduled again after its audio embedding was consumed"
            )
        out = state.embeds[first - state.base : end - state.base]
        # Earlier positions are never read again (a resumed request starts a new row).
        state.embeds, state.base = state.embeds[first - state.base :], first
        return out

    def _encode(self, needs: dict[int, int]) -> None:
        """Encode every row's audio up to what its scheduled positions need (and up to
        ENCODE_AHEAD positions more when the audio is in); rows encoding chunks of one size
        share each encoder call."""
        targets: dict[int, int] = {}
        for row, need in needs.items():
            state = self.rows[row]
            if state.encoded >= need:
                continue
            stream = state.stream
            ready = stream.positions_ready()
            if need > ready:
                raise RuntimeError(
                    f"decoder position {need - 1} was scheduled but only {ready} positions "
                    f"have their audio ({stream.num_samples} samples received, ended="
                    f"{stream.ended}); the scheduler must gate on AudioStream.positions_ready()"
                )
            targets[row] = min(ready, max(need, state.encoded + ENCODE_AHEAD))
        while targets:
            groups: dict[int, list[int]] = {}
            for row, upto in targets.items():
                size = min(ENCODE_AHEAD, upto - self.rows[row].encoded)
                groups.setdefault(size, []).append(row)
            for size, rows in groups.items():
                self._encode_chunk(rows, size)
            targets = {r: u for r, u in targets.items() if self.rows[r].encoded < u}

    def _encode_chunk(self, rows: list[int], size: int) -> None:
        """The next `size` positions of each of `rows`, in one encoder call."""
        mels = []
        for row in rows:
            state = self.rows[row]
            stream = state.stream
            if self._log_mel is None or self._log_mel.config != stream.config:
                self._log_mel = LogMel(stream.config)
            per = stream.config.mel_frames_per_position
            first = state.encoded * per
            mel = self._log_mel.frames(stream.samples(), first, first + size * per, stream.ended)
            mels.append(mel.to(self.device))
        encoded = self.tower.encode_many(mels, [self.rows[r].encoder for r in rows])
        for row, new in zip(rows, encoded, strict=True):
            state = self.rows[row]
            state.embeds = torch.cat([state.embeds, new.to(self._dtype)])
        self.num_encoded_positions += size * len(rows)
