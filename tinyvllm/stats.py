"""Public statistics types: what `LLM.get_stats()` and `AsyncLLM.get_stats()` return, and what
a front end (the REPL's /stats, the TUI) draws. Plain data; importing this never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyvllm.core.kv_cache_manager import BlockInfo

__all__ = ["BlockInfo", "EngineStats", "LatencySummary"]


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
    # Hybrid models' recurrent state (zero for models without it): slots for running requests
    # and in use, snapshot slots and snapshots a prefix hit can restore, requests that
    # started from a snapshot (lifetime).
    state_running_slots: int = 0
    state_running_slots_used: int = 0
    state_snapshot_slots: int = 0
    state_snapshots_cached: int = 0
    state_hits: int = 0
    # Optional per-block view (see `Engine.get_stats(include_blocks=True)`).
    blocks: tuple[BlockInfo, ...] = field(default=(), repr=False)
