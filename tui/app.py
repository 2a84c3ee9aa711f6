"""The tinyvllm TUI: one App over four screens (models, chat, stats, log).

The app owns the loaded engine and chat session, the event log and two signals: new log
events, and engine activity (a request started, a model loaded), which wakes the stats panels
that stop polling while the engine is idle.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.signal import Signal

from tinyvllm_tui.backend import Backend, EngineBackend, LoadedModel
from tinyvllm_tui.commands import TinyVLLMCommands
from tinyvllm_tui.messages import LoadFailed, ModelLoaded, ResponseFailed, ResponseFinished
from tinyvllm_tui.screens.chat import ChatScreen
from tinyvllm_tui.screens.log import LogScreen
from tinyvllm_tui.screens.model import ModelScreen
from tinyvllm_tui.screens.stats import StatsScreen
from tinyvllm_tui.widgets.event_log import LogEvent
from tinyvllm_tui.widgets.stats_panel import StatsPanel

if TYPE_CHECKING:
    from tinyvllm.stats import EngineStats

MAX_EVENTS = 1000


class TinyVLLMApp(App[None]):
    CSS_PATH = "tinyvllm.tcss"
    TITLE = "tinyvllm"
    COMMANDS: ClassVar = App.COMMANDS | {TinyVLLMCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f2", "show('models')", "Models"),
        Binding("f3", "show('chat')", "Chat"),
        Binding("f4", "show('stats')", "Stats"),
        Binding("f5", "show('log')", "Log"),
        Binding("ctrl+n", "new_chat", "New chat"),
    ]
    SCREENS_BY_NAME: ClassVar[dict[str, Callable[[], Any]]] = {
        "models": ModelScreen,
        "chat": ChatScreen,
        "stats": StatsScreen,
        "log": LogScreen,
    }

    def __init__(
        self,
        model: str | None = None,
        backend: Backend | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.backend: Backend = backend if backend is not None else EngineBackend()
        self.initial_model = model
        self.loaded: LoadedModel | None = None
        self.events: deque[LogEvent] = deque(maxlen=MAX_EVENTS)
        self.event_logged: Signal[LogEvent] = Signal(self, "event-logged")
        self.engine_activity: Signal[None] = Signal(self, "engine-activity")
        self._clock = clock
        self._seen_preemptions = 0
        self._stats_failed = False
        self.sub_title = "no model"

    def on_mount(self) -> None:
        for name, factory in self.SCREENS_BY_NAME.items():
            self.install_screen(factory(), name)
        self.push_screen("models")

    # ---- engine -----------------------------------------------------------------------------
    def read_stats(self) -> EngineStats | None:
        """The loaded engine's stats with the block view, None without a (working) engine."""
        if self.loaded is None:
            return None
        try:
            return self.loaded.llm.get_stats(include_blocks=True)
        except Exception as exc:
            if not self._stats_failed:
                self._stats_failed = True
                self.log_event(f"engine stats unavailable: {exc}", "error")
            return None

    def close_engine(self) -> None:
        """Shut the engine down (blocking: joins its thread)."""
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            loaded.llm.shutdown()

    def log_event(self, text: str, level: str = "info") -> None:
        event = LogEvent(self._clock(), level, text)
        self.events.append(event)
        self.event_logged.publish(event)

    @property
    def chat(self) -> ChatScreen:
        screen = self.get_screen("chat")
        assert isinstance(screen, ChatScreen)
        return screen

    async def show_chat(self) -> ChatScreen:
        """Make the chat screen current; it is composed the first time it is shown."""
        await self.action_show("chat")
        return self.chat

    # ---- messages from the screens ----------------------------------------------------------
    async def on_model_loaded(self, message: ModelLoaded) -> None:
        old, loaded = self.loaded, message.loaded
        self._seen_preemptions = 0
        self._stats_failed = False
        if old is not None:
            # Joining the old engine's thread may take a step; keep it off the event loop.
            self.run_worker(old.llm.shutdown, thread=True, group="shutdown")
        self.loaded = None
        self.sub_title = loaded.name
        detail = f" ({loaded.detail})" if loaded.detail else ""
        self.log_event(f"loaded {loaded.name}{detail} in {loaded.seconds:.1f} s")
        session = self.backend.session(loaded.llm, lambda text: self.log_event(text, "warning"))
        # Session and engine first, then the screen: shown the other way round, the chat would
        # first draw "No model loaded" and its stats panel an empty cache.
        await self.chat.attach(session, loaded.name)
        self.loaded = loaded  # `loaded` means ready to chat
        await self.show_chat()
        self.engine_activity.publish(None)

    def on_load_failed(self, message: LoadFailed) -> None:
        self.log_event(
            f"could not load {message.spec.strip() or 'the default model'}: {message.error}",
            "error",
        )

    def on_response_started(self) -> None:
        self.engine_activity.publish(None)

    def on_response_finished(self, message: ResponseFinished) -> None:
        # Also at the end: a panel that sampled before the engine took the request saw nothing
        # moving and went to sleep; the finished request and its freed blocks must show.
        self.engine_activity.publish(None)
        if message.stopped:
            self.log_event("answer stopped by the user")

    def on_response_failed(self, message: ResponseFailed) -> None:
        self.engine_activity.publish(None)
        self.log_event(f"generation failed: {message.error}", "error")

    def on_stats_panel_sampled(self, message: StatsPanel.Sampled) -> None:
        total = message.stats.total_preemptions
        if total > self._seen_preemptions:
            n = total - self._seen_preemptions
            self.log_event(
                f"{n} request{'s' if n > 1 else ''} preempted (KV cache full); {total} so far",
                "warning",
            )
            self._seen_preemptions = total

    # ---- actions ----------------------------------------------------------------------------
    async def action_show(self, name: str) -> None:
        if self.screen is not self.get_screen(name):
            await self.switch_screen(name)

    async def action_new_chat(self) -> None:
        await (await self.show_chat()).new_chat()

    async def action_toggle_stats(self) -> None:
        (await self.show_chat()).action_toggle_stats()

    async def action_settings(self) -> None:
        (await self.show_chat()).action_toggle_settings()

    async def action_copy_last(self) -> None:
        (await self.show_chat()).action_copy_last()

    async def action_stop(self) -> None:
        await (await self.show_chat()).action_stop()


def run(model: str | None = None, backend: Backend | None = None) -> None:
    app = TinyVLLMApp(model, backend)
    try:
        app.run()
    finally:
        app.close_engine()
