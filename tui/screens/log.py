"""The engine event log on its own screen."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer, Header

from tinyvllm_tui.widgets.event_log import EventLog

if TYPE_CHECKING:
    from tinyvllm_tui.app import TinyVLLMApp


class LogScreen(Screen[None]):
    def compose(self) -> ComposeResult:
        app = cast("TinyVLLMApp", self.app)
        yield Header()
        yield EventLog(app.events, app.event_logged, id="log")
        yield Footer()
