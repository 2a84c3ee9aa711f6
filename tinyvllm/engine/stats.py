"""EngineStats: a snapshot of what the engine is doing, cheap to take from any thread.

The engine thread feeds a `StatsCollector` once per step; readers (a UI refreshing several
times a second, a metrics endpoint) call `snapshot()`, which copies a few numbers under a lock
and computes percentiles over bounded windows, so it never waits for a model step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tinyvllm.core.kv_cache_manager import BlockInfo, KVCacheManager

# Throughput is averaged over this many seconds of recent steps.
THROUGHPUT_WINDOW_S = 10.0
# Latency percentiles cover this many most recent samples.
LATENCY_WINDOW = 2000
# Recent prefix-cache hit rate covers this many most recent lookups (requests).
PREFIX_WINDOW = 256


@dataclass(frozen=True)
class LatencySummary:
    """Seconds; None when there are no samples yet."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, samples: list[float]) -> LatencySummary:
        if not samples:
            return cls()
        ordered = sorted(samples)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return cls(
            count=len(ordered),
            mean=sum(ordered) / len(ordered),
            p50=pct(0.50),
            p90=pct(0.90),
            p95=pct(0.95),
            p99=pct(0.99),
        )


@dataclass(frozen=True)
class EngineStats:
    timestamp: float
    # KV cache (blocks).
    num_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_free_blocks: int  # neither used nor holding cached content
    block_size: int
    kv_usage: float  # used / total, in [0, 1]
    # Prefix cache (tokens): lifetime totals and the recent window.
    prefix_cache_enabled: bool
    prefix_queries: int
    prefix_hits: int
    prefix_hit_rate: float
    recent_prefix_hit_rate: float
    prefix_evictions: int
    # Scheduler.
    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    total_preemptions: int
    # Throughput over the recent window (tokens/s) and lifetime totals.
    prompt_throughput: float
    generation_throughput: float
    total_prompt_tokens: int
    total_generation_tokens: int
    num_steps: int
    recent_batch_tokens: float  # mean scheduled tokens per step over the window
    # Latencies (seconds) over the most recent samples.
    ttft: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    num_finished_requests: int
    # Speculative decoding (zero while it is off).
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    # Tokens a request gains per verification: accepted drafts + the target's own token.
    spec_mean_accepted_length: float = 0.0
    spec_current_k: int = 0
    # Optional per-block view (see `Engine.get_stats(include_blocks=True)`).
    blocks: tuple[BlockInfo, ...] = field(default=(), repr=False)


@dataclass
class _Step:
    t: float
    prompt_tokens: int
    generation_tokens: int
    scheduled_tokens: int


class StatsCollector:
    """Accumulates per-step and per-request numbers; owned by the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: deque[_Step] = deque()
        self._ttft: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._itl: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._e2e: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._prefix: deque[tuple[int, int]] = deque(maxlen=PREFIX_WINDOW)
        self._prefix_seen = (0, 0)
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.num_steps = 0
        self.num_finished = 0
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_verify_steps = 0

    def record_step(
        self, now: float, prompt_tokens: int, generation_tokens: int, scheduled_tokens: int
    ) -> None:
        with self._lock:
            self.num_steps += 1
            self.total_prompt_tokens += prompt_tokens
            self.total_generation_tokens += generation_tokens
            self._steps.append(_Step(now, prompt_tokens, generation_tokens, scheduled_tokens))
            horizon = now - THROUGHPUT_WINDOW_S
            while self._steps and self._steps[0].t < horizon:
                self._steps.popleft()

    def record_prefix_counters(self, queries: int, hits: int) -> None:
        """Feed the cache manager's lifetime counters; the window keeps per-step deltas."""
        seen_q, seen_h = self._prefix_seen
        if (queries, hits) == (seen_q, seen_h):
            return
        with self._lock:
            self._prefix.append((queries - seen_q, hits - seen_h))
        self._prefix_seen = (queries, hits)

    def record_tokens(self, first_token_latency: float | None, gaps: list[float]) -> None:
        with self._lock:
            if first_token_latency is not None:
                self._ttft.append(first_token_latency)
            self._itl.extend(gaps)

    def record_finished(self, e2e: float | None) -> None:
        with self._lock:
            self.num_finished += 1
            if e2e is not None:
                self._e2e.append(e2e)

    def record_spec(self, drafted: int, accepted: int, verified_requests: int) -> None:
        with self._lock:
            self.spec_drafted += drafted
            self.spec_accepted += accepted
            self.spec_verify_steps += verified_requests

    def snapshot(
        self,
        kv: KVCacheManager,
        num_running: int,
        num_waiting: int,
        num_preempted_waiting: int,
        total_preemptions: int,
        include_blocks: bool = False,
        spec_current_k: int = 0,
    ) -> EngineStats:
        now = time.monotonic()
        with self._lock:
            steps = list(self._steps)
            ttft, itl, e2e = list(self._ttft), list(self._itl), list(self._e2e)
            prefix = list(self._prefix)
            totals = (self.total_prompt_tokens, self.total_generation_tokens, self.num_steps)
            finished = self.num_finished
            drafted, accepted, verify_steps = (
                self.spec_drafted,
                self.spec_accepted,
                self.spec_verify_steps,
            )
        steps = [s for s in steps if s.t >= now - THROUGHPUT_WINDOW_S]
        span = max(now - steps[0].t, 1e-3) if steps else 0.0
        prompt_tps = sum(s.prompt_tokens for s in steps) / span if steps else 0.0
        gen_tps = sum(s.generation_tokens for s in steps) / span if steps else 0.0
        batch = sum(s.scheduled_tokens for s in steps) / len(steps) if steps else 0.0
        recent_q = sum(q for q, _ in prefix)
        recent_h = sum(h for _, h in prefix)
        pool = kv.pool
        cached_free = pool.num_cached_free
        used = pool.num_used_blocks
        counters = kv.counters
        return EngineStats(
            timestamp=now,
            num_blocks=pool.num_blocks,
            num_used_blocks=used,
            num_cached_free_blocks=cached_free,
            num_free_blocks=pool.num_blocks - used - cached_free,
            block_size=kv.block_size,
            kv_usage=used / pool.num_blocks,
            prefix_cache_enabled=kv.enable_caching,
            prefix_queries=counters.queries,
            prefix_hits=counters.hits,
            prefix_hit_rate=counters.hits / counters.queries if counters.queries else 0.0,
            recent_prefix_hit_rate=recent_h / recent_q if recent_q else 0.0,
            prefix_evictions=pool.num_evictions,
            num_running=num_running,
            num_waiting=num_waiting,
            num_preempted_waiting=num_preempted_waiting,
            total_preemptions=total_preemptions,
            prompt_throughput=prompt_tps,
            generation_throughput=gen_tps,
            total_prompt_tokens=totals[0],
            total_generation_tokens=totals[1],
            num_steps=totals[2],
            recent_batch_tokens=batch,
            ttft=LatencySummary.of(ttft),
            itl=LatencySummary.of(itl),
            e2e=LatencySummary.of(e2e),
            num_finished_requests=finished,
            spec_drafted_tokens=drafted,
            spec_accepted_tokens=accepted,
            spec_acceptance_rate=accepted / drafted if drafted else 0.0,
            spec_mean_accepted_length=1 + accepted / verify_steps if verify_steps else 0.0,
            spec_current_k=spec_current_k,
            blocks=tuple(kv.block_view()) if include_blocks else (),
        )
