"""Live engine statistics: KV block map, cache hit rate, queues, throughput, latency, spec decode.

The panel polls `source()` (an `EngineStats` or None) every REFRESH_S seconds while it is on
the active screen. When no request is in flight, nothing changed since the last poll and the
throughput (over the engine's recent window) has decayed to zero, the timer pauses; `wake()`
(called through the app's engine-activity signal, or when the panel is shown again) resumes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.signal import Signal
from textual.timer import Timer
from textual.widgets import Static

from tinyvllm_tui.widgets.block_map import BlockMap
from tinyvllm_tui.widgets.rate_bars import RateBars

if TYPE_CHECKING:
    from tinyvllm.stats import EngineStats, LatencySummary

REFRESH_S = 0.25
HISTORY = 120  # rate chart points: 30 s at REFRESH_S

StatsSource = Callable[[], "EngineStats | None"]


def fmt_latency(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_percentiles(name: str, summary: LatencySummary) -> str:
    return f"{name:<5} p50 {fmt_latency(summary.p50):>7} · p95 {fmt_latency(summary.p95):>7}"


def fmt_prefix(stats: EngineStats) -> str:
    """The prefix-cache line; hybrid models add their recurrent-state slots and hits."""
    if stats.prefix_cache_enabled:
        line = (
            f"prefix hits {stats.prefix_hit_rate:.1%} · recent {stats.recent_prefix_hit_rate:.1%}"
        )
    else:
        line = "prefix caching off"
    if stats.state_running_slots:
        line += (
            f"\nstate slots {stats.state_running_slots_used}/{stats.state_running_slots} · "
            f"snapshots {stats.state_snapshots_cached}/{stats.state_snapshot_slots} · "
            f"state hits {stats.state_hits}"
        )
    return line


def activity_key(stats: EngineStats) -> tuple[int, ...]:
    """What changes when the engine does anything (throughput windows decay on their own)."""
    return (
        stats.num_used_blocks,
        stats.num_cached_free_blocks,
        stats.num_running,
        stats.num_waiting,
        stats.total_preemptions,
        stats.total_prompt_tokens,
        stats.total_generation_tokens,
        stats.num_finished_requests,
        stats.prefix_queries,
    )


class StatsPanel(Vertical):
    """Reactive view of the engine's `EngineStats`."""

    class Sampled(Message):
        """A fresh snapshot was shown (the app logs preemptions from it)."""

        def __init__(self, stats: EngineStats) -> None:
            super().__init__()
            self.stats = stats

    stats: reactive[EngineStats | None] = reactive(None, init=False)

    def __init__(
        self,
        source: StatsSource,
        activity: Signal[Any] | None = None,
        *,
        map_rows: int = 8,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self._source = source
        self._activity = activity
        self._map_rows = map_rows
        self._last_key: tuple[int, ...] | None = None
        self._prompt_history: deque[float] = deque(maxlen=HISTORY)
        self._gen_history: deque[float] = deque(maxlen=HISTORY)
        self._timer: Timer | None = None
        # False while the timer is paused for idleness (tests and the app read it).
        self.polling = False

    def compose(self) -> ComposeResult:
        yield Static("KV cache", classes="stats-title")
        yield Static("", id="kv-usage")
        yield BlockMap(max_rows=self._map_rows, id="block-map")
        yield Static("", id="prefix")
        yield Static("", id="queues")
        yield Static("", id="prompt-tps")
        yield RateBars(id="prompt-spark")
        yield Static("", id="gen-tps")
        yield RateBars(id="gen-spark")
        yield Static("", id="latency")
        yield Static("", id="spec")

    def on_mount(self) -> None:
        self._timer = self.set_interval(REFRESH_S, self.sample)
        self.polling = True
        if self._activity is not None:
            self._activity.subscribe(self, self.wake)
        # The first picture at once, even while the screen is still being shown: drawn empty
        # first, the panel would flash "no model loaded".
        stats = self._source()
        if stats is None:
            self.query_one("#kv-usage", Static).update("no model loaded")
        else:
            self._last_key = activity_key(stats)
            self._show(stats)

    def on_show(self) -> None:
        self.wake()

    def wake(self, _: object = None) -> None:
        """Resume polling (a request started, a model loaded, the panel became visible)."""
        self._last_key = None
        if self._timer is not None:
            self._timer.resume()
            self.polling = True
            self.sample()  # at once: a panel just shown must not wait a tick to show the engine

    def _hidden(self) -> bool:
        return not (self.display and self.screen.is_active and self.is_on_screen)

    def sample(self) -> None:
        if self._timer is None or self._hidden():
            return
        stats = self._source()
        if stats is None:
            self._pause()
            return
        key = activity_key(stats)
        if _idle(stats) and key == self._last_key and not _moving(stats):
            # Nothing in flight, nothing moved, the rates are down to zero: sleep until wake(),
            # after showing the zero rates if the last picture still had some.
            if self.stats is not None and _moving(self.stats):
                self._show(stats)
            self._pause()
            return
        self._last_key = key
        self._show(stats)

    def _show(self, stats: EngineStats) -> None:
        self._prompt_history.append(stats.prompt_throughput)
        self._gen_history.append(stats.generation_throughput)
        self.stats = stats
        self.post_message(self.Sampled(stats))

    def _pause(self) -> None:
        if self._timer is not None:
            self._timer.pause()
        self.polling = False

    def watch_stats(self, stats: EngineStats | None) -> None:
        if stats is None:
            return
        q = self.query_one
        q("#kv-usage", Static).update(
            f"{stats.kv_usage:.1%} of {stats.num_blocks} blocks × {stats.block_size} tokens\n"
            f"used {stats.num_used_blocks} · cached {stats.num_cached_free_blocks} · "
            f"free {stats.num_free_blocks}"
        )
        q(BlockMap).blocks = stats.blocks
        q("#prefix", Static).update(fmt_prefix(stats))
        q("#queues", Static).update(
            f"running {stats.num_running} · waiting {stats.num_waiting} · "
            f"preempted {stats.num_preempted_waiting} ({stats.total_preemptions} total)"
        )
        # The rates cover the engine's recent window: after the last request they decay to zero.
        idle = " · idle" if _idle(stats) else ""
        q("#prompt-tps", Static).update(f"prompt     {stats.prompt_throughput:7.1f} tok/s{idle}")
        q("#prompt-spark", RateBars).data = list(self._prompt_history)
        q("#gen-tps", Static).update(f"generation {stats.generation_throughput:7.1f} tok/s{idle}")
        q("#gen-spark", RateBars).data = list(self._gen_history)
        q("#latency", Static).update(
            fmt_percentiles("TTFT", stats.ttft) + "\n" + fmt_percentiles("ITL", stats.itl)
        )
        spec = q("#spec", Static)
        spec.display = stats.spec_drafted_tokens > 0
        if spec.display:
            spec.update(
                f"spec {stats.spec_acceptance_rate:.1%} accepted · "
                f"{stats.spec_mean_accepted_length:.2f} tok/step · K={stats.spec_current_k}"
            )


def _idle(stats: EngineStats) -> bool:
    return stats.num_running == 0 and stats.num_waiting == 0


def _moving(stats: EngineStats) -> bool:
    return stats.prompt_throughput > 0 or stats.generation_throughput > 0
