"""`python -m tinyvllm_tui` and the runner behind `tinyvllm tui` (tinyvllm/cli.py declares
the same arguments; keep the two in step)."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinyvllm tui", description="tinyvllm's terminal UI")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
