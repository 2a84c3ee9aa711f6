"""Multi-line prompt: Enter sends, Shift+Enter or Ctrl+J inserts a newline.

Shift+Enter reaches the app only in terminals that report it (kitty keyboard protocol, e.g.
kitty, WezTerm, foot, recent iTerm2); Ctrl+J sends a line feed everywhere, so it always works.
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j")


class PromptInput(TextArea):
    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus")
        self.placeholder = "Message (Enter sends, Shift+Enter or Ctrl+J: new line)"

    async def _on_key(self, event: events.Key) -> None:
        # Runs before TextArea's own handler (which would insert "\n" for Enter); preventing
        # the default stops the MRO walk there.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self, self.text))
        elif event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self.replace("\n", start, end)

    def restore(self, text: str) -> None:
        """Put a prompt back (after Esc) with the cursor at its end."""
        self.text = text
        self.move_cursor(self.document.end)
        self.focus()
