"""Custom messages: the life of a response and of a model load, posted by workers and widgets.

They bubble from the chat / model screen to the app, which keeps the event log and wakes the
stats panels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.message import Message

if TYPE_CHECKING:
    from tinyvllm_tui.backend import LoadedModel


class ResponseStarted(Message):
    def __init__(self, prompt: str) -> None:
        super().__init__()
        self.prompt = prompt


class ResponseFinished(Message):
    """The answer is complete, or was stopped by the user (`stopped`)."""

    def __init__(self, text: str, summary: str, stopped: bool = False) -> None:
        super().__init__()
        self.text = text
        self.summary = summary
        self.stopped = stopped


class ResponseFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class ModelLoaded(Message):
    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__()
        self.loaded = loaded


class LoadFailed(Message):
    def __init__(self, spec: str, error: str) -> None:
        super().__init__()
        self.spec = spec
        self.error = error
