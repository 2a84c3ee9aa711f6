"""Realtime speech-to-text on a desktop-sized Voxtral-Realtime-shaped random model: per-step
latency and real-time factor (compute time / audio time), one stream and N concurrent ones.

The model has Voxtral Realtime's architecture (causal audio encoder, projector, Mistral
decoder with time conditioning) at desktop size: a ~0.5B decoder (24 layers, hidden 1024,
head_dim 128, vocab 131072, tied) and a 12-layer 640-wide encoder, bf16, random weights (built
once, cached). Each stream is `--seconds` of synthetic audio given whole (offline:
`LLM.generate`-style requests through `Engine.add_request`), so the engine decodes one token
per 80 ms of audio; every step is timed. A stream keeps up with real time when its steps take
less than the audio they cover: RTF = wall time / audio time (< 1 is faster than real time).

    flock /tmp/tinyvllm-bench.lock python benchmarks/realtime.py             # 1 and 4 streams
    flock /tmp/tinyvllm-bench.lock python benchmarks/realtime.py --paced     # + real-time feed
    python benchmarks/realtime.py --quick                                    # 2-layer smoke run

`--paced` also feeds each stream's audio at real-time pace through an open AudioStream (the
engine's streaming input), one 80 ms position per step, and reports the lag from a
position's audio arriving to its token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import machine_info

TEXT: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "sliding_window": 8192, "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}  # fmt: skip
AUDIO: dict[str, Any] = {
    "hidden_size": 640, "intermediate_size": 2560, "num_hidden_layers": 12,
    "num_attention_heads": 10, "head_dim": 64, "num_mel_bins": 128, "sliding_window": 750,
}  # fmt: skip
PROMPT = [1] + [32] * 38  # [BOS] + streaming pad tokens: the real prompt's length (39)
# Silence before the audio, as the real processor left-pads it: the prompt's positions hear it.
LEFT_PAD_POSITIONS = 32
SECONDS_PER_POSITION = 0.08


def build_checkpoint(path: Path, quick: bool) -> Path:
    if (path / "config.json").exists():
        return path
    from transformers import VoxtralRealtimeConfig, VoxtralRealtimeForConditionalGeneration

    text, audio = dict(TEXT), dict(AUDIO)
    if quick:  # checks the script, says nothing about speed
        text |= {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                 "vocab_size": 4096}  # fmt: skip
        audio |= {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
                  "num_attention_heads": 2}  # fmt: skip
    config = VoxtralRealtimeConfig(text_config=text, audio_config=audio)
    torch.manual_seed(0)
    model = VoxtralRealtimeForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def checkpoint_sizes(path: Path) -> tuple[int, int]:
    """(decoder, encoder + projector) parameter counts from the checkpoint's tensors."""
    from safetensors import safe_open

    decoder = towers = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                numel = f.get_slice(name).get_shape()
                count = int(np.prod(numel))
                if "language_model" in name:
                    decoder += count
                else:
                    towers += count
    return decoder, towers


