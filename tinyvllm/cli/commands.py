"""`tinyvllm models | chat | serve | tui`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tinyvllm.cli.common import (
    check_engine_kwargs,
    cli_engine_kwargs,
    resolve_cli_model,
    sampling_flags,
)


def cmd_models(args: argparse.Namespace) -> int:
    from tinyvllm.catalog.listing import catalog_json, catalog_table

    if args.json:
        print(catalog_json(args.search))
    else:
        print(catalog_table(args.search))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tinyvllm.chat.defaults import default_chat_params
    from tinyvllm.chat.terminal import run_chat

    # Flags left out take the model's generation_config values, known only after the load;
    # bad ones fail now, before it.
    sampling = sampling_flags(args)
    default_chat_params(None, **sampling)
    engine_kwargs = cli_engine_kwargs(args)
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
    engine_kwargs = {**cli_engine_kwargs(args), **serve_engine_kwargs(args)}
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
