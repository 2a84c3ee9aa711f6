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
returns to `min_interval` when it wins). While running alone wins, the native steps' choice
also tries the workers once their last step is old enough (`stale_trial_cost`): a program
that held a core may have gone, and steps alone do not notice.

The same choice serves torch's intra-op threads on steps torch runs (prefill): its OpenMP
team has the same weakness, and with a competitor a 512-token prefill took 5-10 s on two
threads against 0.2 s on one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Weight of a new step time in the running estimate of the mode that ran it.
_SMOOTHING = 0.25
# Steps of up to this many tokens keep estimates of their own (decode batches); longer ones
# (prefill chunks) share one per power of two, compared per token.
_EXACT_TOKENS = 64
# Steps longer than this run on torch with the thread count the decode steps measure best
# (see CpuPlatform.torch_step): trying both ways there costs too much.
LONG_STEP_TOKENS = _EXACT_TOKENS
# The native steps' `stale_trial_cost`: 3% (one competitor on two cores: a trial with the
# workers costs ~8 ms over a 15 ms step alone, so one every ~0.27 s).
NATIVE_STALE_TRIAL_COST = 0.03


def _bucket(num_tokens: int, exact_tokens: int = _EXACT_TOKENS) -> int:
    if num_tokens <= exact_tokens:
        return num_tokens
    return 1 << (num_tokens - 1).bit_length()


