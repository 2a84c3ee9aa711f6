"""Command palette entries (Ctrl+P) for the app's own actions."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (title, help, app action)
COMMANDS = (
    ("New chat", "Forget the conversation and start again", "new_chat"),
    ("Load model", "Open the model picker", "show('models')"),
    ("Chat", "Go to the chat", "show('chat')"),
    ("Toggle stats panel", "Show or hide the stats beside the chat", "toggle_stats"),
    ("Show stats", "Engine statistics and KV block map in full", "show('stats')"),
    ("Show log", "Engine events: loads, preemptions, errors", "show('log')"),
    ("Sampling settings", "Temperature, top_p, top_k, max_tokens, system prompt", "settings"),
    ("Copy last answer", "Copy the latest answer to the clipboard", "copy_last"),
    ("Stop generation", "Stop the answer in flight and restore the prompt", "stop"),
)


class TinyVLLMCommands(Provider):
    async def discover(self) -> Hits:
        for title, help_text, action in COMMANDS:
            yield DiscoveryHit(title, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in COMMANDS:
            score = matcher.match(title)
            if score > 0:
                yield Hit(
                    score,
                    matcher.highlight(title),
                    partial(self.app.run_action, action),
                    help=help_text,
                )
