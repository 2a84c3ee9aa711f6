"""Pilot helpers shared by the TUI tests (test_tui*.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from textual.pilot import Pilot
from textual.widgets import Input, TextArea

from tinyvllm_tui.app import TinyVLLMApp
from tinyvllm_tui.screens.chat import ChatScreen
from tinyvllm_tui.widgets.conversation import AssistantMessage
from tinyvllm_tui.widgets.prompt import PromptInput


def run(coro: Coroutine[Any, Any, None], timeout: float = 120.0) -> None:
    """Run a pilot test's coroutine, failing (not hanging) after `timeout` seconds."""
    asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_until(
    pilot: Pilot, predicate: Callable[[], object], what: str, timeout: float = 30.0
) -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.02)


def chat_screen(app: TinyVLLMApp) -> ChatScreen | None:
    return app.screen if isinstance(app.screen, ChatScreen) else None


def last_answer(app: TinyVLLMApp) -> AssistantMessage | None:
    answers = app.chat.query(AssistantMessage)
    return answers.last() if answers else None


def prompt_text(app: TinyVLLMApp) -> str:
    return app.chat.query_one(PromptInput).text


async def model_screen(pilot: Pilot) -> None:
    """Wait for the model screen (the first screen) to be up."""
    await wait_until(pilot, lambda: pilot.app.screen.query("#catalog"), "the model screen")


async def load_via_model_screen(pilot: Pilot, spec: str, timeout: float = 60.0) -> None:
    """Type `spec` into the model screen's input, press Enter, wait for the chat screen."""
    app = pilot.app
    assert isinstance(app, TinyVLLMApp)
    await model_screen(pilot)
    spec_input = app.screen.query_one("#spec", Input)
    spec_input.value = spec
    spec_input.focus()
    await pilot.press("enter")
    await wait_until(
        pilot, lambda: app.loaded is not None and chat_screen(app), "the model to load", timeout
    )


async def send(pilot: Pilot, text: str) -> None:
    app = pilot.app
    assert isinstance(app, TinyVLLMApp)
    prompt = app.chat.query_one(PromptInput)
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")


def freeze_cursors(app: TinyVLLMApp) -> None:
    """No blinking cursors in snapshots."""
    for screen in (app.screen, *app.screen_stack):
        for widget in screen.query(Input):
            widget.cursor_blink = False
        for widget in screen.query(TextArea):
            widget.cursor_blink = False
