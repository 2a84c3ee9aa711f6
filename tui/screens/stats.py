"""Engine statistics in full: a large KV block map, the live numbers and the event log."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from tinyvllm_tui.widgets.event_log import EventLog
from tinyvllm_tui.widgets.stats_panel import StatsPanel

if TYPE_CHECKING:
    from tinyvllm_tui.app import TinyVLLMApp


class StatsScreen(Screen[None]):
    @property
    def tui(self) -> TinyVLLMApp:
        return cast("TinyVLLMApp", self.app)

    def compose(self) -> ComposeResult:
        app = self.tui
        yield Header()
        with Horizontal(id="stats-body"):
            yield StatsPanel(app.read_stats, app.engine_activity, map_rows=14, id="full-stats")
            with Vertical(id="stats-log"):
                yield Static("Engine events", classes="stats-title")
                yield EventLog(app.events, app.event_logged)
        yield Footer()

    def on_screen_resume(self) -> None:
        self.query_one(StatsPanel).wake()
