"""Log-mel features for Voxtral Realtime, computed for any range of frames of a growing audio.

The same values as transformers' VoxtralRealtimeFeatureExtractor on the whole audio (STFT with
a periodic Hann window, centred frames with reflect padding, power spectrum, Slaney mel
filters, log10 clamped to 8 below `global_log_mel_max`, then (x + 4) / 4), but frame by frame:
frame k depends only on samples [k*hop - n_fft/2, k*hop + n_fft/2), so a stream computes each
frame once, when its samples are in (`AudioFrameConfig.mel_frames_ready`).
"""

from __future__ import annotations

import numpy as np
import torch

from tinyvllm.multimodal.audio_stream import AudioFrameConfig


class LogMel:
    """The mel filters and window for one `AudioFrameConfig` (built once per model)."""

    def __init__(self, config: AudioFrameConfig) -> None:
        from transformers.audio_utils import mel_filter_bank

        self.config = config
        filters = mel_filter_bank(
            num_frequency_bins=1 + config.n_fft // 2,
            num_mel_filters=config.num_mel_bins,
            min_frequency=0.0,
            max_frequency=config.sampling_rate / 2,
            sampling_rate=config.sampling_rate,
            norm="slaney",
            mel_scale="slaney",
        )
        self.filters_t = torch.from_numpy(np.ascontiguousarray(filters.T)).float()
        self.window = torch.hann_window(config.n_fft)

    def frames(self, samples: np.ndarray, start: int, end: int, ended: bool) -> torch.Tensor:
        """Mel frames [start, end) of `samples` -> float32 [num_mel_bins, end - start].

        `ended`: the audio ends after `samples` (the last frames reflect its end); otherwise
        the caller asks only for frames that are ready."""
        cfg = self.config
        pad = cfg.n_fft // 2
        if end <= start:
            return torch.zeros(cfg.num_mel_bins, 0)
        x = torch.from_numpy(np.asarray(samples, dtype=np.float32))
        # The padded signal's sample i is the audio's sample i - pad; only the pieces frames
        # [start, end) read are built.
        lo, hi = start * cfg.hop_length, (end - 1) * cfg.hop_length + cfg.n_fft
        parts = []
        if lo < pad:  # left reflection: audio samples pad - i for i in [lo, pad)
            parts.append(x[1 : pad - lo + 1].flip(0))
        parts.append(x[max(lo - pad, 0) : min(hi - pad, x.numel())])
        overrun = hi - pad - x.numel()
        if overrun > 0:
            if not ended:
                raise ValueError(
                    f"mel frame {end - 1} needs {overrun} samples that have not arrived yet"
                )
            parts.append(x[-overrun - 1 : -1].flip(0))  # right reflection
        segment = torch.cat(parts)
        spectrum = torch.stft(
            segment, cfg.n_fft, cfg.hop_length, window=self.window, center=False,
            return_complex=True,
        )  # fmt: skip
        power = spectrum.abs() ** 2
        mel = self.filters_t @ power
        log_spec = torch.clamp(mel, min=1e-10).log10()
        ceiling = cfg.global_log_mel_max
        floor = (log_spec.max() if ceiling is None else torch.tensor(ceiling)) - 8.0
        log_spec = torch.maximum(log_spec, floor)
        return (log_spec + 4.0) / 4.0
