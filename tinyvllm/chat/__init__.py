"""Chatting with a model: `ChatSession` (history, streaming, stop) and the `tinyvllm chat` REPL."""

from __future__ import annotations

from tinyvllm.chat.session import SETTABLE_PARAMS, ChatSession, TurnSummary, default_chat_params

__all__ = ["SETTABLE_PARAMS", "ChatSession", "TurnSummary", "default_chat_params"]
