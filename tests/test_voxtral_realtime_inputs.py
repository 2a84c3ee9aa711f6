"""Audio inputs for realtime speech models: log-mel frames against transformers' feature
extractor (whole audio and frame by frame as a stream grows), WAV reading, resampling, the
AudioStream readiness rules, and one clear error per bad input."""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from voxtral_realtime_fixtures import (
    MEL_BINS,
    PROMPT,
    build_tiny_voxtral,
    hf_features,
    make_llm,
    random_audio,
)

from tinyvllm import LLM, SamplingParams
from tinyvllm.multimodal.audio import audio_samples, load_wav, resample
from tinyvllm.multimodal.audio_stream import AudioFrameConfig, AudioStream
from tinyvllm.multimodal.log_mel import LogMel

CFG = AudioFrameConfig(num_mel_bins=MEL_BINS)


def wav_bytes(samples: np.ndarray, rate: int, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 2:
            w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
        else:
            w.writeframes(bytes(samples.size * width))
    return buf.getvalue()


def test_log_mel_matches_feature_extractor_whole_and_streamed() -> None:
    clip = random_audio(1.0, seed=0)[:15_937]  # not a whole number of hops
    want = hf_features(clip)[0]
    mel = LogMel(CFG)
    torch.testing.assert_close(mel.frames(clip, 0, want.shape[1], True), want)
    # A stream growing by odd-sized pieces: every frame computed once, as soon as ready.
    got, done = [], 0
    for end in range(0, clip.size + 1, 777):
        ended = end >= clip.size - 777 + 1
        received = clip[: clip.size if ended else end]
        ready = CFG.mel_frames_ready(received.size, ended)
        got.append(mel.frames(received, done, ready, ended))
        done = ready
    assert done == want.shape[1] == clip.size // 160
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=1e-5)


def test_stream_readiness_and_end() -> None:
    stream = AudioStream(CFG)
    assert stream.positions_ready() == 0 and stream.sequence_limit() is None
    # Position 0 reads mel frames 0..7; frame 7 reads up to sample 7 * 160 + 199.
    stream.append(np.zeros(7 * 160 + 199, dtype=np.float32))
    assert stream.positions_ready() == 0
    stream.append(np.zeros(1, dtype=np.int16))
    assert stream.positions_ready() == 1
    stream.append(np.zeros(1280 * 3, dtype=np.float32))
    assert stream.positions_ready() == 4
    stream.end()
    # 5160 samples -> 32 frames: 4 positions, and HF's sequence length ceil(32 / 8) = 4.
    assert stream.positions_ready() == 4 and stream.sequence_limit() == 4
    with pytest.raises(ValueError, match="after the end of this request's input"):
        stream.append(np.zeros(10, dtype=np.float32))
    with pytest.raises(ValueError, match="mono"):
        AudioStream(CFG).append(np.zeros((10, 2), dtype=np.float32))


def test_chunk_features_hash_the_samples_their_positions_read() -> None:
    """A chunk feature's identifier (the prefix cache's extra key) changes with a sample its
    positions read, and only with those."""
    clip = random_audio(0.5, seed=4)
    one, two = AudioStream(CFG, clip), AudioStream(CFG, clip.copy())
    assert one.chunk_feature(1, 3).identifier == two.chunk_feature(1, 3).identifier
    feature = one.chunk_feature(1, 3)
    assert (feature.offset, feature.length, feature.data) == (1, 2, one)
    changed = clip.copy()
    changed[2 * 1280] += 0.1  # read by position 2
    assert AudioStream(CFG, changed).chunk_feature(1, 3).identifier != feature.identifier
    changed = clip.copy()
    changed[5 * 1280] += 0.1  # read by position 5 only
    assert AudioStream(CFG, changed).chunk_feature(1, 3).identifier == feature.identifier


def test_wav_reading_and_resampling() -> None:
    clip = random_audio(0.5, seed=1)
    samples, rate = load_wav(wav_bytes(clip, 16000))
    assert rate == 16000 and np.abs(samples - clip).max() < 1e-4
    # 8 kHz and 44.1 kHz tones come back at 16 kHz as the same tone (band-limited).
    for source_rate in (8000, 44100):
        t = np.arange(source_rate) / source_rate
        tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
        out = audio_samples((tone, source_rate), 16000)
        want = np.sin(2 * np.pi * 440 * np.arange(out.size) / 16000)
        assert out.size == 16000 and np.abs(out - want)[200:-200].max() < 1e-3
    # A 12 kHz tone at 48 kHz is above the new Nyquist frequency: filtered out, not aliased
    # (to 4 kHz).
    high = np.sin(2 * np.pi * 12000 * np.arange(48000) / 48000).astype(np.float32)
    assert np.abs(resample(high, 48000, 16000)[200:-200]).max() < 0.05