def synthetic_speechlike(seconds: float, seed: int) -> np.ndarray:
    """Tone bursts and pauses with noise (float32, 16 kHz)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    out = 0.01 * rng.standard_normal(n).astype(np.float32)
    for start in range(0, n, 1600):
        if rng.random() < 0.7:
            t = np.arange(min(1600, n - start)) / 16000
            out[start : start + t.size] += 0.3 * np.sin(2 * np.pi * rng.uniform(100, 3000) * t)
    return out


def run(engine: Any, clips: list[np.ndarray], tag: str) -> dict[str, Any]:
    """All `clips` as concurrent requests; every step timed."""
    from tinyvllm import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100_000)
    pad = np.zeros(LEFT_PAD_POSITIONS * 1280, dtype=np.float32)
    for i, clip in enumerate(clips):
        audio = (np.concatenate([pad, clip]), 16000)
        request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": audio}}
        engine.add_request(f"{tag}-{i}", request, params)
    steps: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    audio_s = clips[0].size / 16000
    decode = steps[1:]  # the first step is the prompt's prefill (and the first audio encode)
    return {
        "streams": len(clips),
        "audio_s_per_stream": audio_s,
        "steps": len(steps),
        "prefill_step_ms": round(1000 * steps[0], 1),
        "decode_step_ms_median": round(1000 * statistics.median(decode), 1),
        "decode_step_ms_p90": round(1000 * sorted(decode)[int(0.9 * (len(decode) - 1))], 1),
        "wall_s": round(wall, 2),
        # Every stream's audio took audio_s to arrive; all were transcribed in `wall`.
        "rtf": round(wall / audio_s, 3),
        "steady_rtf": round(statistics.median(decode) / SECONDS_PER_POSITION, 3),
    }


def run_paced(engine: Any, clips: list[np.ndarray], tag: str) -> dict[str, Any]:
    """The clips' audio arrives in real time (80 ms per position, the left pad at once): each
    step runs once the audio of the position it decodes is in. Reports the lag from a
    position's audio arriving to its token, and RTF = busy time / audio time."""
    from tinyvllm import SamplingParams
    from tinyvllm.multimodal.audio_stream import AudioStream

    cfg = engine.mm_processor.frame_config
    per, lookahead = cfg.samples_per_position, cfg.n_fft // 2
    pad = np.zeros(LEFT_PAD_POSITIONS * per, dtype=np.float32)
    audios = [np.concatenate([pad, clip]) for clip in clips]
    total = cfg.sequence_limit(audios[0].size)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=total - len(PROMPT))
    streams = []
    for i in range(len(audios)):
        stream = AudioStream(cfg)
        streams.append(stream)
        request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": stream}}
        engine.add_request(f"{tag}-{i}", request, params)
    start = time.perf_counter()
    busy, lags, steps = 0.0, [], []
    position = len(PROMPT)  # the step decodes up to this many positions
    while engine.has_unfinished_requests():
        # Position p's audio (samples up to (p + 1) * per + lookahead) arrives in real time.
        needed = min(audios[0].size, position * per + lookahead)
        arrival = start + max(0, needed - pad.size) / 16000
        time.sleep(max(0.0, arrival - time.perf_counter()))
        for stream, audio in zip(streams, audios, strict=True):
            stream.append(audio[stream.num_samples : needed])
            if needed == audio.size and not stream.ended:
                stream.end()
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        busy += t1 - t0
        steps.append(t1 - t0)
        lags.append(t1 - max(arrival, start))
        position += 1
    audio_s = clips[0].size / 16000
    lag = sorted(lags[1:])
    return {
        "streams": len(clips),
        "audio_s_per_stream": audio_s,
        "steps": len(steps),
        "prefill_step_ms": round(1000 * steps[0], 1),
        "decode_step_ms_median": round(1000 * statistics.median(steps[1:]), 1),
        "lag_ms_median": round(1000 * statistics.median(lag), 1),
        "lag_ms_p90": round(1000 * lag[int(0.9 * (len(lag) - 1))], 1),
        "rtf": round(busy / audio_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--quantization", default=None, help="decoder weights, e.g. int8 (default: bf16)"
    )
    parser.add_argument(
        "--paced", action="store_true", help="also feed each stream's audio in real time"
    )
    args = parser.parse_args()
    name = "voxtral_realtime_0.5b_random" + ("_quick" if args.quick else "")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tinyvllm" / "bench"
    t0 = time.perf_counter()
    path = build_checkpoint(args.checkpoint or cache / name, args.quick)
    build_s = time.perf_counter() - t0
    from tinyvllm import LLM

    llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096,
              enable_prefix_caching=False, seed=0, quantization=args.quantization)  # fmt: skip
    engine = llm.engine
    run(engine, [synthetic_speechlike(1.0, seed=99)], "warmup")
    info = machine_info()
    results = []
    for n in args.streams:
        clips = [synthetic_speechlike(args.seconds, seed=s) for s in range(n)]
        results.append(run(engine, clips, f"s{n}"))
    paced = []
    for n in args.streams if args.paced else []:
        clips = [synthetic_speechlike(args.seconds, seed=10 + s) for s in range(n)]
        paced.append(run_paced(engine, clips, f"p{n}"))
    info["loadavg_end"] = round(os.getloadavg()[0], 2)
    params, tower = checkpoint_sizes(path)
    weights = args.quantization or "bf16"
    print(f"model: decoder {params / 1e9:.2f}B ({weights}), encoder+projector {tower / 1e6:.0f}M "
          "bf16 "
          f"(checkpoint build/load {build_s:.1f}s)")  # fmt: skip
    print(f"machine: {info['cpu']}, {info['cores_visible']} cores, torch {info['torch']}, "
          f"load {info['loadavg_start']} -> {info['loadavg_end']}")  # fmt: skip
    print(f"{'streams':>7}{'audio s':>9}{'prefill ms':>12}{'step ms p50':>13}{'p90':>8}"
          f"{'wall s':>9}{'RTF':>8}{'steady RTF':>12}")  # fmt: skip
    for r in results:
        print(f"{r['streams']:>7}{r['audio_s_per_stream']:>9.1f}{r['prefill_step_ms']:>12}"
              f"{r['decode_step_ms_median']:>13}{r['decode_step_ms_p90']:>8}{r['wall_s']:>9}"
              f"{r['rtf']:>8}{r['steady_rtf']:>12}")  # fmt: skip
    if paced:
        print("audio fed in real time (the left pad at once):")
        print(f"{'streams':>7}{'audio s':>9}{'prefill ms':>12}{'step ms p50':>13}"
              f"{'lag ms p50':>12}{'p90':>8}{'RTF':>8}")  # fmt: skip
    for r in paced:
        print(f"{r['streams']:>7}{r['audio_s_per_stream']:>9.1f}{r['prefill_step_ms']:>12}"
              f"{r['decode_step_ms_median']:>13}{r['lag_ms_median']:>12}{r['lag_ms_p90']:>8}"
              f"{r['rtf']:>8}")  # fmt: skip
    if args.json:
        report = {"machine": info, "results": results, "paced": paced}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
