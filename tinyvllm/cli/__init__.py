"""Command line: `tinyvllm generate | check | chat | serve | transcribe | models | tui`.

One module per face (generate.py, commands.py, transcribe.py); parser.py builds the parser
and runs a command. `python -m tinyvllm.cli` runs it too.
"""

from __future__ import annotations

from tinyvllm.cli.commands import add_tui_arguments
from tinyvllm.cli.commands import serve_setup as serve_setup  # the server's tests use it
from tinyvllm.cli.common import check_engine_kwargs as check_engine_kwargs
from tinyvllm.cli.common import resolve_cli_model as resolve_cli_model
from tinyvllm.cli.parser import build_parser, main

# What other front ends may use: the TUI declares its flags through `add_tui_arguments`, so
# `tinyvllm tui` and `python -m tinyvllm_tui` take the same ones.
__all__ = ["add_tui_arguments", "build_parser", "main"]
