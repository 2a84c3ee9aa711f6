"""The tokenizer of a GGUF file: transformers rebuilds it from the vocabulary, merges, special
token ids and chat template stored in the file, once; the result is cached per file and
transformers version, and reloaded through its snapshot (`gguf.tokenizer`)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tinyvllm.gguf.config import check_architecture
from tinyvllm.gguf.reader import read_gguf
from tinyvllm.gguf.tokenizer import SnapshotTokenizer, save_snapshot

logger = logging.getLogger(__name__)


def tokenizer_cache_dir(path: Path) -> Path:
    """Where the tokenizer rebuilt from `path` is saved: keyed by the file's identity and the
    transformers version that converted it."""
    from importlib.metadata import version  # not `import transformers`: that takes seconds

    from tinyvllm.utils.dirs import user_cache_dir

    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{version('transformers')}"
    return user_cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


def load_gguf_tokenizer(path: str | Path, use_cache: bool = True) -> Any:
    """The tokenizer transformers rebuilds from the GGUF vocabulary, merges, special
    token ids and chat template.

    Rebuilding takes seconds (transformers parses the whole file and converts the vocabulary),
    so the result is saved once as a regular tokenizer directory and reloaded from there,
    through its snapshot (`gguf.tokenizer`) without importing transformers where there is one.
    """
    path = Path(path).expanduser().resolve()
    check_architecture(read_gguf(path))
    cached = tokenizer_cache_dir(path) if use_cache else None
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        try:
            return SnapshotTokenizer.load(cached) or _load_and_snapshot(cached)
        except Exception as exc:  # a damaged cache entry is rebuilt, never fatal
            logger.warning("ignoring cached tokenizer %s: %s", cached, exc)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ValueError(
            f"cannot build a tokenizer from GGUF file {str(path)!r}: {exc}; pass "
            "tokenizer=<HF model directory or hub id> to use another one"
        ) from exc
    if cached is not None:
        _save_atomically(tokenizer, cached)
    return tokenizer


def _load_and_snapshot(cached: Path) -> Any:
    """The cached tokenizer through transformers (a cache entry written before snapshots)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cached))
    save_snapshot(tokenizer, cached)
    return tokenizer


def _save_atomically(tokenizer: Any, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent))
        tokenizer.save_pretrained(str(tmp))
        # Of the tokenizer reloaded from the directory, as every later start loaded it (a
        # class like Qwen2Tokenizer rebuilds its backend on load).
        _load_and_snapshot(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError as exc:  # read-only home, full disk: just rebuild next time
        logger.info("could not cache the GGUF tokenizer in %s: %s", target, exc)
