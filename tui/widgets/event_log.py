"""Engine event log: loads, preemptions and errors, as the app records them."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.signal import Signal
from textual.widgets import RichLog

LEVEL_STYLES = {"info": "", "warning": "yellow", "error": "bold red"}


@dataclass(frozen=True)
class LogEvent:
    timestamp: float  # seconds since the epoch
    level: str  # "info" | "warning" | "error"
    text: str

    def render(self) -> Text:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.timestamp))
        line = Text(f"{stamp}  ", style="dim")
        line.append(self.text, style=LEVEL_STYLES.get(self.level, ""))
        return line


class EventLog(RichLog):
    """Shows the events so far, then follows `signal` (which publishes each new LogEvent)."""

    def __init__(
        self, events: Iterable[LogEvent], signal: Signal[Any], *, id: str | None = None
    ) -> None:
        super().__init__(id=id, wrap=True, markup=False, auto_scroll=True, min_width=20)
        self._initial = list(events)
        self._signal = signal

    def on_mount(self) -> None:
        for event in self._initial:
            self.write(event.render())
        self._signal.subscribe(self, self._add)

    def _add(self, event: LogEvent) -> None:
        self.write(event.render())
