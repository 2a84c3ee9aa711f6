"""`python -m tinyvllm_tui [--model M] [--demo]` (the same as `tinyvllm tui`)."""

from __future__ import annotations

import sys

from tinyvllm_tui.cli import main

if __name__ == "__main__":
    sys.exit(main())
