"""`tinyvllm chat`'s REPL over ChatSession: each input line is a user turn or a slash command.

Answers stream to `out` and Ctrl-C stops one; summaries, notices and errors go to `err`. The
terminal and piped-input front ends around it are in `chat/terminal.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tinyvllm.chat.session import SETTABLE_PARAMS, ChatSession
from tinyvllm.engine.streams import RequestError

if TYPE_CHECKING:
    from tinyvllm.engine.async_llm import AsyncLLM
    from tinyvllm.stats import EngineStats

HELP = f"""commands:
  /help              this text
  /reset             forget the conversation (keeps the system prompt and settings)
  /system [TEXT]     show or set the system prompt (empty TEXT: none)
  /set [KEY=VALUE]   show settings or change one: {", ".join(SETTABLE_PARAMS)}
  /stats             engine statistics (KV cache, throughput, latencies)
  /save FILE         write the transcript (.md: Markdown, else JSON); never overwrites
  /save! FILE        the same, replacing FILE if it exists (never through a symlink)
  /load MODEL        switch model (catalog name, hub id, directory or .gguf), keep history
  /image PATH        attach an image file to the next message (vision-language models)
  /video PATH        attach a video file to the next message (needs PyAV: tinyvllm[video])
  /exit              quit (also /quit, Ctrl-D)
