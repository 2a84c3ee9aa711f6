"""The seam between the TUI and tinyvllm: what the screens need, and the real implementation.

Screens talk only to a `Backend` (catalog rows, a blocking `load`) and to what it returns: an
engine that answers `get_stats()` and `shutdown()`, and a chat session that streams text. The
real backend wraps `tinyvllm.catalog`, `AsyncLLM` and `ChatSession`; `scripted.py` provides a
canned one for snapshot tests and for trying the UI without a model.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tinyvllm.stats import EngineStats


class LoadError(Exception):
    """A model could not be found, downloaded or loaded; the message is one sentence."""


class EngineLike(Protocol):
    def get_stats(self, include_blocks: bool = False) -> EngineStats: ...

    def shutdown(self) -> None: ...


class TurnLike(Protocol):
    def line(self) -> str: ...


class ChatLike(Protocol):
    """What the chat screen needs from `tinyvllm.chat.session.ChatSession`."""

    messages: list[dict[str, Any]]
    system: str | None

    def reset(self) -> None: ...

    def send(self, text: str | list[dict[str, Any]]) -> AsyncGenerator[str, None]: ...

    def stop(self) -> None: ...

    @property
    def last_turn(self) -> TurnLike | None: ...

    def set_param(self, key: str, value: Any) -> None: ...

    def settings(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class CatalogRow:
    name: str
    description: str
    size: str
    on_disk: str  # where the files are ("" when they would have to be downloaded)
    default: bool = False


@dataclass(frozen=True)
class LoadProgress:
    """One progress report from `Backend.load` (sent from its thread)."""

    stage: str  # "download" | "load"
    description: str
    done: float | None = None  # bytes so far, None when unknown
    total: float | None = None
    rate: float | None = None  # bytes/s

    def line(self) -> str:
        if self.done is None:
            return self.description
        parts = [self.description, _mib(self.done)]
        if self.total:
            parts[-1] += f" / {_mib(self.total)}"
        if self.rate:
            parts.append(f"{_mib(self.rate)}/s")
        return "  ".join(parts)


@dataclass
class LoadedModel:
    name: str
    llm: EngineLike
    seconds: float
    detail: str = ""  # where it came from, for the log


ProgressCallback = Callable[[LoadProgress], None]
NoticeCallback = Callable[[str], None]


class Backend(Protocol):
    def catalog(self, query: str = "") -> list[CatalogRow]:
        """Catalog entries matching `query` (all when empty), with what is on disk."""
        ...

    def load(self, spec: str, progress: ProgressCallback) -> LoadedModel:
        """Resolve `spec` (catalog name, hub id, directory or .gguf file; "" for the default),
        download if needed and build the engine. Blocking: call it from a thread worker.
        Raises LoadError."""
        ...

    def session(self, llm: EngineLike, notice: NoticeCallback) -> ChatLike:
        """A new conversation on `llm`; `notice` gets one-line remarks (dropped turns)."""
        ...


class EngineBackend:
    """tinyvllm itself: its catalog, `AsyncLLM` and `ChatSession`."""

    def __init__(self, engine_kwargs: dict[str, Any] | None = None) -> None:
        # Caller's engine arguments win over the catalog's suggestions.
        self.engine_kwargs = dict(engine_kwargs or {})

    def catalog(self, query: str = "") -> list[CatalogRow]:
        from tinyvllm.catalog import load_catalog, locate

        catalog = load_catalog()
        entries = catalog.search(query) if query.strip() else catalog.entries
        rows = []
        for entry in entries:
            if not entry.chat:  # embedding models (e.g. all-MiniLM-L6-v2) cannot chat
                continue
            local = locate(entry)
            rows.append(
                CatalogRow(
                    name=entry.name,
                    description=entry.description,
                    size=entry.params,
                    on_disk=local.where if local is not None else "",
                    default=entry.name == catalog.default_name,
                )
            )
        return rows

    def load(self, spec: str, progress: ProgressCallback) -> LoadedModel:
        from tinyvllm import AsyncLLM
        from tinyvllm.catalog import CatalogError, ModelNotAvailable, resolve_model

        def on_download(p: Any) -> None:
            progress(LoadProgress("download", p.description, p.downloaded, p.total, p.bytes_per_s))

        start = time.perf_counter()
        try:
            resolved = resolve_model(spec.strip() or None, progress=on_download)
        except (ModelNotAvailable, CatalogError) as exc:
            raise LoadError(str(exc)) from exc
        name = resolved.name
        progress(LoadProgress("load", f"Loading {name} ({resolved.source})…"))
        kwargs = {**resolved.engine_kwargs(), **self.engine_kwargs}
        try:
            llm = AsyncLLM(resolved.model, **kwargs)
        except (ValueError, OSError, RuntimeError, KeyError, NotImplementedError) as exc:
            # The engine's own errors name the bad value; keep their first line.
            raise LoadError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from exc
        return LoadedModel(name, llm, time.perf_counter() - start, resolved.source)

    def session(self, llm: EngineLike, notice: NoticeCallback) -> ChatLike:
        from tinyvllm.chat import ChatSession

        return ChatSession(llm, notice=notice)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"
