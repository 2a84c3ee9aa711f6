"""`tinyvllm chat` on a terminal or over piped input: the front ends around `Repl`.

On a terminal: line editing and history (stdlib readline), Ctrl-C at the prompt clears the line,
Ctrl-D exits. With stdin not a terminal every input line is one user turn, answers go to
stdout, everything else to stderr, and the exit status is 0 at the end of input.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tinyvllm.chat.defaults import default_chat_params
from tinyvllm.chat.repl import Loader, Repl
from tinyvllm.chat.session import ChatSession
from tinyvllm.engine.streams import EngineDeadError

if TYPE_CHECKING:
    from tinyvllm.engine.async_llm import AsyncLLM

PROMPT = ">>> "
HISTORY_FILE = "chat_history"
HISTORY_LENGTH = 1000
SHUTDOWN_TIMEOUT_S = 30.0


def run_piped(repl: Repl, lines: Iterable[str]) -> int:
    """Each line one user turn (or a /command); answers on stdout."""
    for line in lines:
        if not repl.handle(line):
            break
    return 0


def run_interactive(repl: Repl, history: Path | None) -> int:
    """Prompt with line editing until /exit or Ctrl-D."""
    readline = _setup_readline(history)
    try:
        while True:
            try:
                line = input(PROMPT)
            except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, ask again
                repl.err.write("\n")
                continue
            except EOFError:  # Ctrl-D
                repl.err.write("\n")
                return 0
            if not repl.handle(line):
                return 0
    finally:
        if readline is not None and history is not None:
            with contextlib.suppress(OSError):
                history.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(str(history))


def _setup_readline(history: Path | None) -> Any:
    try:
        import readline
    except ImportError:  # e.g. Windows: plain input() still works
        return None
    readline.set_history_length(HISTORY_LENGTH)
    if history is not None and history.is_file():
        with contextlib.suppress(OSError):
            readline.read_history_file(str(history))
    return readline


def history_path() -> Path:
    from tinyvllm.utils.dirs import user_data_dir

    return user_data_dir() / HISTORY_FILE


def _replace_undecodable(stdin: TextIO) -> None:
    # Undecodable bytes become U+FFFD instead of lone surrogates (which no tokenizer
    # takes) or a UnicodeDecodeError that would end the session.
    reconfigure = getattr(stdin, "reconfigure", None)
    if reconfigure is not None:
        with contextlib.suppress(ValueError, OSError):
            reconfigure(errors="replace")


def is_interactive(stdin: TextIO | None = None) -> bool:
    stdin = stdin or sys.stdin
    return bool(getattr(stdin, "isatty", lambda: False)())


def run_chat(
    loader: Loader,
    spec: str,
    *,
    params: Any = None,
    sampling: dict[str, Any] | None = None,
    system: str | None = None,
    stdin: TextIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    history: Path | None = None,
    commands: bool = False,
) -> int:
    """Load `spec` with `loader`, then chat on the terminal or over the piped input (where
    lines starting with "/" are commands only if `commands`). Sampling: `params`, else the
    model's defaults with `sampling`'s non-None values over them."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    interactive = is_interactive(stdin)
    _replace_undecodable(stdin)
    llm, label = loader(spec)
    repl: Repl | None = None
    try:
        if params is None:
            params = default_chat_params(llm, **(sampling or {}))
        session = ChatSession(llm, params, system)
        # Summaries in faint text on a terminal that shows it (https://no-color.org).
        dim = interactive and err.isatty() and not os.environ.get("NO_COLOR")
        dim = dim and os.environ.get("TERM") != "dumb"
        repl = Repl(
            session,
            out=out,
            err=err,
            loader=loader,
            dim_summaries=dim,
            commands=interactive or commands,
        )
        session.notice = repl._info
        if not interactive:
            return run_piped(repl, stdin)
        err.write(
            f"chatting with {label}; /help for commands, Ctrl-C stops an answer, Ctrl-D exits\n"
        )
        err.flush()
        return run_interactive(repl, history if history is not None else history_path())
    except EngineDeadError as exc:
        err.write(f"error: the engine stopped: {exc}\n")
        return 1
    finally:
        _shutdown(repl.session.llm if repl is not None else llm, err)
        if repl is not None:
            repl.close()


def _shutdown(llm: AsyncLLM, err: TextIO) -> None:
    # A step in flight ends within seconds; never let a wedged one hold the exit forever.
    try:
        llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    except TimeoutError as exc:
        err.write(f"warning: {exc}; exiting without it\n")
