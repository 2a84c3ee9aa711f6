"""Screens of the tinyvllm TUI: models, chat, stats and log."""