@dataclass(kw_only=True)
class MeasuredChoice:
    """The faster of two ways to run a step (`second` False or True), per step size, by the
    steps' measured wall time: each size bucket keeps a running estimate per way, a step runs
    the way whose estimate is lower, and every `interval` steps one step tries the other.
    Call `pick` before a step and `record` after it."""

    min_interval: int = 8
    max_interval: int = 64
    # When set: a way that lost its trial by a factor `loss` is tried again only every
    # (loss - 1) / max_trial_cost steps (up to `max_slow_interval`), so its trials cost at most
    # that fraction of the time (a torch step of one row is ~3x a program step: 1 in 64 costs
    # 3%). None: every way's interval stops at `max_interval`.
    max_trial_cost: float | None = None
    max_slow_interval: int = 1024
    # Steps of up to this many tokens keep estimates of their own; longer ones share one per
    # power of two, compared per token.
    exact_tokens: int = _EXACT_TOKENS
    # Steps each way runs in a bucket before the choice compares them; all but the last are
    # replaced by the next (a torch step of a new shape pays oneDNN's kernel generation once:
    # 50 ms per token against 4 on the next step, which then lost to a trial for 100+ steps).
    first_samples: int = 1
    # When set, while the second way is the best: a bucket tries the first way again, whatever
    # the interval, once the time since that way last ran exceeds what its trial is estimated
    # to cost (its step time over the best way's) divided by this fraction, so such trials
    # cost at most that fraction of the time. Why: the second way (running alone) wins while
    # another program holds a core, and its own steps do not slow down when the program goes,
    # so only trials notice; counted in steps, the back-off let a choice outlive the program
    # by up to `max_interval` steps of the bucket, which a short request after an idle spell
    # never reaches (a quiet 32-token run after a loaded one stayed alone: 64 tok/s vs 106).
    stale_trial_cost: float | None = None
    # With `stale_trial_cost`: a gap of this many ns between steps marks the engine as idle
    # meanwhile, after which each bucket tries the first way on its next step (a long
    # idle spell is the likeliest time for the load to have changed).
    idle_gap_ns: int = 50_000_000
    # (token bucket, second) -> running estimate of a step's nanoseconds per token.
    estimates: dict[tuple[int, bool], float] = field(default_factory=dict)
    samples: dict[tuple[int, bool], int] = field(default_factory=dict)
    # (token bucket, second) -> perf_counter_ns of the way's last step in the bucket.
    last_run: dict[tuple[int, bool], int] = field(default_factory=dict)
    last_step_ns: int = 0  # when the last recorded step ended
    resumed_ns: int = 0  # when the first step after the last idle gap started
    interval: int = 8
    since_trial: int = 0
    second: bool = False  # the way of the step in progress
    trial: bool = False  # the step in progress tries the way that is not the best
    # The best way at the last step whose bucket had both estimates (trials aside).
    prefers_second: bool = False

    def pick(self, num_tokens: int, now_ns: int | None = None) -> bool:
        """Whether the next step of `num_tokens` tokens runs the second way (`now_ns`: the
        perf_counter_ns clock, read when not given)."""
        if self.stale_trial_cost is not None:
            now_ns = time.perf_counter_ns() if now_ns is None else now_ns
            if self.last_step_ns and now_ns - self.last_step_ns > self.idle_gap_ns:
                self.resumed_ns = now_ns
        bucket = _bucket(num_tokens, self.exact_tokens)
        first_done = self.samples.get((bucket, False), 0) >= self.first_samples
        if not first_done or self.samples.get((bucket, True), 0) < self.first_samples:
            self.second, self.trial = first_done, False  # measure each way first
        else:
            best = self.estimates[(bucket, True)] < self.estimates[(bucket, False)]
            self.prefers_second = best
            self.since_trial += 1
            self.trial = self.since_trial >= self.interval or self._stale(bucket, not best, now_ns)
            if self.trial:
                self.since_trial = 0
            self.second = best != self.trial
        return self.second

    def _stale(self, bucket: int, second: bool, now_ns: int | None) -> bool:
        """Whether `second`, not the best way of `bucket`, is due a trial by its age."""
        if self.stale_trial_cost is None or second:
            return False
        now = time.perf_counter_ns() if now_ns is None else now_ns
        last = self.last_run.get((bucket, False), now)
        extra = (self.estimates[(bucket, False)] - self.estimates[(bucket, True)]) * bucket
        return last < self.resumed_ns or now - last > extra / self.stale_trial_cost

    def record(self, num_tokens: int, elapsed_ns: float, now_ns: int | None = None) -> None:
        """The wall time of the step `pick` was last asked for (`now_ns` as for `pick`)."""
        key = (_bucket(num_tokens, self.exact_tokens), self.second)
        if self.stale_trial_cost is not None:
            now = time.perf_counter_ns() if now_ns is None else now_ns
            self.last_run[key] = self.last_step_ns = now
        per_token = elapsed_ns / max(1, num_tokens)
        old = self.estimates.get(key)
        count = self.samples[key] = self.samples.get(key, 0) + 1
        # A trial replaces what may be a stale estimate, a later first sample a warm-up one.
        if old is None or self.trial or count <= self.first_samples:
            self.estimates[key] = per_token
        else:
            self.estimates[key] = old + _SMOOTHING * (per_token - old)
        if self.trial:
            other = self.estimates.get((key[0], not self.second))
            if other is None or self.estimates[key] < other:
                self.interval = self.min_interval
            else:  # back off by at least 2x, by the loss where it lost badly (a slow trial
                # of torch's threads under load costs 40x a step alone)
                ratio = self.estimates[key] / other
                loss = max(2.0, ratio)
                self.interval = min(int(self.interval * loss), self._interval_cap(ratio))

    def _interval_cap(self, ratio: float) -> int:
        if self.max_trial_cost is None:
            return self.max_interval
        bounded = int((ratio - 1.0) / self.max_trial_cost)
        return max(self.max_interval, min(bounded, self.max_slow_interval))


@dataclass
class StepThreadChoice(MeasuredChoice):
    """The thread count of each step for a pool of `threads` threads: all (the first way) or
    the calling thread alone (the second)."""

    threads: int

    @property
    def alone(self) -> bool:
        """Whether the step in progress runs alone."""
        return self.second

    @property
    def prefers_alone(self) -> bool:
        """Whether another program holds a core right now, as far as these steps can tell."""
        return self.prefers_second

    @prefers_alone.setter
    def prefers_alone(self, value: bool) -> None:
        self.prefers_second = value

    def choose(self, num_tokens: int, now_ns: int | None = None) -> int:
        """Threads for the next step of `num_tokens` tokens; call `record` when it is done."""
        if self.threads <= 1:
            return 1
        return 1 if self.pick(num_tokens, now_ns) else self.threads

    def record(self, num_tokens: int, elapsed_ns: float, now_ns: int | None = None) -> None:
        if self.threads > 1:
            super().record(num_tokens, elapsed_ns, now_ns)
