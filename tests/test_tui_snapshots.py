"""SVG snapshots of the model, chat and stats screens (pytest-textual-snapshot).

The scripted backend makes them deterministic: a fixed catalog, a canned answer with a fixed
summary, frozen engine stats (constant values, so the rate charts do not depend on how many
times the panel polled), a fixed clock and time zone for the event log, no blinking cursors.
Update after an intended change with `pytest tests/test_tui_snapshots.py --snapshot-update`
and look at the report before committing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from textual.pilot import Pilot
from tui_helpers import freeze_cursors, load_via_model_screen, send, wait_until

from tinyvllm_tui.app import TinyVLLMApp
from tinyvllm_tui.screens.stats import StatsScreen
from tinyvllm_tui.scripted import ScriptedBackend
from tinyvllm_tui.widgets.stats_panel import StatsPanel

pytest.importorskip("pytest_textual_snapshot")

# The smallest common terminal (the stats panel hides itself there) and a roomy one.
SIZES = [(80, 24), (160, 48)]
sizes = pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
CLOCK = 1_750_000_000.0  # any fixed instant


@pytest.fixture(autouse=True)
def utc() -> Iterator[None]:
    # Log lines show local time; pin the zone so the rendering is the same everywhere.
    mp = pytest.MonkeyPatch()
    mp.setenv("TZ", "UTC")
    time.tzset()
    yield
    mp.undo()
    time.tzset()


def make_app() -> TinyVLLMApp:
    return TinyVLLMApp(backend=ScriptedBackend(), clock=lambda: CLOCK)


async def _answered(pilot: Pilot) -> None:
    app = pilot.app
    assert isinstance(app, TinyVLLMApp)
    await load_via_model_screen(pilot, "SmolLM2-135M-Instruct")
    session = app.chat.session
    assert session is not None
    await send(pilot, "What is the capital of France?")
    await wait_until(pilot, lambda: len(session.messages) == 2, "the answer")
    await wait_until(pilot, lambda: app.chat.query_one(StatsPanel).stats, "stats")
    await pilot.pause()


@sizes
def test_model_screen(snap_compare: object, size: tuple[int, int]) -> None:
    app = make_app()

    async def run_before(pilot: Pilot) -> None:
        await wait_until(pilot, lambda: app.screen.query("#catalog"), "the model screen")
        freeze_cursors(app)

    assert snap_compare(app, terminal_size=size, run_before=run_before)  # type: ignore[operator]


@sizes
def test_chat_screen(snap_compare: object, size: tuple[int, int]) -> None:
    app = make_app()

    async def run_before(pilot: Pilot) -> None:
        await _answered(pilot)
        freeze_cursors(app)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)  # type: ignore[operator]


@sizes
def test_stats_screen(snap_compare: object, size: tuple[int, int]) -> None:
    app = make_app()

    async def run_before(pilot: Pilot) -> None:
        await _answered(pilot)
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, StatsScreen), "the stats screen")
        await wait_until(pilot, lambda: app.screen.query_one(StatsPanel).stats, "stats")
        freeze_cursors(app)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)  # type: ignore[operator]
