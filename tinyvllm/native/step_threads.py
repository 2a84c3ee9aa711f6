"""How many threads a native decode step runs on: all of them, or the calling thread alone,
chosen by measuring both.

Why measure: when another program keeps a core busy, a second thread of ours gets the core
only part of the time, and every parallel region (~150 per step) can wait for the time slice
of a worker the OS has descheduled; the calling thread alone, on the core the competitor
leaves, is then faster. On a quiet machine the workers win (weights stream on both cores).
Which one wins depends on the machine, the load and the batch, so the choice is the measured
step time: each batch size keeps a running estimate per mode, a step runs the mode whose
estimate is lower, and every `interval` steps one step tries the other mode (the interval
doubles while the other mode keeps losing, so a quiet machine pays one slow step in 64, and
returns to `min_interval` when it wins).

The same choice serves torch's intra-op threads on steps torch runs (prefill): its OpenMP
team has the same weakness, and with a competitor a 512-token prefill took 5-10 s on two
threads against 0.2 s on one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of a new step time in the running estimate of the mode that ran it.
_SMOOTHING = 0.25
# Steps of up to this many tokens keep estimates of their own (decode batches); longer ones
# (prefill chunks) share one per power of two, compared per token.
_EXACT_TOKENS = 64
# Steps longer than this run on torch with the thread count the decode steps measure best
# (see CpuPlatform.torch_step): trying both ways there costs too much.
LONG_STEP_TOKENS = _EXACT_TOKENS


def _bucket(num_tokens: int) -> int:
    if num_tokens <= _EXACT_TOKENS:
        return num_tokens
    return 1 << (num_tokens - 1).bit_length()


@dataclass
class StepThreadChoice:
    """The thread count of each step for a pool of `threads` threads (1 or `threads`)."""

    threads: int
    min_interval: int = 8
    max_interval: int = 64
    # (token bucket, alone) -> running estimate of a step's nanoseconds per token.
    estimates: dict[tuple[int, bool], float] = field(default_factory=dict)
    interval: int = 8
    since_trial: int = 0
    alone: bool = False  # the mode of the step in progress
    trial: bool = False  # the step in progress tries the mode that is not the best
    # The best mode at the last step whose bucket had both estimates (trials aside): whether
    # another program holds a core right now, as far as these steps can tell.
    prefers_alone: bool = False

    def choose(self, num_tokens: int) -> int:
        """Threads for the next step of `num_tokens` tokens; call `record` when it is done."""
        if self.threads <= 1:
            return 1
        together = self.estimates.get((_bucket(num_tokens), False))
        alone = self.estimates.get((_bucket(num_tokens), True))
        if together is None or alone is None:  # measure each mode once first
            self.alone, self.trial = together is not None, False
        else:
            best = alone < together
            self.prefers_alone = best
            self.since_trial += 1
            self.trial = self.since_trial >= self.interval
            if self.trial:
                self.since_trial = 0
            self.alone = best != self.trial
        return 1 if self.alone else self.threads

    def record(self, num_tokens: int, elapsed_ns: float) -> None:
        """The wall time of the step `choose` was last asked for."""
        if self.threads <= 1:
            return
        key = (_bucket(num_tokens), self.alone)
        per_token = elapsed_ns / max(1, num_tokens)
        old = self.estimates.get(key)
        if old is None or self.trial:  # a trial replaces what may be a stale estimate
            self.estimates[key] = per_token
        else:
            self.estimates[key] = old + _SMOOTHING * (per_token - old)
        if self.trial:
            other = self.estimates.get((key[0], not self.alone))
            if other is None or self.estimates[key] < other:
                self.interval = self.min_interval
            else:  # back off by at least 2x, by the loss where it lost badly (a slow trial
                # of torch's threads under load costs 40x a step alone)
                loss = max(2.0, self.estimates[key] / other)
                self.interval = min(int(self.interval * loss), self.max_interval)