Ctrl-C stops an answer; at the prompt it clears the line."""

# Loads a model spec; returns the engine and a label for messages.
Loader = Callable[[str], "tuple[AsyncLLM, str]"]


class Repl:
    """Command handling and answer streaming, independent of where lines come from."""

    def __init__(
        self,
        session: ChatSession,
        *,
        out: TextIO,
        err: TextIO,
        loader: Loader | None = None,
        dim_summaries: bool = False,
        commands: bool = True,
    ) -> None:
        self.session = session
        self.commands = commands  # False: a line starting with "/" is an ordinary message
        self.out, self.err = out, err
        self.loader = loader
        self.dim = dim_summaries
        self.loop = asyncio.new_event_loop()
        # Media parts /image and /video attached to the next message.
        self.attached: list[dict[str, Any]] = []

    def close(self) -> None:
        self.loop.close()

    # ---- one line of input ------------------------------------------------------------------
    def handle(self, line: str) -> bool:
        """Run one input line (a message or a /command); False when the REPL should exit."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/") and self.commands:
            return self.command(text)
        self.answer(text)
        return True

    def answer(self, text: str) -> None:
        """Stream one answer to `out`; Ctrl-C (on the main thread) stops it."""
        with self._sigint_stops_answer():
            try:
                self.loop.run_until_complete(self._stream(text))
            except ValueError as exc:  # e.g. the message cannot fit the context
                self._error(str(exc))
                return
            except RequestError as exc:  # this answer failed; the engine goes on
                self._error(f"the answer failed: {exc}")
                return
        turn = self.session.last_turn
        if turn is not None:
            line = turn.line()
            self.err.write(f"\x1b[2m{line}\x1b[0m\n" if self.dim else line + "\n")
            self.err.flush()

    async def _stream(self, text: str) -> None:
        wrote = False
        content: str | list[dict[str, Any]] = text
        if self.attached:
            content = [*self.attached, {"type": "text", "text": text}]
            self.attached = []
        async for delta in self.session.send(content):
            self.out.write(delta)
            self.out.flush()
            wrote = True
        if wrote or self.session.last_turn is not None:
            self.out.write("\n")
            self.out.flush()

    @contextlib.contextmanager
    def _sigint_stops_answer(self) -> Any:
        # Only the main thread may take signals; elsewhere (tests, embedding) skip it.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        try:
            self.loop.add_signal_handler(signal.SIGINT, self.session.stop)
        except (NotImplementedError, RuntimeError):  # no signal support on this loop
            yield
            return
        try:
            yield
        finally:
            self.loop.remove_signal_handler(signal.SIGINT)  # restores KeyboardInterrupt

    # ---- slash commands ---------------------------------------------------------------------
    def command(self, text: str) -> bool:
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        name = name.lower()
        if name in ("/exit", "/quit"):
            return False
        handler = {
            "/help": self._help,
            "/reset": self._reset,
            "/system": self._system,
            "/set": self._set,
            "/stats": self._stats,
            "/save": self._save,
            "/save!": self._save_overwrite,
            "/load": self._load,
            "/image": self._image,
            "/video": self._video,
        }.get(name)
        if handler is None:
            self._error(f"unknown command {name}; /help lists the commands")
            return True
        try:
            handler(arg)
        except Exception as exc:  # a failed command must not end the conversation
            self._error(f"{name} failed: {type(exc).__name__}: {exc}")
        return True

    def _help(self, arg: str) -> None:
        self._info(HELP)

    def _image(self, arg: str) -> None:
        self._attach("image", arg)

    def _video(self, arg: str) -> None:
        self._attach("video", arg)

    def _attach(self, modality: str, arg: str) -> None:
        if not arg:
            self._error(f"give a file: /{modality} PATH")
            return
        path = Path(arg).expanduser()
        if not path.is_file():
            self._error(f"no such file: {arg}")
            return
        part = f"{modality}_url"
        self.attached.append({"type": part, part: {"url": str(path)}})
        self._info(f"{modality} {path.name} attached to the next message")

    def _reset(self, arg: str) -> None:
        self.session.reset()
        self._info("conversation cleared")

    def _system(self, arg: str) -> None:
        if not arg:
            self._info(f"system prompt: {self.session.system!r}")
            return
        self.session.system = None if arg.lower() in ("none", '""', "''") else arg
        self._info("system prompt set" if self.session.system else "system prompt cleared")

    def _set(self, arg: str) -> None:
        if not arg:
            self._info(", ".join(f"{k}={v}" for k, v in self.session.settings().items()))
            return
        if "=" not in arg:
            self._error(
                f"use /set KEY=VALUE, e.g. /set temperature=0.7; keys: {', '.join(SETTABLE_PARAMS)}"
            )
            return
        try:
            self.session.set_param(arg.replace(" ", ""))
        except ValueError as exc:
            self._error(str(exc))
            return
        key = arg.split("=", 1)[0].strip().replace("-", "_")
        self._info(f"{key}={self.session.settings()[key]}")

    def _stats(self, arg: str) -> None:
        self._info(format_stats(self.session.llm.get_stats()))

    def _save(self, arg: str, overwrite: bool = False) -> None:
        if not arg:
            self._error("use /save FILE (.md for Markdown, anything else JSON)")
            return
        try:
            path = self.session.save(arg, overwrite=overwrite)
        except FileExistsError:
            self._error(f"{arg} exists; use /save! {arg} to replace it")
            return
        except (OSError, ValueError) as exc:  # ValueError: e.g. a NUL byte in the path
            self._error(f"cannot write {arg}: {getattr(exc, 'strerror', None) or exc}")
            return
        self._info(f"saved {len(self.session.messages)} messages to {path}")

    def _save_overwrite(self, arg: str) -> None:
        self._save(arg, overwrite=True)

    def _load(self, arg: str) -> None:
        if self.loader is None:
            self._error("/load is not available here")
            return
        if not arg:
            self._error("use /load MODEL (a catalog name, hub id, directory or .gguf file)")
            return
        try:
            llm, label = self.loader(arg)
        except (ValueError, OSError) as exc:  # the loader's one-sentence errors
            self._error(str(exc))
            return
        except Exception as exc:  # e.g. a corrupt file tripping the loader: keep the chat
            self._error(f"cannot load {arg}: {type(exc).__name__}: {exc}")
            return
        except KeyboardInterrupt:  # Ctrl-C during a long load: keep the current model
            self._error(f"loading {arg} cancelled; still chatting with the current model")
            return
        old = self.session
        session = ChatSession(llm, old.params, old.system, notice=self._info)
        session.messages = old.messages
        old.llm.shutdown()
        self.session = session
        self._info(f"now chatting with {label} (history kept)")

    def _info(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()

    def _error(self, text: str) -> None:
        self.err.write(f"error: {text}\n")
        self.err.flush()


def format_stats(s: EngineStats) -> str:
    """A few lines summarising an EngineStats snapshot."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    lines = [
        f"KV cache: {s.kv_usage:.0%} used of {s.num_blocks} blocks x {s.block_size} tokens; "
        f"prefix cache hit rate {s.prefix_hit_rate:.0%}",
        f"throughput (last 10 s): prompt {s.prompt_throughput:.0f} tok/s, "
        f"generation {s.generation_throughput:.1f} tok/s",
        f"totals: {s.total_prompt_tokens} prompt + {s.total_generation_tokens} generated "
        f"tokens, {s.num_finished_requests} requests, {s.num_steps} steps",
        f"latency: TTFT p50 {ms(s.ttft.p50)} p90 {ms(s.ttft.p90)}; "
        f"inter-token p50 {ms(s.itl.p50)} p90 {ms(s.itl.p90)}",
    ]
    if s.spec_drafted_tokens:
        lines.append(
            f"speculation: {s.spec_acceptance_rate:.0%} of {s.spec_drafted_tokens} drafts "
            f"accepted, {s.spec_mean_accepted_length:.2f} tokens per verification"
        )
    return "\n".join(lines)
