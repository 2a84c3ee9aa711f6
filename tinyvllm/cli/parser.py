"""The `tinyvllm` parser and entry point: one subcommand per face."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NoReturn

from tinyvllm.cli.commands import add_tui_arguments, cmd_chat, cmd_models, cmd_serve, cmd_tui
from tinyvllm.cli.common import add_engine_args
from tinyvllm.cli.generate import cmd_check, cmd_generate
from tinyvllm.cli.transcribe import add_transcribe_arguments

DESCRIPTION = (
    "Command line: `tinyvllm generate | check | chat | serve | transcribe | models | tui`."
)


def build_parser() -> argparse.ArgumentParser:
    from tinyvllm.chat.defaults import DEFAULT_MAX_TOKENS, FALLBACK_TEMPERATURE

    parser = argparse.ArgumentParser(prog="tinyvllm", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen, draft=True)
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
    add_engine_args(chk)
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
    add_engine_args(serve)
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    add_transcribe_arguments(sub)

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
    add_engine_args(chat, draft=True)
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
        code = args.func(args)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"tinyvllm: error: {exc}", file=sys.stderr)
        code = 2
    if argv is None:
        _exit_now(code)
    return code


def _exit_now(code: int) -> NoReturn:
    """End the program as interpreter shutdown would (wait for non-daemon threads, run the
    atexit handlers, flush the standard streams), minus the teardown itself: freeing every
    module, tensor and native runtime object one by one costs ~0.2 s of CPU after the last
    answer here (and full garbage collections over everything torch and the model left
    behind: 1.5 s with SmolLM2, 12-14 s on a loaded machine), work whose only effect is memory
    the OS takes back anyway. An exception out of a command takes Python's own way out."""
    import atexit
    import threading

    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe or stream: nothing more can reach it.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
