"""Audio inputs: WAV files (standard-library `wave`), sample-rate conversion, validation.

What a prompt's `multi_modal_data={"audio": item}` may hold (vLLM's shapes):
- `(samples, sample_rate)`: a 1-D float array in [-1, 1] or int16 PCM, at any rate (resampled);
- `samples` alone: taken to be at the model's rate (16 kHz for Voxtral Realtime);
- a WAV file: a path, `file://` URL or the file's bytes (PCM16, mono).
Stereo is refused (down-mix it first: `samples.mean(axis=1)`), as is empty audio: a model
cannot transcribe what is not there, and an accidental down-mix would hide a wrong channel.
"""

from __future__ import annotations

import io
import math
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tinyvllm.multimodal.audio_stream import as_float_mono
from tinyvllm.multimodal.media import MediaSource, resolve_media


def load_wav(source: MediaSource) -> tuple[np.ndarray, int]:
    """(float32 samples in [-1, 1], shape (n,) mono or (n, channels), sample rate) of a PCM16
    WAV file; ValueError naming the file and what is wrong."""
    name = source if isinstance(source, str | Path) else "<bytes>"
    resolved = resolve_media(source, "audio")
    data = resolved if isinstance(resolved, bytes) else resolved.read_bytes()
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            width, channels, rate = wav.getsampwidth(), wav.getnchannels(), wav.getframerate()
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"audio {name!s}: not a readable PCM WAV file ({exc})") from None
    if width != 2:
        raise ValueError(
            f"audio {name!s}: {8 * width}-bit samples; only 16-bit PCM WAV is read (convert "
            "it, e.g. `ffmpeg -i in.wav -c:a pcm_s16le out.wav`)"
        )
    samples = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        samples = samples.reshape(-1, channels)
    return samples, rate


def resample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """Band-limited resampling (polyphase windowed sinc: each output sample is the Hann-windowed
    sinc interpolation of the input around its time, low-passed below the lower Nyquist
    frequency so down-sampling does not alias). Float32 in, float32 out."""
    if orig_rate == new_rate:
        return samples
    g = math.gcd(orig_rate, new_rate)
    up, down = new_rate // g, orig_rate // g
    cutoff = 0.99 * min(1.0, up / down)  # in units of the input's Nyquist frequency
    half_width = math.ceil(6 / cutoff)  # zero crossings of the sinc on each side
    x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    # Output sample j of each group of `up` sits at input time j * down / up + k (k = group);
    # one FIR filter per phase j.
    taps = torch.arange(-half_width, half_width + 1, dtype=torch.float64)
    phase = torch.arange(up, dtype=torch.float64)[:, None] * down / up
    offsets = torch.floor(phase)
    t = taps[None, :] - (phase - offsets)  # distance from each tap to the output instant
    window = torch.where(
        t.abs() <= half_width, 0.5 + 0.5 * torch.cos(math.pi * t / half_width), 0.0
    )
    kernels = (cutoff * torch.sinc(cutoff * t) * window).float()  # [up, taps]
    num_out = math.ceil(x.numel() * up / down)
    padded = F.pad(x[None, None], (half_width, half_width + down + 1))
    # Each phase j reads the input every `down` samples, shifted by floor(j * down / up).
    out = torch.empty(up, -(-num_out // up))
    for j in range(up):
        shift = int(offsets[j, 0])
        seg = padded[..., shift:]
        y = F.conv1d(seg, kernels[j].view(1, 1, -1), stride=down)[0, 0]
        out[j, : min(y.numel(), out.shape[1])] = y[: out.shape[1]]
    return out.T.reshape(-1)[:num_out].numpy()


def audio_samples(item: Any, rate: int, index: int = 0) -> np.ndarray:
    """One `multi_modal_data` audio item -> float32 mono samples at `rate`; ValueError naming
    the item and the fix."""
    where = f"audio {index}"
    if isinstance(item, str | Path | bytes):
        samples, item_rate = load_wav(item)
    elif isinstance(item, tuple) and len(item) == 2:
        samples, item_rate = item
        if item_rate is None:
            item_rate = rate
    else:
        samples, item_rate = item, rate
    if not isinstance(item_rate, int) or item_rate <= 0:
        raise ValueError(f"{where}: sample rate must be a positive int, got {item_rate!r}")
    if isinstance(samples, torch.Tensor):
        samples = samples.numpy()
    if not isinstance(samples, np.ndarray):
        raise ValueError(
            f"{where}: expected a numpy array of samples, (array, sample_rate) or a WAV file, "
            f"got {type(samples).__name__}"
        )
    if samples.ndim == 2 and 1 in samples.shape:
        samples = samples.reshape(-1)  # (n, 1) or (1, n): already mono
    if samples.ndim != 1:
        raise ValueError(
            f"{where}: audio must be mono, got shape {samples.shape} (stereo?); down-mix it "
            "first, e.g. samples.mean(axis=1)"
        )
    if samples.size == 0:
        raise ValueError(f"{where}: the audio is empty (0 samples)")
    return resample(as_float_mono(samples), item_rate, rate)
