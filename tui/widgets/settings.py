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
# Shown until a session says what it uses (the checkpoint's generation_config, else greedy);
# only fields the user edits are applied to a session, so these never override the model's.
DEFAULTS: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 1024}


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
        # Fields the user changed: these follow the user to every new session; the rest show
        # whatever the session chose.
        self.edited: set[str] = set()

    def compose(self) -> ComposeResult:
        yield Static("Sampling", classes="stats-title")
        for key, label, _, kind in FIELDS:
            yield Label(label)
            yield Input(str(self.values[key]), type=kind, id=f"set-{key}", compact=True)
        yield Label("system prompt")
        yield TextArea(self.values["system"], id="set-system", soft_wrap=True)
        yield Static("", id="settings-error")

    def edited_values(self) -> dict[str, Any]:
        """What the user set here (the system prompt always: empty means none)."""
        edited = {key: self.values[key] for key in self.edited}
        return {**edited, "system": self.values["system"]}

    def show_session_values(self, settings: dict[str, Any]) -> None:
        """Show a session's own values in the fields the user has not edited."""
        for key, _, _, _ in FIELDS:
            if key in self.edited or settings.get(key) is None:
                continue
            self.values[key] = settings[key]  # set first: the Input.Changed echo is then no edit
            if self.is_mounted:
                self.query_one(f"#set-{key}", Input).value = str(settings[key])

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
            self.edited.add(key)
            self.post_message(self.Changed(key, value))

    @on(TextArea.Changed, "#set-system")
    def _system_changed(self, event: TextArea.Changed) -> None:
        event.stop()
        self.values["system"] = event.text_area.text
        self.post_message(self.Changed("system", event.text_area.text))
