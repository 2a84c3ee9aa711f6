"""Command line: `tinyvllm generate | check | chat | serve | models | tui` (bench comes with a
later face)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    from tinyvllm.sampling_params import SamplingParams


# What other front ends may use: the TUI declares its flags through `add_tui_arguments`, so
# `tinyvllm tui` and `python -m tinyvllm_tui` take the same ones.
__all__ = ["add_tui_arguments", "build_parser", "main"]


def _add_engine_args(p: argparse.ArgumentParser, draft: bool = False) -> None:
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
        "--video-pruning-rate",
        type=float,
        default=None,
        help="EVS for video VLMs: share of video tokens to drop, in [0, 1) (default: off)",
    )
    p.add_argument(
        "--fp32-weight-copy-bytes",
        type=int,
        default=None,
        help="CPUs without bf16 matmul: bytes of fp32 GEMM weight copies of a bf16 model "
        "(default: all layers; 0: none)",
    )
    if draft:
        p.add_argument(
            "--draft",
            action="store_true",
            help="speculative decoding with the catalog entry's draft model",
        )


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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


def _sampling_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "seed": args.sample_seed,
    }


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from tinyvllm.sampling_params import SamplingParams

    return SamplingParams(**_sampling_flags(args))


def _read_stdin() -> str:
    # Undecodable bytes become U+FFFD: tokenizers take no lone surrogates, which is what
    # the locale's surrogateescape would otherwise hand on.
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:
        return sys.stdin.read()
    return buffer.read().decode("utf-8", errors="replace")


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyvllm import LLM
    from tinyvllm.engine.engine import check_text

    params = _sampling_params(args)  # bad flags fail here, before a model load
    prompts = args.prompt or [_read_stdin()]
    for i, prompt in enumerate(prompts):
        check_text(prompt, f"prompt {i}")  # e.g. undecodable bytes in argv
    model, kwargs, _ = resolve_cli_model(
        args.model, _engine_kwargs(args), args.revision, args.gguf_file, args.draft
    )
    llm = LLM(model, **kwargs)
    start = time.perf_counter()
    media = {k: v for k, v in (("image", args.image), ("video", args.video)) if v}
    if args.chat:
        parts = _media_parts(media)
        conversations = [
            [{"role": "user", "content": [*parts, {"type": "text", "text": p}] if parts else p}]
            for p in prompts
        ]
        outputs = llm.chat(conversations, params)
    elif media:
        placeholders = llm.placeholders()
        outputs = llm.generate([_media_prompt(p, media, placeholders) for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n, failed = 0, 0
    for i, out in enumerate(outputs):
        if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
            failed += 1
            print(f"tinyvllm: error: prompt {i} failed: {out.error}", file=sys.stderr)
            continue
        for comp in out.outputs:
            print(comp.text)
            n += len(comp.token_ids)
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 1 if failed else 0


def _media_parts(media: dict[str, list[str]]) -> list[dict[str, Any]]:
    return [
        {"type": f"{kind}_url", f"{kind}_url": {"url": path}}
        for kind, paths in media.items()
        for path in paths
    ]


def _media_prompt(
    prompt: str, media: dict[str, list[str]], placeholders: Mapping[str, str]
) -> dict[str, Any]:
    """A plain prompt with --image / --video files: their placeholders (the model's) go first
    unless the prompt already places them."""
    head = "".join(
        placeholders[kind] * len(paths)
        for kind, paths in media.items()
        if kind in placeholders and placeholders[kind] not in prompt
    )
    return {"prompt": head + prompt, "multi_modal_data": media}


def cmd_check(args: argparse.Namespace) -> int:
    from tinyvllm import LLM
    from tinyvllm.parity import DEFAULT_PROMPTS, load_hf_reference, run_parity
    from tinyvllm.sampling_params import SamplingParams

    SamplingParams(max_tokens=args.max_tokens)  # a bad --max-tokens fails before the load

    model, kwargs, _ = resolve_cli_model(
        args.model, _engine_kwargs(args), args.revision, args.gguf_file
    )
    kwargs["dtype"] = "float32"
    # Parity is about the implementation: run the same (dequantized) weights HF runs.
    kwargs["quantization"] = args.quantization or "none"
    llm = LLM(model, **kwargs)
    model_path = llm.engine.config.model.model_path
    print(f"loading the transformers reference for {model_path} ...", end="", file=sys.stderr)
    sys.stderr.flush()
    start = time.perf_counter()
    hf = load_hf_reference(model_path)
    print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    report = run_parity(llm, hf, args.prompt or DEFAULT_PROMPTS, max_tokens=args.max_tokens)
    print(report.summary())
    return 0 if report.identical and report.max_logprob_diff < args.tolerance else 1


def cmd_models(args: argparse.Namespace) -> int:
    from tinyvllm.catalog.listing import catalog_json, catalog_table

    if args.json:
        print(catalog_json(args.search))
    else:
        print(catalog_table(args.search))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tinyvllm.chat.defaults import default_chat_params
    from tinyvllm.chat.repl import run_chat

    # Flags left out take the model's generation_config values, known only after the load;
    # bad ones fail now, before it.
    sampling = _sampling_flags(args)
    default_chat_params(None, **sampling)
    engine_kwargs = _engine_kwargs(args)
    # --revision / --gguf-file describe --model, not what /load switches to later.
    pinned: dict[str, Any] = {
        "revision": args.revision,
        "gguf_file": args.gguf_file,
        "with_draft": args.draft,
    }

    def load(spec: str | None) -> tuple[Any, str]:
        from tinyvllm.engine.async_llm import AsyncLLM

        model, kwargs, label = resolve_cli_model(spec, engine_kwargs, **pinned)
        pinned.update(revision=None, gguf_file=None, with_draft=False)
        print(f"loading {label} ...", file=sys.stderr, flush=True)
        return AsyncLLM(model, **kwargs), label

    try:
        return run_chat(
            load, args.model, sampling=sampling, system=args.system, commands=args.commands
        )
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def serve_setup(args: argparse.Namespace) -> tuple[str, dict[str, Any], str]:
    """`tinyvllm serve`'s (model path, engine kwargs, label), every flag checked before a
    model is resolved or loaded."""
    from tinyvllm.server.cli import (
        check_installed,
        model_spec,
        read_chat_template,
        serve_engine_kwargs,
        server_limits,
    )

    check_installed()
    read_chat_template(args.chat_template)
    server_limits(args)
    engine_kwargs = {**_engine_kwargs(args), **serve_engine_kwargs(args)}
    check_engine_kwargs(engine_kwargs)
    return resolve_cli_model(model_spec(args), engine_kwargs, args.revision, args.gguf_file)


def cmd_serve(args: argparse.Namespace) -> int:
    from tinyvllm.server.cli import run_server

    return run_server(args, *serve_setup(args))


def add_tui_arguments(parser: argparse.ArgumentParser) -> None:
    """`tinyvllm tui`'s arguments, also those of `python -m tinyvllm_tui` (the TUI imports
    them from here: it sits above tinyvllm, never the other way round)."""
    parser.add_argument(
        "--model", "-m", default=None, help="catalog name, hub id, directory or .gguf file"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=2048, help="context length (default 2048)"
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument(
        "--demo", action="store_true", help="a scripted model and stats (no engine), to try the UI"
    )


def cmd_tui(args: argparse.Namespace) -> int:
    # The TUI is a separate package (tinyvllm_tui); tinyvllm itself never imports textual.
    try:
        from tinyvllm_tui.cli import run_from_args
    except ImportError as exc:
        raise ValueError(f"the TUI needs textual ({exc}); pip install textual") from None
    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    from tinyvllm.chat.defaults import DEFAULT_MAX_TOKENS, FALLBACK_TEMPERATURE

    parser = argparse.ArgumentParser(prog="tinyvllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_engine_args(gen, draft=True)
    gen.add_argument("prompt", nargs="*", help="prompt(s); read from stdin when absent")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument(
        "--image", action="append", default=[], help="image file for every prompt (repeatable)"
    )
    gen.add_argument(
        "--video", action="append", default=[], help="video file for every prompt (repeatable)"
    )
    gen.set_defaults(func=cmd_generate)

    chk = sub.add_parser(
        "check", help="compare greedy tokens and logprobs with HF transformers (fp32)"
    )
    _add_engine_args(chk)
    chk.add_argument("prompt", nargs="*", help="prompts (a built-in set when absent)")
    chk.add_argument("--max-tokens", type=int, default=32)
    chk.add_argument("--tolerance", type=float, default=1e-3, help="max |logprob diff|")
    chk.set_defaults(func=cmd_check)

    tui = sub.add_parser("tui", help="terminal UI: pick a model, chat, watch the engine")
    add_tui_arguments(tui)
    tui.set_defaults(func=cmd_tui)

    from tinyvllm.server.cli import add_serve_arguments

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (needs the serve extra)",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /metrics, ...) on 127.0.0.1 unless --host says.",
    )
    _add_engine_args(serve)
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="list the model catalog and what is on disk")
    models.add_argument("search", nargs="?", default="", help="only entries matching this text")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(func=cmd_models)

    chat = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Chat in the terminal (/help inside lists commands). With stdin not a "
        "terminal, each input line is one user turn (commands only with --commands) and only "
        "answers go to stdout.",
    )
    _add_engine_args(chat, draft=True)
    chat.add_argument("--system", default=None, help="system prompt")
    model_default = "default: the model's generation_config, else "
    chat.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"{model_default}{FALLBACK_TEMPERATURE} (greedy)",
    )
    chat.add_argument("--top-p", type=float, default=None, help=f"{model_default}1.0 (off)")
    chat.add_argument("--top-k", type=int, default=None, help=f"{model_default}0 (off)")
    chat.add_argument(
        "--max-tokens", type=int, default=None, help=f"longest answer ({DEFAULT_MAX_TOKENS})"
    )
    chat.add_argument("--sample-seed", type=int, default=None)
    chat.add_argument(
        "--commands",
        action="store_true",
        help="with stdin not a terminal, run input lines starting with / as commands "
        "(default: every line is a message)",
    )
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; `argv` None means this is the `tinyvllm` program itself."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"tinyvllm: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if argv is None:
            _prepare_fast_exit()


def _prepare_fast_exit() -> None:
    # Interpreter teardown runs full garbage collections over every object torch,
    # transformers and the model left behind: ~1.5 s of CPU after the last answer, 12-14 s
    # on a loaded machine. Everything is shut down by now, so exempt those objects from
    # collection (freed by reference counting as usual; atexit handlers still run).
    import gc

    gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
