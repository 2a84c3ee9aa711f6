"""`python -m tinyvllm_tui` and the runner behind `tinyvllm tui` (both take the arguments
declared once in tinyvllm/cli.py)."""

from __future__ import annotations

import argparse
from typing import Any

from tinyvllm.cli import add_tui_arguments


def run_from_args(args: argparse.Namespace) -> int:
    # Textual is imported only here, so `tinyvllm` itself never depends on it.
    try:
        from tinyvllm_tui.app import run
    except ImportError as exc:
        raise ValueError(f"the TUI needs textual ({exc}); pip install textual") from None
    from tinyvllm_tui.backend import Backend, EngineBackend

    backend: Backend
    if args.demo:
        from tinyvllm_tui.scripted import ScriptedBackend

        backend = ScriptedBackend(delay=0.05)
    else:
        engine_kwargs: dict[str, Any] = {"max_model_len": args.max_model_len}
        if args.device != "auto":
            engine_kwargs["device"] = args.device
        backend = EngineBackend(engine_kwargs)
    run(args.model, backend)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyvllm tui", description="tinyvllm's terminal UI")
    add_tui_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))
