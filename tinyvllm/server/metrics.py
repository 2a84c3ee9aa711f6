"""GET /metrics: Prometheus text exposition (format 0.0.4), written here without a client
library. Names follow vLLM's with a `tinyvllm:` prefix, so dashboards port by renaming.

Gauges and counters come from the engine's `EngineStats` snapshot at scrape time (its
lifetime totals are counters already). Latency histograms need every sample, which the
engine's bounded windows do not keep, so the server observes them itself as outputs stream by.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from tinyvllm.stats import EngineStats

PREFIX = "tinyvllm:"
# Bucket upper bounds in seconds: a first token takes milliseconds to minutes (a long prompt
# on a CPU); a token gap from about a millisecond to seconds (preemption).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0
)  # fmt: skip
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram; observed only from the server's event loop thread."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float, times: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += times
        self.total += value * times
        self.count += times

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{_num(bound)}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {_num(self.total)}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


@dataclass
class ServerMetrics:
    """What the server measures itself: latency histograms and finished requests by reason."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    finished: dict[str, int] = field(default_factory=dict)

    def request_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(stats: EngineStats, server: ServerMetrics, model_name: str) -> str:
    """The exposition text for one scrape."""
    labels = f'model_name="{_escape(model_name)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        full = PREFIX + name
        lines.extend(
            (
                f"# HELP {full} {help_text}",
                f"# TYPE {full} {kind}",
                f"{full}{{{labels}}} {_num(value)}",
            )
        )

    def counter(name: str, help_text: str, value: float) -> None:
        # A counter's family is named without `_total`; its sample carries the suffix.
        full = PREFIX + name
        lines.extend(
            (
                f"# HELP {full} {help_text}",
                f"# TYPE {full} counter",
                f"{full}_total{{{labels}}} {_num(value)}",
            )
        )

    metric("num_requests_running", "gauge", "Requests in the running batch.", stats.num_running)
    metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.num_waiting)
    metric("kv_cache_usage_perc", "gauge", "KV-cache usage (1 means full).", stats.kv_usage)
    counter("num_preemptions", "Preemptions (KV cache full).", stats.total_preemptions)
    counter(
        "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_queries
    )
    counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hits)
    counter("prompt_tokens", "Prefill tokens processed.", stats.total_prompt_tokens)
    counter("generation_tokens", "Tokens generated.", stats.total_generation_tokens)
    counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_drafted_tokens)
    counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_accepted_tokens)
    success = PREFIX + "request_success"
    lines += [f"# HELP {success} Finished requests by finish reason.", f"# TYPE {success} counter"]
    for reason, n in sorted(server.finished.items()):
        lines.append(f'{success}_total{{{labels},finished_reason="{_escape(reason)}"}} {n}')
    for name, hist, help_text in (
        (
            "time_to_first_token_seconds",
            server.ttft,
            "Time from request arrival to its first token.",
        ),
        ("inter_token_latency_seconds", server.itl, "Time between consecutive output tokens."),
        ("e2e_request_latency_seconds", server.e2e, "Time from request arrival to its end."),
    ):
        full = PREFIX + name
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
        lines += hist.lines(full, labels)
    return "\n".join(lines) + "\n"
