"""StatsCollector: builds `EngineStats` snapshots, cheap to take from any thread.

The engine thread feeds a `StatsCollector` once per step; readers (a UI refreshing several
times a second, a metrics endpoint) call `snapshot()`, which copies a few numbers under a lock
and computes percentiles over bounded windows, so it never waits for a model step. The KV
cache and the scheduler report their own numbers (`KVCacheStats`, `SchedulerStats`); the
public result types live in `tinyvllm.stats`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from tinyvllm.core.kv_cache_manager import KVCacheStats
from tinyvllm.core.scheduler import SchedulerStats
from tinyvllm.stats import EngineStats, LatencySummary

# Throughput is averaged over this many seconds of recent steps.
THROUGHPUT_WINDOW_S = 10.0
# Latency percentiles cover this many most recent samples.
LATENCY_WINDOW = 2000
# Recent prefix-cache hit rate covers this many most recent lookups (requests).
PREFIX_WINDOW = 256


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
        self.spec_current_k = 0

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

    def record_spec_k(self, k: int) -> None:
        """The K the speculator chose for its latest proposals (from `ModelRunnerOutput`)."""
        self.spec_current_k = k

    def snapshot(self, kv: KVCacheStats, sched: SchedulerStats) -> EngineStats:
        """Combine the collector's numbers with the ones the KV cache and scheduler report."""
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
        return EngineStats(
            timestamp=now,
            num_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_free_blocks=pool.num_free_blocks,
            block_size=kv.block_size,
            # A pooling model has no KV cache (zero blocks).
            kv_usage=pool.num_used_blocks / pool.num_blocks if pool.num_blocks else 0.0,
            prefix_cache_enabled=kv.prefix_caching,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            prefix_hit_rate=kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
            recent_prefix_hit_rate=recent_h / recent_q if recent_q else 0.0,
            prefix_evictions=pool.num_evictions,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_preempted_waiting=sched.num_preempted_waiting,
            total_preemptions=sched.total_preemptions,
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
            spec_current_k=self.spec_current_k,
            **_state_fields(kv),
            blocks=kv.blocks,
        )


def _state_fields(kv: KVCacheStats) -> dict[str, int]:
    """Hybrid models' recurrent-state slots (EngineStats' defaults of 0 otherwise)."""
    state = kv.state
    if state is None:
        return {}
    return {
        "state_running_slots": state.num_running_slots,
        "state_running_slots_used": state.num_used_running_slots,
        "state_snapshot_slots": state.num_snapshot_slots,
        "state_snapshots_cached": state.num_cached_snapshots,
        "state_hits": state.num_restores,
    }
