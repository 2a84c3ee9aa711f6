"""Chat: streamed Markdown answers, Esc to stop, sampling settings and a live stats sidebar."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Header, Static
from textual.worker import Worker

from tinyvllm_tui.messages import ResponseFailed, ResponseFinished, ResponseStarted
from tinyvllm_tui.widgets.conversation import AssistantMessage, Conversation, UserMessage
from tinyvllm_tui.widgets.prompt import PromptInput
from tinyvllm_tui.widgets.settings import SettingsPanel
from tinyvllm_tui.widgets.stats_panel import StatsPanel

if TYPE_CHECKING:
    from tinyvllm_tui.app import TinyVLLMApp
    from tinyvllm_tui.backend import ChatLike

NO_MODEL = "No model loaded: press F2 to pick one."
# Below this many columns the stats panel (48) would squeeze the answers: it starts hidden.
PANEL_MIN_WIDTH = 110
PANEL_HIDDEN = "Stats panel hidden at this width: Ctrl+T shows it."


class ChatScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+t", "toggle_stats", "Stats panel"),
        Binding("ctrl+o", "toggle_settings", "Settings"),
        Binding("ctrl+r", "copy_last", "Copy reply"),
    ]

    generating: reactive[bool] = reactive(False)

    def __init__(self) -> None:
        super().__init__()
        self.session: ChatLike | None = None
        self._worker: Worker[None] | None = None
        self._turn: tuple[str, UserMessage, AssistantMessage] | None = None
        self._ready = NO_MODEL  # the status line when nothing else is going on
        self._panel_chosen = False  # Ctrl+T was used: the width no longer decides
        # Content parts `/image PATH` / `/video PATH` attached to the next message.
        self.attached: list[dict[str, Any]] = []

    @property
    def tui(self) -> TinyVLLMApp:
        return cast("TinyVLLMApp", self.app)

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="chat-body"):
            with Vertical(id="chat-main"):
                yield Conversation(id="conversation")
                yield Static(self._ready, id="chat-status")  # on_resize adds the panel hint
                yield PromptInput(id="prompt")
            yield SettingsPanel(id="settings")
            yield StatsPanel(
                self.tui.read_stats, self.tui.engine_activity, map_rows=6, id="side-stats"
            )
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#settings").display = False
        self.query_one(PromptInput).focus()
        self._apply_settings()

    def on_resize(self) -> None:
        if self._panel_chosen:
            return
        panel = self.query_one(StatsPanel)
        wide = self.size.width >= PANEL_MIN_WIDTH
        if panel.display != wide:
            panel.display = wide
            if not self.generating:
                self._status(self._ready_line())

    def _ready_line(self) -> str:
        """The idle status line, saying how to get the stats panel back when the width hid it."""
        if self._panel_chosen or self.query_one(StatsPanel).display:
            return self._ready
        return f"{self._ready} {PANEL_HIDDEN}"

    def on_screen_resume(self) -> None:
        self.query_one(StatsPanel).wake()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating
        return True

    def watch_generating(self, generating: bool) -> None:
        self.set_class(generating, "-generating")
        self.refresh_bindings()

    def _status(self, text: str, error: bool = False) -> None:
        status = self.query_one("#chat-status", Static)
        status.update(text)
        status.set_class(error, "error")

    # ---- session ----------------------------------------------------------------------------
    async def attach(self, session: ChatLike, model_name: str) -> None:
        """Start a fresh conversation on a newly loaded model, keeping the settings. Called
        before the screen is shown, so it never shows the previous state (or none)."""
        await self.stop_generation()
        self.session = session
        self._ready = f"{model_name} ready."
        if not self.is_mounted:
            return  # composed later, from the state set here
        self._apply_settings()
        await self.query_one(Conversation).remove_children()
        self._status(self._ready_line())

    def _apply_settings(self) -> None:
        panel = self.query_one(SettingsPanel)
        for key, value in panel.edited_values().items():
            self._apply(key, value)
        if self.session is not None:
            panel.show_session_values(self.session.settings())

    async def new_chat(self) -> None:
        await self.stop_generation()
        if self.session is not None:
            self.session.reset()
        await self.query_one(Conversation).remove_children()
        self._status("New chat." if self.session is not None else self._ready_line())
        self.query_one(PromptInput).focus()

    def _apply(self, key: str, value: Any) -> None:
        if self.session is None:
            return
        panel = self.query_one(SettingsPanel)
        try:
            if key == "system":
                self.session.system = value or None
            else:
                self.session.set_param(key, value)
        except (ValueError, TypeError) as exc:
            panel.show_error(str(exc))
        else:
            panel.show_error("")

    @on(SettingsPanel.Changed)
    def _setting_changed(self, event: SettingsPanel.Changed) -> None:
        self._apply(event.key, event.value)

    # ---- one turn ---------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _submit(self, event: PromptInput.Submitted) -> None:
        if self.session is None:
            self._status(self._ready_line(), error=True)
            return
        if self.generating:
            self.notify("Still answering: Esc stops it.", severity="warning")
            return
        text = event.text
        event.prompt.clear()
        if self._attach_command(text):
            return
        conversation = self.query_one(Conversation)
        user = await conversation.add_user(text)
        answer = await conversation.add_assistant()
        conversation.anchor()  # a new turn always brings the view back to the end
        self._turn = (text, user, answer)
        self.generating = True
        self._status("Answering… Esc stops.")
        self.post_message(ResponseStarted(text))
        content: str | list[dict[str, Any]] = text
        if self.attached:
            content, self.attached = [*self.attached, {"type": "text", "text": text}], []
        self._worker = self.run_worker(
            self._generate(self.session, content, answer), group="generate", exit_on_error=False
        )

    def _attach_command(self, text: str) -> bool:
        """`/image PATH` or `/video PATH` attaches a file to the next message (a
        vision-language model takes it); True when `text` was such a command."""
        command, _, arg = text.strip().partition(" ")
        modality = {"/image": "image", "/video": "video"}.get(command.lower())
        if modality is None:
            return False
        path = Path(arg.strip()).expanduser()
        if not arg.strip() or not path.is_file():
            self._status(f"/{modality} needs an existing file, got {arg.strip()!r}", error=True)
            return True
        part = f"{modality}_url"
        self.attached.append({"type": part, part: {"url": str(path)}})
        self._status(f"{modality} {path.name} attached to the next message")
        return True

    async def _generate(
        self, session: ChatLike, text: str | list[dict[str, Any]], answer: AssistantMessage
    ) -> None:
        try:
            # aclosing: a cancel (Esc) that lands while we render must still close the stream
            # now, so the session records the turn before stop_generation forgets it.
            async with contextlib.aclosing(session.send(text)) as stream:
                async for delta in stream:
                    await answer.append_text(delta)
        except asyncio.CancelledError:
            raise  # Esc: action_stop tidies up
        except Exception as exc:
            error = str(exc) or type(exc).__name__
            await answer.finish(f"error: {error}", state="failed")
            self._end_turn()
            self._status(f"Generation failed: {error}", error=True)
            prompt = self.query_one(PromptInput)
            if not prompt.text:  # the session took the turn back; let the user retry
                prompt.restore(text if isinstance(text, str) else text[-1]["text"])
            self.post_message(ResponseFailed(error))
            return
        turn = session.last_turn
        summary = turn.line() if turn is not None else ""
        await answer.finish(summary)
        self._end_turn()
        self._status("")
        self.post_message(ResponseFinished(answer.text, summary))

    def _end_turn(self) -> None:
        self._turn = None
        self._worker = None
        self.generating = False

    async def stop_generation(self) -> str | None:
        """Stop the answer in flight, drop that turn from the view and the session's history;
        returns its prompt (None when nothing was running)."""
        if self._turn is None:
            return None
        text, user, answer = self._turn
        worker, session = self._worker, self.session
        if session is not None:
            session.stop()
        if worker is not None:
            worker.cancel()
            # Let the stream unwind (which aborts the request and frees its KV blocks).
            await asyncio.wait([asyncio.ensure_future(_finished(worker))], timeout=5)
        if session is not None:
            _forget_turn(session, text)
        await answer.finish()
        await user.remove()
        await answer.remove()
        self._end_turn()
        return text

    async def action_stop(self) -> None:
        text = await self.stop_generation()
        if text is None:
            return
        self.query_one(PromptInput).restore(text)
        self._status("Stopped; the prompt is back in the input.")
        self.post_message(ResponseFinished("", "", stopped=True))

    def action_toggle_stats(self) -> None:
        panel = self.query_one(StatsPanel)
        panel.display = not panel.display
        self._panel_chosen = True

    def action_toggle_settings(self) -> None:
        panel = self.query_one(SettingsPanel)
        panel.display = not panel.display
        if panel.display:
            panel.query_one("#set-temperature").focus()
        else:
            self.query_one(PromptInput).focus()

    def action_copy_last(self) -> None:
        answer = self.query_one(Conversation).last_answer()
        if answer is None:
            self.notify("Nothing to copy yet.", severity="warning")
        else:
            answer.action_copy()


async def _finished(worker: Worker[None]) -> None:
    # Worker.wait() raises for cancelled workers; only the fact that it ended matters here.
    with contextlib.suppress(Exception):
        await worker.wait()


def _forget_turn(session: ChatLike, prompt: str) -> None:
    """Drop the stopped turn (its user message and any partial answer) from the history, so
    the restored prompt can be edited and sent again without a duplicate."""
    messages = session.messages
    if (
        len(messages) >= 2
        and messages[-1].get("role") == "assistant"
        and messages[-2].get("content") == prompt
    ):
        messages.pop()
    if messages and messages[-1].get("role") == "user" and messages[-1].get("content") == prompt:
        messages.pop()
