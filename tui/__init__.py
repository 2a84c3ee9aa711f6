"""tinyvllm's Textual app, installed as `tinyvllm_tui` (imported only by `tinyvllm tui`)."""
