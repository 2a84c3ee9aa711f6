"""What the commands share: engine flags, model resolution, sampling flags, stdin."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinyvllm.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser, draft: bool = False) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=None,
        help="catalog name (`tinyvllm models`), hub id, local directory or .gguf file; "
        "default: the catalog's default model",
    )
    p.add_argument(
        "--dtype", default=None, help="auto | float32 | bfloat16 | float16 (default: auto)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--revision", default=None)
    p.add_argument("--gguf-file", default=None, help="a .gguf file inside --model's directory")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--quantization",
        default=None,
        help="auto (keep a GGUF file's quantized blocks) | none (dequantize) | int8 | int4 | gguf;"
        " default: auto, except check: none",
    )
    p.add_argument(
        "--int8-activations",
        action="store_true",
        help="GGUF Q4_0/Q4_1/Q8_0 on x86 CPUs: faster decode with activations rounded "
        "to int8 per 32 (llama.cpp's arithmetic; not exact, off by default)",
    )
    p.add_argument(
        "--video-pruning-rate",
        type=float,
        default=None,
        help="EVS for video VLMs: share of video tokens to drop, in [0, 1) (default: off)",
    )
    p.add_argument(
        "--fp32-weight-copy-bytes",
        type=int,
        default=None,
        help="bytes of GEMM weight copies of a bf16 model on CPU: fp32 copies without bf16 "
        "matmul, oneDNN-prepacked copies with AMX (default: all layers; 0: none)",
    )
    if draft:
        p.add_argument(
            "--draft",
            action="store_true",
            help="speculative decoding with the catalog entry's draft model",
        )


def cli_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine arguments the user gave; the catalog entry's suggestions fill the rest."""
    kwargs = {
        "max_model_len": args.max_model_len,
        "device": args.device,
        "seed": args.seed,
        "trust_remote_code": args.trust_remote_code,
    }
    if args.dtype is not None:
        kwargs["dtype"] = args.dtype
    if args.fp32_weight_copy_bytes is not None:
        kwargs["fp32_weight_copy_bytes"] = args.fp32_weight_copy_bytes
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.video_pruning_rate is not None:
        kwargs["video_pruning_rate"] = args.video_pruning_rate
    if args.int8_activations:
        kwargs["int8_activations"] = True
    return kwargs


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """The engine arguments' own checks (ranges, choices), run before the model is resolved
    or loaded, so a bad flag fails at once rather than after a download or a load."""
    from tinyvllm.config import EngineArgs

    try:
        EngineArgs.from_kwargs("<model>", **kwargs).validate()
    except ValueError as exc:
        # Name the flag the user typed, not only the engine argument behind it.
        name = next((k for k in kwargs if str(exc).startswith(k)), None)
        if name is None:
            raise
        raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None


def resolve_cli_model(
    spec: str | None,
    engine_kwargs: dict[str, Any],
    revision: str | None = None,
    gguf_file: str | None = None,
    with_draft: bool = False,
) -> tuple[str, dict[str, Any], str]:
    """(model path, engine kwargs, label) for `spec`, downloading with a progress bar on
    stderr if needed; explicit engine arguments win over the catalog entry's."""
    from tinyvllm.catalog import progress_bar, resolve_model

    with progress_bar() as bar:
        resolved = resolve_model(
            spec,
            progress=bar,
            revision=revision,
            gguf_file=gguf_file,
            with_draft=with_draft,
        )
    if with_draft and resolved.draft is None:
        raise ValueError(f"{resolved.name} has no draft model in the catalog; drop --draft")
    label = resolved.name if resolved.entry is not None else resolved.model
    return resolved.model, {**resolved.engine_kwargs(), **engine_kwargs}, label


def sampling_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "seed": args.sample_seed,
    }


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    from tinyvllm.sampling_params import SamplingParams

    return SamplingParams(**sampling_flags(args))


def read_stdin() -> str:
    # Undecodable bytes become U+FFFD: tokenizers take no lone surrogates, which is what
    # the locale's surrogateescape would otherwise hand on.
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:
        return sys.stdin.read()
    return buffer.read().decode("utf-8", errors="replace")
