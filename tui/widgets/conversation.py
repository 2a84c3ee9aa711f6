"""The conversation: user messages, streamed Markdown answers, a scroller that follows the end."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream


class UserMessage(Static, can_focus=True):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("c", "copy", "Copy")]

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="message user")
        self.text = text
        self.border_title = "you"

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.app.notify("Message copied to the clipboard")


class AssistantMessage(Markdown, can_focus=True):
    """An answer; text arrives through `append_text`, which appends to the Markdown
    incrementally (a MarkdownStream batches fragments when tokens outpace rendering) rather
    than re-parsing the whole document per token."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("c", "copy", "Copy")]

    def __init__(self, text: str = "") -> None:
        super().__init__(text, classes="message assistant")
        self.border_title = "assistant"
        self._stream: MarkdownStream | None = None
        # Markdown.source lags behind while the stream batches fragments; copying mid-answer
        # should get everything received so far.
        self._received = text

    @property
    def text(self) -> str:
        return self._received

    async def append_text(self, delta: str) -> None:
        if not delta:
            return
        self._received += delta
        if self._stream is None:
            self._stream = Markdown.get_stream(self)
        await self._stream.write(delta)

    async def finish(self, summary: str = "", state: str = "") -> None:
        """Flush the stream; `summary` goes under the answer, `state` ("stopped", "failed")
        becomes a CSS class."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if summary:
            self.border_subtitle = summary
        if state:
            self.add_class(state)

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.app.notify("Answer copied to the clipboard")


class Conversation(VerticalScroll, can_focus=False):
    """Anchored to the bottom: new text keeps it scrolled to the end until the user scrolls
    up, and following resumes once they scroll back down (Textual's anchor)."""

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str) -> UserMessage:
        message = UserMessage(text)
        await self.mount(message)
        return message

    async def add_assistant(self, text: str = "") -> AssistantMessage:
        message = AssistantMessage(text)
        await self.mount(message)
        return message

    def last_answer(self) -> AssistantMessage | None:
        answers = self.query(AssistantMessage)
        return answers.last() if answers else None
