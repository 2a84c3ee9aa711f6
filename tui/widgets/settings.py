"""Sampling settings: temperature, top_p, top_k, max_tokens and the system prompt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Input, Label, Static, TextArea

# (key, label, parse, input type) per numeric field.
FIELDS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("temperature", "temperature", float, "number"),
    ("top_p", "top_p", float, "number"),
    ("top_k", "top_k (0 = off)", int, "integer"),
    ("max_tokens", "max_tokens", int, "integer"),
)
# ChatSession's own defaults; the panel's values are applied to every new session.
DEFAULTS: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_tokens": 1024}


class SettingsPanel(VerticalScroll):
    """Edits apply at once; a value the session rejects is shown under the fields."""

    class Changed(Message):
        def __init__(self, key: str, value: Any) -> None:
            super().__init__()
            self.key = key
            self.value = value

    def __init__(self, values: dict[str, Any] | None = None, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.values = {**DEFAULTS, "system": "", **(values or {})}

    def compose(self) -> ComposeResult:
        yield Static("Sampling", classes="stats-title")
        for key, label, _, kind in FIELDS:
            yield Label(label)
            yield Input(str(self.values[key]), type=kind, id=f"set-{key}", compact=True)
        yield Label("system prompt")
        yield TextArea(self.values["system"], id="set-system", soft_wrap=True)
        yield Static("", id="settings-error")

    def show_error(self, message: str) -> None:
        error = self.query_one("#settings-error", Static)
        error.update(message)
        error.set_class(bool(message), "error")

    @on(Input.Changed)
    def _number_changed(self, event: Input.Changed) -> None:
        event.stop()
        key = (event.input.id or "").removeprefix("set-")
        parse = next((p for k, _, p, _ in FIELDS if k == key), None)
        if parse is None:
            return
        try:
            value = parse(event.value)
        except ValueError:
            self.show_error(f"{key}: {event.value!r} is not a number")
            return
        if value != self.values.get(key):
            self.values[key] = value
            self.post_message(self.Changed(key, value))

    @on(TextArea.Changed, "#set-system")
    def _system_changed(self, event: TextArea.Changed) -> None:
        event.stop()
        self.values["system"] = event.text_area.text
        self.post_message(self.Changed("system", event.text_area.text))