def test_bad_audio_inputs() -> None:
    clip = random_audio(0.5, seed=2)
    with pytest.raises(ValueError, match=r"mono.*shape \(8000, 2\).*mean\(axis=1\)"):
        audio_samples((np.stack([clip, clip], axis=1), 16000), 16000)
    with pytest.raises(ValueError, match="empty"):
        audio_samples(np.zeros(0, dtype=np.float32), 16000)
    with pytest.raises(ValueError, match="float32 in \\[-1, 1\\] or int16"):
        audio_samples(np.zeros(100, dtype=np.int32), 16000)
    with pytest.raises(ValueError, match="sample rate must be a positive int"):
        audio_samples((clip, 0), 16000)
    stereo, _ = load_wav(wav_bytes(np.repeat(clip, 2), 16000, channels=2))
    assert stereo.shape == (clip.size, 2)
    with pytest.raises(ValueError, match="8-bit samples; only 16-bit PCM"):
        load_wav(wav_bytes(clip, 16000, width=1))
    with pytest.raises(ValueError, match="not a readable PCM WAV"):
        load_wav(b"RIFF....nonsense")


@pytest.fixture(scope="module")
def vox_llm(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LLM:
    return make_llm(build_tiny_voxtral(tmp_path_factory.mktemp("voxtral_in"), tokenizer_dir))


def generate(llm: LLM, audio: Any, prompt: list[int] = PROMPT) -> Any:
    request = {"prompt_token_ids": prompt, "multi_modal_data": {"audio": audio}}
    return llm.generate(request, SamplingParams(max_tokens=50, temperature=0.0), use_tqdm=False)


def test_engine_audio_inputs(vox_llm: LLM, tiny_models: Any) -> None:
    """Every accepted form of the same audio gives the same tokens; each bad request fails
    alone with one clear error; a text-only model refuses audio."""
    clip = random_audio(0.6, seed=3)
    tokens = generate(vox_llm, (clip, 16000))[0].outputs[0].token_ids
    assert len(PROMPT) + len(tokens) == -(-(clip.size // 160) // 8)
    pcm16 = (clip * 32767).astype(np.int16)
    for form in (clip, [clip], wav_bytes(clip, 16000), (pcm16, 16000)):
        assert generate(vox_llm, form)[0].outputs[0].token_ids == tokens
    # A text prompt is tokenized as usual (the ids, not the text, meet the audio).
    ids = vox_llm.get_tokenizer().encode("hello there")
    text = {"prompt": "hello there", "multi_modal_data": {"audio": clip}}
    greedy = SamplingParams(max_tokens=50, temperature=0.0)
    by_text = vox_llm.generate(text, greedy, use_tqdm=False)[0]
    assert by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == generate(vox_llm, clip, ids)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="mono"):
        generate(vox_llm, np.stack([clip, clip]))
    with pytest.raises(ValueError, match="empty"):
        generate(vox_llm, np.zeros(0, dtype=np.float32))
    with pytest.raises(ValueError, match="exactly one audio stream"):
        generate(vox_llm, [clip, clip])
    with pytest.raises(ValueError, match="'audio' only"):
        vox_llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": clip}})
    with pytest.raises(ValueError, match="this model transcribes audio"):
        vox_llm.generate({"prompt_token_ids": PROMPT})
    with pytest.raises(ValueError, match="nothing is left to transcribe"):
        generate(vox_llm, clip[:1400], prompt=[1, 2, 3])
    # The engine still serves after the refusals.
    assert generate(vox_llm, clip)[0].outputs[0].token_ids == tokens
    text_only = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64,
                    enforce_eager=True, kv_cache_memory_bytes=2**20)  # fmt: skip
    with pytest.raises(ValueError, match=r"cannot take audio.*Voxtral Realtime"):
        text_only.generate({"prompt": "hi", "multi_modal_data": {"audio": clip}})
