"""AudioStream: one request's received audio, growing while the request runs (realtime models).

This is the whole interface between the engine (streaming input, scheduler gating) and the
realtime model state (Voxtral Realtime):

- A realtime request carries its audio as `MultiModalFeature(modality="audio", data=stream)`;
  every audio feature of one request holds the *same* AudioStream object.
- `stream.append(samples)` adds received audio (mono, at `config.sampling_rate`); `end()` says
  no more will come. Both belong on the engine thread (the runner reads the stream there).
- `stream.positions_ready()`: how many decoder positions have all their audio now. Position
  p (0-based) may be computed only when p < positions_ready(); the scheduler schedules a
  request's tokens [num_computed, min(num_tokens, positions_ready())) and waits otherwise.
- `stream.sequence_limit()`: once ended, the total sequence length (prompt + output tokens)
  the request stops at, as HF's generate does (one token per audio position); None while
  audio may still come.
- `stream.chunk_feature(start, end)`: a MultiModalFeature for decoder positions [start, end)
  whose identifier hashes the samples those positions read, for the prefix cache's block
  keys (append one per newly ready range to `request.mm_features`).

Decoder position p reads mel frames [p * F, (p + 1) * F) (F = `mel_frames_per_position`);
mel frame k is centred on sample k * hop and reads samples [k*hop - n_fft/2, k*hop + n_fft/2),
reflect-padded at both ends of the audio, so frame k is final once sample k*hop + n_fft/2 has
arrived (or the audio ended). The last STFT frame is dropped, as the feature extractor does:
N samples give N // hop mel frames.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass

import numpy as np

from tinyvllm.request import MultiModalFeature


@dataclass(frozen=True)
class AudioFrameConfig:
    """How received samples map to mel frames and decoder positions (from the model's
    feature-extractor settings and `audio_length_per_tok`)."""

    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    num_mel_bins: int = 128
    mel_frames_per_position: int = 8
    # log10-mel clamp floor is this max - 8 (None: the audio's own max, which no stream knows)
    global_log_mel_max: float | None = 1.5

    @property
    def samples_per_position(self) -> int:
        return self.hop_length * self.mel_frames_per_position

    def mel_frames_ready(self, num_samples: int, ended: bool) -> int:
        """Mel frames whose values no later sample can change."""
        total = num_samples // self.hop_length
        if ended:
            # Reflect padding needs more samples than the pad (n_fft / 2).
            return total if num_samples > self.n_fft // 2 else 0
        # Frame k reads up to sample k*hop + n_fft/2 - 1 and, reflected, sample n_fft/2.
        if num_samples <= self.n_fft // 2:
            return 0
        return min(total, (num_samples - self.n_fft // 2) // self.hop_length + 1)

    def positions_ready(self, num_samples: int, ended: bool) -> int:
        return self.mel_frames_ready(num_samples, ended) // self.mel_frames_per_position

    def sequence_limit(self, num_samples: int) -> int:
        """Total tokens HF's generate stops at for audio of `num_samples` samples:
        ceil(mel frames / frames per position)."""
        frames = num_samples // self.hop_length
        return math.ceil(frames / self.mel_frames_per_position)


class AudioStream:
    """A request's audio samples (float32 mono at `config.sampling_rate`) and whether more
    may come. Appending after `end()` is an error; reading never blocks."""

    def __init__(
        self, config: AudioFrameConfig, samples: np.ndarray | None = None, ended: bool = False
    ) -> None:
        self.config = config
        self._chunks: list[np.ndarray] = []
        self._num_samples = 0
        self._ended = False
        self._lock = threading.Lock()
        if samples is not None:
            self.append(samples)
        if ended:
            self.end()

    # ---- writer side (engine) ----------------------------------------------------------
    def append(self, samples: np.ndarray) -> None:
        """Add received samples: float32 in [-1, 1] or int16 PCM, 1-D (mono)."""
        chunk = as_float_mono(samples)
        with self._lock:
            if self._ended:
                raise ValueError(
                    "audio arrived after the end of this request's input; start a new "
                    "request for more audio"
                )
            if chunk.size:
                self._chunks.append(chunk)
                self._num_samples += chunk.size

    def end(self) -> None:
        """No more audio will come: the last frames are computed with end padding."""
        with self._lock:
            self._ended = True

    # ---- reader side (scheduler, model state) --------------------------------------------
    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def samples(self) -> np.ndarray:
        """Every sample received so far (one array; later appends do not change it)."""
        with self._lock:
            if len(self._chunks) > 1:
                self._chunks = [np.concatenate(self._chunks)]
            return self._chunks[0] if self._chunks else np.zeros(0, dtype=np.float32)

    def positions_ready(self) -> int:
        """Decoder positions whose audio has fully arrived (see the module docstring)."""
        return self.config.positions_ready(self._num_samples, self._ended)

    def sequence_limit(self) -> int | None:
        """Once ended: the total sequence length the request stops at; None before."""
        return self.config.sequence_limit(self._num_samples) if self._ended else None

    def content_hash(self, start_sample: int = 0, end_sample: int | None = None) -> str:
        """sha256 of the frame settings and samples [start, end) (all by default)."""
        h = hashlib.sha256(repr(self.config).encode())
        h.update(self.samples()[start_sample:end_sample].tobytes())
        return h.hexdigest()

    def chunk_feature(self, start: int, end: int) -> MultiModalFeature:
        """The audio feature of decoder positions [start, end): its identifier hashes the
        samples those positions' mel frames read (earlier audio is in the parent blocks'
        hashes, so a prefix-cache block matches only after the same audio)."""
        cfg = self.config
        first = max(0, start * cfg.samples_per_position - cfg.n_fft // 2)
        last = end * cfg.samples_per_position + cfg.n_fft // 2
        if self._ended:  # the end padding reflects the final samples: hash up to the end
            last = self._num_samples
        return MultiModalFeature("audio", self.content_hash(first, last), start, end - start, self)


def as_float_mono(samples: np.ndarray) -> np.ndarray:
    """1-D float32 samples from float or int16 PCM; ValueError naming the shape otherwise."""
    array = np.asarray(samples)
    if array.ndim != 1:
        raise ValueError(
            f"audio must be mono (a 1-D array of samples), got shape {array.shape}; "
            "down-mix it first, e.g. samples.mean(axis=1) for (num_samples, channels)"
        )
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(
            f"audio samples must be float32 in [-1, 1] or int16 PCM, got dtype {array.dtype}"
        )
    return array.astype(np.float32, copy=False)


def audio_stream_of(features: list[MultiModalFeature]) -> AudioStream | None:
    """The request's AudioStream (the data of its audio features), None without audio."""
    for feature in features:
        if feature.modality == "audio" and isinstance(feature.data, AudioStream):
            return feature.data
    return None
