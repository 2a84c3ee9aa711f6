"""Widgets of the tinyvllm TUI."""
