"""The TUI's first minutes, against the scripted backend: where typing goes on the model screen,
what the chat shows right after a load, the rates at idle, and a narrow (80x24) terminal."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from textual import events
from textual.widgets import DataTable, Input, Static
from tui_helpers import load_via_model_screen, model_screen, run, wait_until

from tinyvllm.catalog import load_catalog
from tinyvllm_tui.app import TinyVLLMApp
from tinyvllm_tui.screens.chat import PANEL_HIDDEN
from tinyvllm_tui.scripted import ScriptedBackend, frozen_stats
from tinyvllm_tui.widgets.block_map import BlockMap
from tinyvllm_tui.widgets.rate_bars import BARS, bar_chars
from tinyvllm_tui.widgets.stats_panel import StatsPanel

WIDE = (160, 48)
NARROW = (80, 24)


def text_of(widget: Static) -> str:
    return str(widget.render())


def test_demo_catalog_is_the_real_catalog() -> None:
    shipped = load_catalog(Path(os.devnull))
    rows = ScriptedBackend().catalog()
    assert [r.name for r in rows] == shipped.names
    assert [r.name for r in rows if r.default] == [shipped.default_name]


def test_typing_on_the_model_screen_goes_to_the_model_field() -> None:
    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend())
        async with app.run_test(size=WIDE) as pilot:
            await model_screen(pilot)
            table = app.screen.query_one("#catalog", DataTable)
            spec = app.screen.query_one("#spec", Input)
            assert app.focused is table  # arrows pick a row at once
            await pilot.press(*"Qwen3")
            assert spec.value == "Qwen3" and app.focused is spec
            await pilot.press("enter")  # loads what was typed, not the highlighted default
            error = app.screen.query_one("#load-error", Static)
            await wait_until(pilot, lambda: error.display, "the error")
            assert "'Qwen3' is not in the catalog" in text_of(error)

            # A terminal sends a pasted or fast-typed name in one burst: every key reaches the
            # table before the focus moves, and none may be lost.
            table.focus()
            await pilot.pause()
            for char in "Qwen3-0.6B":
                app.post_message(events.Key(char, char))
            await wait_until(pilot, lambda: spec.value == "Qwen3-0.6B", "the whole name")
            table.focus()
            await pilot.pause()
            app.post_message(events.Paste("Qwen3-1.7B\n"))  # a paste replaces it too
            await wait_until(pilot, lambda: spec.value == "Qwen3-1.7B", "the pasted name")
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.loaded is not None, "the load")
            assert app.sub_title == "Qwen3-1.7B"

    run(main())


def test_an_empty_search_says_so() -> None:
    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend())
        async with app.run_test(size=WIDE) as pilot:
            await model_screen(pilot)
            empty = app.screen.query_one("#catalog-empty", Static)
            assert not empty.display
            app.screen.query_one("#search", Input).value = "gpt-17"
            await wait_until(pilot, lambda: empty.display, "the empty-result line")
            assert "No catalog model matches 'gpt-17'" in text_of(empty)
            app.screen.query_one("#search", Input).value = "qwen"
            await wait_until(pilot, lambda: not empty.display, "rows again")

    run(main())


def test_after_a_load_the_chat_never_shows_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rendering of the chat's status line and stats panel, from the first, is of the
    loaded model (the chat used to be shown before the session and engine were attached)."""
    seen: list[tuple[str, str]] = []
    static_render, map_render = Static.render, BlockMap.render

    def spy_static(self: Static) -> Any:
        out = static_render(self)
        if self.id in ("chat-status", "kv-usage"):
            seen.append((self.id, str(out)))
        return out

    def spy_map(self: BlockMap) -> Any:
        out = map_render(self)
        seen.append(("block-map", str(out)))
        return out

    monkeypatch.setattr(Static, "render", spy_static)
    monkeypatch.setattr(BlockMap, "render", spy_map)

    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend())
        async with app.run_test(size=WIDE) as pilot:
            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            await wait_until(pilot, lambda: app.chat.query_one(StatsPanel).stats, "stats")
            await pilot.pause()

    run(main())
    assert ("chat-status", "SmolLM2-135M-Instruct ready.") in seen
    stale = [s for s in seen if "No model loaded" in s[1] or "no model loaded" in s[1]]
    stale += [s for s in seen if "no engine" in s[1]]
    assert not stale


def test_rates_decay_to_zero_at_idle_before_the_panel_sleeps() -> None:
    busy = frozen_stats()
    # The request finished, but the engine's recent window still holds its tokens.
    after = replace(frozen_stats(busy=False), generation_throughput=20.0, prompt_throughput=5.0)
    decayed = replace(after, generation_throughput=0.0, prompt_throughput=0.0)
    script = [busy, after, after, after, decayed]

    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend(stats=script))
        async with app.run_test(size=WIDE) as pilot:
            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            panel = app.chat.query_one(StatsPanel)
            await wait_until(pilot, lambda: not panel.polling, "the idle pause")
            assert panel.stats is not None and panel.stats.generation_throughput == 0.0
            gen = text_of(panel.query_one("#gen-tps", Static))
            assert "0.0 tok/s" in gen and "idle" in gen

    run(main())


def test_rate_bars_start_at_zero() -> None:
    assert bar_chars([], 6) == bar_chars([0.0], 6) == bar_chars([0.0] * 30, 6) == BARS[0] * 6
    # One sample, or equal samples: a steady row at half height, not full-height bars.
    assert bar_chars([38.5], 6) == bar_chars([38.5] * 40, 6) == BARS[3] * 6
    burst = bar_chars([1.0] * 9 + [50.0], 10)
    assert burst[-1] == BARS[-1] and set(burst[:-1]) == {BARS[0]}
    rising = bar_chars([0.0, 10.0, 20.0, 40.0], 4)
    assert rising[0] == BARS[0] and list(rising) == sorted(rising)
    assert bar_chars(list(range(100)), 10) == bar_chars(list(range(90, 100)), 10)  # the latest


def test_narrow_terminal_hides_the_panel_and_cuts_descriptions_with_an_ellipsis() -> None:
    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend())
        async with app.run_test(size=NARROW) as pilot:
            await model_screen(pilot)
            table = app.screen.query_one("#catalog", DataTable)
            await pilot.pause()
            descriptions = [str(table.get_row_at(i)[-1]) for i in range(table.row_count)]
            assert any(d.endswith("…") for d in descriptions)
            # All of it fits: nothing cut at the edge, no sideways scrolling.
            assert table.virtual_size.width + table.scrollbar_size_vertical <= table.size.width

            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            panel = app.chat.query_one(StatsPanel)
            status = app.chat.query_one("#chat-status", Static)
            assert not panel.display and PANEL_HIDDEN in text_of(status)
            await pilot.press("ctrl+t")
            assert panel.display
            await pilot.resize_terminal(81, 24)  # the user's choice outlives a resize
            await pilot.pause()
            assert panel.display
            await pilot.press("ctrl+t")
            assert not panel.display

    run(main())


def test_wide_terminal_shows_the_panel() -> None:
    async def main() -> None:
        app = TinyVLLMApp(backend=ScriptedBackend())
        async with app.run_test(size=WIDE) as pilot:
            await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
            assert app.chat.query_one(StatsPanel).display
            assert PANEL_HIDDEN not in text_of(app.chat.query_one("#chat-status", Static))

    run(main())
