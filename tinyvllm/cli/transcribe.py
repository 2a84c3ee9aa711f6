"""`tinyvllm transcribe FILE.wav [--realtime]`: stream a WAV file into a realtime speech model
and print the transcript as it comes.

The file is fed in chunks as a microphone would give it: at real-time pace with --realtime
(each chunk once its audio has "happened"), else as fast as the engine takes it. Either way
the text is printed as the model produces it, token by token.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinyvllm.cli.common import add_engine_args, cli_engine_kwargs, resolve_cli_model

if TYPE_CHECKING:
    import numpy as np

# Speech models' usual rate (Voxtral Realtime's); the model's own is used once it is loaded.
DEFAULT_RATE = 16000


def add_transcribe_arguments(sub: Any) -> None:
    p = sub.add_parser(
        "transcribe",
        help="stream a WAV file's transcript from a realtime speech model",
        description="Transcribe FILE (PCM16 WAV, mono; other sample rates are resampled) with "
        "a realtime speech model such as Voxtral Realtime, printing the text as it streams.",
    )
    add_engine_args(p)
    p.add_argument("file", help="the WAV file")
    p.add_argument(
        "--realtime",
        action="store_true",
        help="feed the audio at real-time pace, as a live microphone would (default: as fast "
        "as possible)",
    )
    p.add_argument(
        "--chunk-ms", type=float, default=80.0, help="audio per chunk sent (default 80 ms)"
    )
    p.add_argument(
        "--prompt-token-ids",
        default=None,
        help="comma-separated prompt token ids (default: the model's streaming prefix)",
    )
    p.set_defaults(func=cmd_transcribe)


def cmd_transcribe(args: argparse.Namespace) -> int:
    from tinyvllm.engine.async_llm import AsyncLLM, RequestError
    from tinyvllm.engine.transcription import require_realtime

    if not args.chunk_ms > 0:
        raise ValueError(f"--chunk-ms must be positive, got {args.chunk_ms}")
    prompt_ids = _parse_ids(args.prompt_token_ids)
    clip = Path(args.file)
    if not clip.is_file():
        raise FileNotFoundError(f"{clip}: no such audio file")
    rate = DEFAULT_RATE
    samples = read_audio(clip, rate)  # a bad file fails before the model loads
    model, kwargs, label = resolve_cli_model(
        args.model, cli_engine_kwargs(args), args.revision, args.gguf_file
    )
    print(f"loading {label} ...", file=sys.stderr, flush=True)
    with AsyncLLM(model, **kwargs) as llm:
        require_realtime(llm.engine)
        if llm.engine.mm_processor.frame_config.sampling_rate != rate:
            rate = llm.engine.mm_processor.frame_config.sampling_rate
            samples = read_audio(clip, rate)
        try:
            stats = asyncio.run(_run(llm, samples, rate, args, prompt_ids))
        except RequestError as exc:
            print(f"\ntinyvllm: error: {exc.message}", file=sys.stderr)
            return 1
    audio_s = samples.size / rate
    tail = (
        f"done {stats['lag']:.2f} s after the audio ended"
        if args.realtime
        else f"real-time factor {stats['wall'] / audio_s:.2f}"
    )
    print(
        f"[{audio_s:.2f} s of audio, {stats['tokens']} tokens in {stats['wall']:.2f} s; {tail}]",
        file=sys.stderr,
    )
    return 0


def read_audio(path: Path, rate: int) -> np.ndarray:
    """The file's samples at `rate` (resampled if needed); ValueError naming the file."""
    from tinyvllm.multimodal.audio import audio_samples, load_wav

    try:
        samples, file_rate = load_wav(path)
        return audio_samples((samples, file_rate), rate)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


async def _run(
    llm: Any, samples: np.ndarray, rate: int, args: argparse.Namespace, prompt_ids: list[int] | None
) -> dict[str, float]:
    from tinyvllm.engine.transcription import TranscriptionStream

    stream = TranscriptionStream(llm, prompt_ids)
    chunk = max(1, round(args.chunk_ms * rate / 1000))
    start = time.monotonic()
    audio_end = start

    async def feed() -> None:
        nonlocal audio_end
        for begin in range(0, samples.size, chunk):
            end = min(samples.size, begin + chunk)
            if args.realtime:  # a chunk is sent once its last sample has been "spoken"
                await asyncio.sleep(max(0.0, start + end / rate - time.monotonic()))
            stream.append(samples[begin:end])
            await asyncio.sleep(0)  # let the engine take it before the next one
        audio_end = time.monotonic()
        stream.end()

    feeder = asyncio.create_task(feed())
    tokens = 0
    try:
        async for out in stream.outputs():
            completion = out.outputs[0]
            tokens += len(completion.token_ids)
            sys.stdout.write(completion.text)
            sys.stdout.flush()
    finally:
        feeder.cancel()
    print()
    done = time.monotonic()
    return {"wall": done - start, "lag": done - audio_end, "tokens": tokens}


def _parse_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(
            f"--prompt-token-ids takes comma-separated integers, got {text!r}"
        ) from None
