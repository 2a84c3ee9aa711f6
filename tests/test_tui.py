"""The TUI against the scripted backend: model loading, streaming, Esc, stats polling, palette.

Engine-backed pilots (tiny random model, real SmolLM2, tmux) are in test_tui_engine.py; SVG
snapshots in test_tui_snapshots.py.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from textual.command import CommandList, CommandPalette
from textual.widgets import DataTable, Input, Static
from tui_helpers import (
    last_answer,
    load_via_model_screen,
    model_screen,
    prompt_text,
    run,
    send,
    wait_until,
)

from tinyvllm.stats import BlockInfo
from tinyvllm_tui.app import TinyVLLMApp
from tinyvllm_tui.screens.log import LogScreen
from tinyvllm_tui.scripted import DEFAULT_ANSWER, ScriptedBackend, ScriptedLLM, frozen_stats
from tinyvllm_tui.widgets.block_map import CACHED, FREE, group_cells
from tinyvllm_tui.widgets.conversation import Conversation, UserMessage
from tinyvllm_tui.widgets.prompt import PromptInput
from tinyvllm_tui.widgets.stats_panel import REFRESH_S, StatsPanel

SIZE = (120, 36)


def test_group_cells_folds_blocks_and_prefers_in_use() -> None:
    blocks = [BlockInfo(i, "free", 0, ()) for i in range(10)]
    blocks[3] = BlockInfo(3, "cached", 0, ())
    blocks[7] = BlockInfo(7, "used", 2, ("b", "a"))
    blocks[6] = BlockInfo(6, "used", 1, ("b",))
    per_cell, keys = group_cells(blocks, 100)
    assert per_cell == 1 and keys[3] == CACHED and keys[6] == keys[7] == "b"
    per_cell, keys = group_cells(blocks, 4)  # 10 blocks into at most 4 cells -> 3 per cell
    assert per_cell == 3 and keys == [FREE, CACHED, "b", FREE]
    assert group_cells([], 10) == (1, [])


def test_tui_does_not_leak_textual_into_the_engine() -> None:
    code = (
        "import sys, tinyvllm, tinyvllm.cli, tinyvllm.engine.async_llm, tinyvllm.chat.session\n"
        "print('textual' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_load_stream_stop_and_new_chat() -> None:
    async def main() -> None:
        backend = ScriptedBackend(delay=0.02)
        app = TinyVLLMApp(backend=backend)
        async with app.run_test(size=SIZE) as pilot:
            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            assert app.sub_title == "SmolLM2-135M-Instruct"
            assert any("loaded SmolLM2-135M-Instruct" in e.text for e in app.events)

            # A full answer streams in and gets its summary line.
            session = app.chat.session
            assert session is not None
            # Ctrl+J (and Shift+Enter) insert newlines; a blank prompt is not sent.
            await pilot.press("h", "i", "ctrl+j", "y", "o")
            assert prompt_text(app) == "hi\nyo"
            app.chat.query_one(PromptInput).text = "   "
            await pilot.press("enter")
            assert not app.chat.query(UserMessage)
            await send(pilot, "What is the capital of France?")
            await wait_until(pilot, lambda: len(session.messages) == 2, "the answer to finish")
            answer = last_answer(app)
            assert answer is not None and answer.text == DEFAULT_ANSWER
            await wait_until(pilot, lambda: answer.border_subtitle, "the summary line")
            assert "tok/s" in answer.border_subtitle
            assert prompt_text(app) == "" and not app.chat.generating
            await pilot.press("ctrl+r")  # copies the latest answer
            assert app.clipboard == DEFAULT_ANSWER
            assert [m["role"] for m in session.messages] == ["user", "assistant"]

            # Esc mid-answer: the turn disappears and the prompt comes back to be edited.
            session.delay = 0.2  # type: ignore[attr-defined]  # slow enough to stop mid-answer
            await send(pilot, "Tell me more\nabout Paris")
            await wait_until(pilot, lambda: (a := last_answer(app)) and a.text, "streamed text")
            assert last_answer(app) is not answer
            await pilot.press("escape")
            await wait_until(pilot, lambda: not app.chat.generating, "the stop")
            assert prompt_text(app) == "Tell me more\nabout Paris"
            assert last_answer(app) is answer
            assert len(session.messages) == 2
            assert any("stopped" in e.text for e in app.events)

            # Ctrl+N: a new conversation.
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: not app.chat.query(UserMessage), "a new chat")
            assert session.messages == []

    run(main())


def test_catalog_search_and_load_error_in_place() -> None:
    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend())
        async with app.run_test(size=SIZE) as pilot:
            await model_screen(pilot)
            table = app.screen.query_one("#catalog", DataTable)
            assert table.row_count == len(app.backend.catalog())
            app.screen.query_one("#search", Input).value = "360m"
            await wait_until(pilot, lambda: table.row_count == 1, "the filtered catalog")
            spec = app.screen.query_one("#spec", Input)
            await wait_until(
                pilot, lambda: spec.value == "SmolLM2-360M-Instruct", "the highlighted row"
            )
            spec.value = "no-such-model"
            await pilot.click("#load")
            error = app.screen.query_one("#load-error", Static)
            await wait_until(pilot, lambda: error.display, "the error")
            assert "not in the catalog" in str(error.render())
            assert app.loaded is None
            assert app.events[-1].level == "error"

    run(main())


def test_stats_panel_polls_while_busy_and_pauses_when_idle() -> None:
    busy = frozen_stats()
    done = replace(frozen_stats(busy=False), total_generation_tokens=1300)
    script = [busy, replace(busy, total_generation_tokens=1250), done, done, done]

    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend(stats=script))
        async with app.run_test(size=SIZE) as pilot:
            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            panel = app.chat.query_one(StatsPanel)
            await wait_until(pilot, lambda: not panel.polling, "the idle pause")
            assert panel.stats is not None and panel.stats.total_generation_tokens == 1300
            assert any(e.level == "warning" and "preempted" in e.text for e in app.events)
            llm = app.loaded.llm  # type: ignore[union-attr]
            assert isinstance(llm, ScriptedLLM)
            # A new request wakes it up.
            calls = llm.calls
            await send(pilot, "hi")
            await wait_until(pilot, lambda: llm.calls > calls, "the panel to poll again")
            # Hidden panels do not poll the engine.
            await pilot.press("ctrl+t")
            assert not panel.display
            calls = llm.calls
            await send(pilot, "hi again")
            await wait_until(pilot, lambda: len(app.chat.session.messages) == 4, "the answer")
            await pilot.pause(2 * REFRESH_S)
            assert llm.calls == calls

    run(main())


def test_command_palette_and_screens() -> None:
    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend())
        async with app.run_test(size=SIZE) as pilot:
            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            await pilot.press("ctrl+p")
            await pilot.press(*"show log")
            await wait_until(
                pilot,
                lambda: (
                    isinstance(app.screen, CommandPalette)
                    and app.screen.query_one(CommandList).option_count > 0
                ),
                "palette hits",
            )
            await pilot.press("enter")
            await wait_until(pilot, lambda: isinstance(app.screen, LogScreen), "the log screen")
            await pilot.press("f3")
            await wait_until(pilot, lambda: app.screen is app.chat, "the chat screen")
            assert app.chat.query_one(Conversation) is not None

    run(main())


@pytest.mark.parametrize("argv", [["tui", "--demo"], ["tui", "-m", "x", "--max-model-len", "64"]])
def test_cli_registers_tui(argv: list[str]) -> None:
    from tinyvllm.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.command == "tui" and hasattr(args, "max_model_len") and hasattr(args, "demo")


def test_follows_the_end_only_while_the_user_is_there() -> None:
    long_answer = " ".join(f"line {i}\n\n" for i in range(80))  # 80 paragraphs

    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend(answer=long_answer, delay=0.01))
        async with app.run_test(size=SIZE) as pilot:
            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            conversation = app.chat.query_one(Conversation)
            await send(pilot, "count")
            await wait_until(pilot, lambda: conversation.max_scroll_y > 10, "an overflow")
            assert conversation.scroll_y == conversation.max_scroll_y  # following
            conversation.scroll_to(y=0, animate=False)  # the user scrolls up to read
            seen = len(last_answer(app).text)  # type: ignore[union-attr]
            await wait_until(pilot, lambda: len(last_answer(app).text) > seen + 20, "more text")
            assert conversation.scroll_y == 0  # left where the user put it
            conversation.scroll_end(animate=False)  # back at the end: following again
            seen = len(last_answer(app).text)  # type: ignore[union-attr]
            await wait_until(pilot, lambda: len(last_answer(app).text) > seen + 20, "more text")
            await pilot.pause()
            assert conversation.scroll_y == conversation.max_scroll_y

    run(main())


def test_image_command_attaches_a_file_to_the_next_message(tmp_path: Path) -> None:
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"not decoded by the scripted session")
    backend = ScriptedBackend()

    async def main() -> None:
        app = TinyVLLMApp(backend=backend)
        async with app.run_test(size=SIZE) as pilot:
            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            await send(pilot, "/image /no/such/file.png")
            status = app.chat.query_one("#chat-status", Static)
            await wait_until(pilot, lambda: "needs an existing file" in str(status.content), "err")
            await send(pilot, f"/image {picture}")
            await wait_until(pilot, lambda: "attached" in str(status.content), "attach notice")
            await send(pilot, "what is it")
            session = app.chat.session
            await wait_until(pilot, lambda: len(session.messages) == 2, "the answer")
            assert session.messages[0]["content"] == [
                {"type": "image_url", "image_url": {"url": str(picture)}},
                {"type": "text", "text": "what is it"},
            ]
            assert app.chat.attached == []

    run(main())
