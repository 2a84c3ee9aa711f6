"""Regenerate the README's TUI screenshots with the real model answering.

    python -m tinyvllm_tui.screenshots [--model SmolLM2-135M-Instruct] [--out docs]

Loads the model through the model screen, asks two questions at temperature 0, saves the chat
screen after the first answer (docs/tui-chat.svg) and the stats screen while the second one is
being generated (docs/tui-stats.svg). The KV cache is limited to --num-blocks blocks so that the
block map shows single blocks. Takes a minute or two on a laptop CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from textual.pilot import Pilot
from textual.widgets import Input, TextArea

from tinyvllm_tui.app import TinyVLLMApp
from tinyvllm_tui.backend import EngineBackend
from tinyvllm_tui.screens.chat import ChatScreen
from tinyvllm_tui.screens.stats import StatsScreen
from tinyvllm_tui.widgets.prompt import PromptInput
from tinyvllm_tui.widgets.stats_panel import StatsPanel

SIZE = (132, 40)
FIRST = "What are three good habits for writing Python code? Answer as a short Markdown list."
SECOND = "Now write a short poem about a tidy codebase."


async def _wait(pilot: Pilot, ready: Callable[[], object], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f} s")
        await pilot.pause(0.1)


async def _ask(pilot: Pilot, app: TinyVLLMApp, text: str) -> None:
    prompt = app.chat.query_one(PromptInput)
    prompt.text = text
    prompt.focus()
    await pilot.press("enter")


def _still(app: TinyVLLMApp) -> None:
    for widget in app.screen.query(Input):
        widget.cursor_blink = False
    for widget in app.screen.query(TextArea):
        widget.cursor_blink = False


async def take(model: str, out: Path, max_model_len: int, num_blocks: int) -> list[Path]:
    kwargs = {"max_model_len": max_model_len, "num_gpu_blocks_override": num_blocks}
    app = TinyVLLMApp(backend=EngineBackend(kwargs))
    saved = []
    try:
        async with app.run_test(size=SIZE) as pilot:
            await _wait(pilot, lambda: app.screen.query("#spec"), "the model screen", 30)
            app.screen.query_one("#spec", Input).value = model
            await pilot.click("#load")
            await _wait(
                pilot,
                lambda: isinstance(app.screen, ChatScreen) and app.loaded,
                "the model to load",
                600,
            )
            app.chat.query_one("#set-temperature", Input).value = "0"
            session = app.chat.session
            assert session is not None

            await _ask(pilot, app, FIRST)
            await _wait(pilot, lambda: len(session.messages) == 2, "the first answer", 600)
            await pilot.pause(0.5)
            _still(app)
            saved.append(Path(app.save_screenshot("tui-chat.svg", str(out))))

            base = app.read_stats()
            assert base is not None
            await _ask(pilot, app, SECOND)
            await pilot.press("f4")
            await _wait(pilot, lambda: isinstance(app.screen, StatsScreen), "stats screen", 30)
            panel = app.screen.query_one(StatsPanel)
            # A few seconds of generation, so the rate charts and latencies have something.
            await _wait(
                pilot,
                lambda: (
                    panel.stats is not None
                    and panel.stats.total_generation_tokens > base.total_generation_tokens + 40
                    and panel.stats.num_running == 1
                ),
                "generation to be under way",
                600,
            )
            await pilot.pause(2.0)
            _still(app)
            saved.append(Path(app.save_screenshot("tui-stats.svg", str(out))))
    finally:
        app.close_engine()
    return saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--max-model-len", type=int, default=2048)
    # A KV cache small enough that the block map shows one block per cell.
    parser.add_argument("--num-blocks", type=int, default=512)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shots = take(args.model, args.out, args.max_model_len, args.num_blocks)
    for path in asyncio.run(shots):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
