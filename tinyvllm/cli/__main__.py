"""`python -m tinyvllm.cli ...`: the `tinyvllm` program."""

from __future__ import annotations

import sys

from tinyvllm.cli.parser import main

if __name__ == "__main__":
    sys.exit(main())
