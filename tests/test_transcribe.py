"""`tinyvllm transcribe FILE.wav [--realtime]` on a tiny random Voxtral Realtime checkpoint:
the streamed transcript equals the offline request's text; bad files fail with one clear
error before the model loads."""

from __future__ import annotations

import time
import wave
from pathlib import Path

import numpy as np
import pytest
from voxtral_realtime_fixtures import build_tiny_voxtral, random_audio

from tinyvllm import LLM, SamplingParams
from tinyvllm.cli import main
from tinyvllm.engine.transcription import streaming_prompt_ids
from tinyvllm.multimodal.audio import load_wav

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def vox_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_voxtral(tmp_path_factory.mktemp("voxtral_rt_cli"), tokenizer_dir)


@pytest.fixture(scope="module")
def vox_llm(vox_dir: Path) -> LLM:
    return LLM(str(vox_dir), dtype="float32")


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> Path:
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1 if pcm.ndim == 1 else pcm.shape[1])
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.tobytes())
    return path


def offline_text(llm: LLM, wav: Path) -> str:
    """The offline request's transcript of the file (all audio known up front)."""
    samples, rate = load_wav(wav)
    prompt = {
        "prompt_token_ids": streaming_prompt_ids(llm.engine),
        "multi_modal_data": {"audio": (samples, rate)},
    }
    params = SamplingParams(temperature=0.0, max_tokens=1000)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def transcribe(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["transcribe", *args, "--dtype", "float32"])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("rate", [16000, 8000])
def test_transcript_matches_the_offline_request(
    vox_dir: Path, vox_llm: LLM, tmp_path: Path, capsys, rate: int
) -> None:
    """Fed as fast as possible in 80 ms chunks; an 8 kHz file is resampled first."""
    wav = write_wav(tmp_path / "a.wav", random_audio(1.37, seed=1)[:: 16000 // rate], rate)
    expected = offline_text(vox_llm, wav)
    assert expected
    code, out, err = transcribe(capsys, str(wav), "--model", str(vox_dir))
    assert code == 0, err
    assert out == expected + "\n"
    assert "real-time factor" in err


def test_realtime_pace_streams_the_same_text(
    vox_dir: Path, vox_llm: LLM, tmp_path: Path, capsys
) -> None:
    wav = write_wav(tmp_path / "b.wav", random_audio(0.5, seed=2))
    expected = offline_text(vox_llm, wav)
    start = time.monotonic()
    code, out, err = transcribe(
        capsys, str(wav), "--model", str(vox_dir), "--realtime", "--chunk-ms", "40"
    )
    assert code == 0, err
    assert time.monotonic() - start >= 0.5  # the audio took its own time to "arrive"
    assert out == expected + "\n"
    assert "after the audio ended" in err


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        (np.zeros((3200, 2), dtype=np.float32), "must be mono"),
        (np.zeros(0, dtype=np.float32), "empty"),
    ],
    ids=["stereo", "empty"],
)
def test_bad_files_fail_before_the_model_loads(
    tmp_path: Path, capsys, samples: np.ndarray, message: str
) -> None:
    wav = write_wav(tmp_path / "bad.wav", samples)
    # No model exists at this path: the file's error must come first.
    code, out, err = transcribe(capsys, str(wav), "--model", str(tmp_path / "nowhere"))
    assert code == 2 and out == ""
    assert err.startswith(f"tinyvllm: error: {wav}:") and message in err


def test_missing_file_and_text_only_model(tiny_models, tmp_path: Path, capsys) -> None:
    code, _, err = transcribe(capsys, str(tmp_path / "missing.wav"))
    assert code == 2 and "no such audio file" in err
    wav = write_wav(tmp_path / "c.wav", random_audio(0.3, seed=3))
    code, _, err = transcribe(capsys, str(wav), "--model", str(tiny_models["llama"]))
    assert code == 2 and "is not a realtime speech model" in err
    code, _, err = transcribe(capsys, str(wav), "--chunk-ms", "0")
    assert code == 2 and "--chunk-ms must be positive" in err
