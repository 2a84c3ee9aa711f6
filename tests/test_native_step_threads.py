"""Each native decode step's thread count, chosen by measuring both modes
(tinyvllm/native/step_threads.py), and the pool following the choice (tv_pool_govern)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import load_library, unsupported_reason
from tinyvllm.native.step_threads import StepThreadChoice

native_only = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


def run_steps(choice: StepThreadChoice, cost: dict[int, float], steps: int, tokens: int = 1):
    """Steps whose wall time is cost[threads]; returns how many ran alone."""
    alone = 0
    for _ in range(steps):
        threads = choice.choose(tokens)
        alone += threads == 1
        choice.record(tokens, cost[threads])
    return alone


def test_quiet_machine_keeps_the_workers_and_rarely_tries_alone() -> None:
    choice = StepThreadChoice(2)
    alone = run_steps(choice, {2: 10e6, 1: 16e6}, 1000)
    assert alone <= 1000 / choice.max_interval + 6, alone  # back-off: one trial in 64 at most
    assert choice.interval == choice.max_interval


def test_busy_machine_runs_alone_and_follows_the_load() -> None:
    choice = StepThreadChoice(2)
    run_steps(choice, {2: 10e6, 1: 16e6}, 200)  # quiet first
    # A competitor arrives: the workers' steps now wait for descheduled threads.
    alone = run_steps(choice, {2: 30e6, 1: 16e6}, 200)
    assert alone >= 190, alone
    # It leaves again: back to the workers within one back-off interval and a few steps.
    together = 200 - run_steps(choice, {2: 10e6, 1: 16e6}, 200)
    assert together >= 200 - choice.max_interval - 8, together


def test_batch_sizes_keep_their_own_estimates() -> None:
    choice = StepThreadChoice(2)
    for _ in range(100):  # batch 1 is faster alone, batch 16 with the workers
        for tokens, cost in ((1, {2: 20e6, 1: 12e6}), (16, {2: 30e6, 1: 55e6})):
            threads = choice.choose(tokens)
            choice.record(tokens, cost[threads])
    assert choice.choose(1) == 1 or choice.trial
    choice.record(1, 12e6)
    assert choice.estimates[(1, True)] < choice.estimates[(1, False)]
    assert choice.estimates[(16, False)] < choice.estimates[(16, True)]


class Clock:
    """Steps on a simulated clock: each takes its cost in ns."""

    def __init__(self) -> None:
        self.now = 1

    def steps(self, choice: StepThreadChoice, cost: dict[int, float], count: int) -> list[int]:
        """The threads of `count` one-token steps."""
        seen = []
        for _ in range(count):
            threads = choice.choose(1, self.now)
            self.now += int(cost[threads])
            choice.record(1, cost[threads], self.now)
            seen.append(threads)
        return seen


def test_the_workers_are_tried_again_after_an_idle_spell() -> None:
    """A choice to run alone made while a competitor held a core is retried on the first
    step after the engine was idle, and on a quiet machine the workers win at once (counted
    in steps, the back-off kept a 32-step request alone throughout)."""
    choice = StepThreadChoice(2, stale_trial_cost=0.03)
    clock = Clock()
    loaded, quiet = {2: 25e6, 1: 15e6}, {2: 9e6, 1: 15e6}
    assert clock.steps(choice, loaded, 200)[-20:].count(1) >= 18
    clock.now += 100_000_000  # idle: the competitor leaves meanwhile
    assert clock.steps(choice, quiet, 32)[:2] == [2, 2]


def test_age_trials_cost_at_most_their_share_under_a_steady_load() -> None:
    choice = StepThreadChoice(2, stale_trial_cost=0.03)
    clock = Clock()
    loaded = {2: 25e6, 1: 15e6}
    seen = clock.steps(choice, loaded, 2000)
    extra = seen[100:].count(2) * (loaded[2] - loaded[1])
    assert extra <= 0.04 * (clock.now - 100 * loaded[1]), seen.count(2)
    # Without the age rule only the back-off interval tries the workers.
    plain = StepThreadChoice(2)
    assert 2000 - run_steps(plain, loaded, 2000) < seen.count(2) < 2000 * 0.1


def test_age_trials_leave_a_quiet_machine_alone() -> None:
    """While the workers win, steps alone are tried by the back-off interval only (a
    competitor that arrives slows the workers' own steps; no trial needed to notice)."""
    choice = StepThreadChoice(2, stale_trial_cost=0.03)
    clock = Clock()
    seen = clock.steps(choice, {2: 9e6, 1: 15e6}, 1000)
    clock.now += 100_000_000
    seen += clock.steps(choice, {2: 9e6, 1: 15e6}, 1000)
    assert seen.count(1) <= 2000 / choice.max_interval + 8, seen.count(1)


def test_one_thread_has_nothing_to_choose() -> None:
    choice = StepThreadChoice(1)
    assert run_steps(choice, {1: 1e6}, 10) == 10
    assert choice.estimates == {}


def _pool_stats(lib: ctypes.CDLL) -> list[int]:
    """Regions with workers, regions alone, switches to alone, ns stalled, claims."""
    stats = (ctypes.c_int64 * 5)()
    lib.tv_pool_stats(stats)
    return list(stats)


def _pool_regions(lib: ctypes.CDLL) -> int:
    stats = _pool_stats(lib)
    return stats[0] + stats[1]  # regions the pool ran, with workers or alone


@native_only
def test_pool_claims_shrinking_shares_and_runs_every_item_once() -> None:
    """A 2-thread GEMV of 128 items (32 rows each) takes a few claims, not one per item (each
    claim moves a contended cache line between cores), and gives the 1-thread bits."""
    lib = load_library()
    ops = NativeCpuOps(lib, 2)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(128 * 32 + 5, 64, generator=gen)  # an odd last item
    x = torch.randn(1, 64, generator=gen)
    try:
        lib.tv_pool_govern(1)
        ref = ops.linear(x, w, None)
        lib.tv_pool_govern(2)
        before = _pool_stats(lib)
        got = ops.linear(x, w, None)
        after = _pool_stats(lib)
    finally:
        lib.tv_pool_govern(0)
    assert after[0] == before[0] + 1
    claims = after[4] - before[4]
    assert 1 <= claims <= 64, claims  # one claim per item would be 129
    assert torch.equal(got, ref)


@native_only
def test_governed_pool_runs_alone_when_told() -> None:
    lib = load_library()
    ops = NativeCpuOps(lib, 2)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(256, 64, generator=gen)
    x = torch.randn(2, 64, generator=gen)
    ref = ops.linear(x, w, None)
    try:
        lib.tv_pool_govern(1)
        before = _pool_regions(lib)
        got = ops.linear(x, w, None)
        assert _pool_regions(lib) == before  # ran on the calling thread, no region
        lib.tv_pool_govern(2)
        assert torch.equal(ops.linear(x, w, None), got)
        assert _pool_regions(lib) == before + 1
    finally:
        lib.tv_pool_govern(0)
    assert torch.equal(got, ref)


@native_only
def test_decode_steps_measure_both_modes(tiny_models) -> None:
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128)
    ops = llm.engine.runner.platform.native
    if ops.num_threads < 2:
        pytest.skip("one core: nothing to choose")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
    modes = {alone for tokens, alone in ops.step_threads.estimates if tokens == 1}
    assert modes == {False, True}


def test_a_mode_that_loses_badly_is_tried_rarely() -> None:
    """Under load torch's two-thread prefill took 40x the one-thread time: its trials must
    back off by the loss, not one doubling at a time."""
    choice = StepThreadChoice(2, max_interval=256)
    together = 1000 - run_steps(choice, {2: 400e6, 1: 10e6}, 1000, tokens=512)
    assert together <= 6, together


def test_long_steps_compare_per_token_within_a_power_of_two() -> None:
    choice = StepThreadChoice(2)
    choice.choose(300)
    choice.record(300, 300e6)  # together: 1 ms per token
    assert choice.choose(500) == 1  # same bucket (512), alone not measured yet
    choice.record(500, 250e6)  # alone: 0.5 ms per token
    assert choice.choose(400) == 1


def test_long_torch_steps_follow_the_decode_steps_choice() -> None:
    """A long torch step (a prefill chunk, a video's vision tower) never tries one thread on
    its own: on a quiet machine that trial doubled a 2k-token video prefill. It runs on the
    count the decode steps' cheap trials measure best."""
    from tinyvllm.platforms.cpu import CpuPlatform

    native = NativeCpuOps.load()
    if native is None or torch.get_num_threads() < 2:
        pytest.skip("needs the native library and two torch threads")
    platform = CpuPlatform(torch.device("cpu"), torch.float32, native)
    full = platform.torch_threads.threads

    def threads_of_long_steps(count: int) -> list[int]:
        seen = []
        for _ in range(count):
            with platform.torch_step(2048):
                seen.append(torch.get_num_threads())
        return seen

    assert threads_of_long_steps(4) == [full] * 4  # quiet so far: all threads, no trial
    native.step_threads.prefers_alone = True  # decode steps found a core taken
    assert threads_of_long_steps(2) == [1, 1]
    native.step_threads.prefers_alone = False
    assert threads_of_long_steps(1) == [full]
    assert torch.get_num_threads() == full


def test_a_slow_first_step_does_not_pin_a_bucket() -> None:
    """The first torch step of a new shape pays oneDNN's kernel generation (a 16-row decode
    step measured 50 us per token on two threads, 4 after): with two first samples that
    warm-up step is replaced, not compared, even when trials are rare (interval at its
    maximum after another bucket's trials lost)."""
    choice = StepThreadChoice(2, max_interval=256, first_samples=2)
    choice.interval = choice.max_interval
    together = 0
    for _ in range(100):
        threads = choice.choose(16)
        together += threads == 2
        warm_up = threads == 2 and together == 1
        choice.record(16, 16 * (50e3 if warm_up else 3e3 if threads == 2 else 4e3))
    assert together >= 95, together


def test_empty_steps_teach_no_choice() -> None:
    """AsyncLLM's flush after a finished request is an empty step: timing it taught the
    decode choice a bucket of noise that set which way the next prefill ran."""
    from tinyvllm.platforms.cpu import CpuPlatform

    native = NativeCpuOps.load()
    if native is None:
        pytest.skip("needs the native library")
    platform = CpuPlatform(torch.device("cpu"), torch.float32, native)
    for native_step in (True, False, True):
        platform.start_step(0, native_step)
        platform.finish_step()
    assert native.step_threads.estimates == {}
    assert platform.torch_threads.estimates == {}


def test_a_long_step_after_idle_counts_what_others_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first prefill after an idle spell: the decode steps' choice is stale, so the CPU
    time other programs used meanwhile decides (with a core taken, torch's two spinning
    threads ran a 16 x 32-token prefill 10x slower than one). This process's own CPU time
    since the mark is not theirs."""
    import tinyvllm.platforms.cpu as cpu
    from tinyvllm.platforms.cpu import CpuPlatform

    native = NativeCpuOps.load()
    if native is None or torch.get_num_threads() < 2:
        pytest.skip("needs the native library and two torch threads")
    clock = {"ns": 10**12, "ticks": (1000, 2000), "own": 5.0}
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cpu.time, "perf_counter_ns", lambda: clock["ns"])
    monkeypatch.setattr(cpu.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(cpu, "cpu_time_jiffies", lambda: clock["ticks"])
    monkeypatch.setattr(cpu, "runnable_elsewhere", lambda: 0)  # without a spell: nobody else
    platform = CpuPlatform(torch.device("cpu"), torch.float32, native)
    full = platform.torch_threads.threads
    native.step_threads.prefers_alone = False
    platform.start_step(1, True)
    platform.finish_step()  # the mark: (1000, 2000) ticks, 5 s of our CPU

    def after_idle(idle: int, total: int, own_s: float = 0.0) -> int:
        # 0.2 s later (2 CPUs x 20 ticks), `own_s` of it this process's.
        clock["ns"] += 2 * cpu.IDLE_PROBE_NS
        clock["ticks"], clock["own"] = (1000 + idle, 2000 + total), 5.0 + own_s
        try:
            return platform._torch_step_threads(2048)
        finally:
            clock["ns"] -= 2 * cpu.IDLE_PROBE_NS

    assert platform._torch_step_threads(2048) == full  # no idle spell: the steps' choice
    assert after_idle(38, 40) == full  # 1.9 CPUs idle
    assert after_idle(20, 40) == 1  # another program held a core
    assert after_idle(20, 40, own_s=0.2) == full  # the busy core was ours (before the spell)
    assert after_idle(2, 4) == full  # too few ticks to tell: the steps' choice

    # A long spell: the average is old; who is runnable now must agree before it costs
    # threads (the program may have exited). A short spell keeps the average (the test's
    # runnable count is 0 throughout, so the cases above show that).
    clock["ns"] += cpu.IDLE_SPELL_STALE_NS
    busy_now = {"n": 0}
    monkeypatch.setattr(cpu, "runnable_elsewhere", lambda: busy_now["n"])
    assert after_idle(20, 40) == full  # it held a core, and has gone
    busy_now["n"] = 1
    assert after_idle(20, 40) == 1  # still there
    assert after_idle(38, 40) == full  # idle spell: no look needed


def test_a_long_step_without_idle_counts_who_wants_a_core_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill right after other steps (no idle spell): the decode steps' choice can lag a
    competitor that just started (torch's two threads then ran a 16 x 32-token prefill in
    23 s against 2.4 s on one), so a long step counts other programs' runnable tasks now, to
    take fewer threads only; a task seen once only (short-lived) does not count, and short
    steps keep the steps' choice."""
    import tinyvllm.platforms.cpu as cpu
    from tinyvllm.platforms.cpu import CpuPlatform

    native = NativeCpuOps.load()
    if native is None or torch.get_num_threads() < 2:
        pytest.skip("needs the native library and two torch threads")
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: 2)
    seen: list[int] = []
    monkeypatch.setattr(cpu, "runnable_elsewhere", lambda: seen.pop(0))
    platform = CpuPlatform(torch.device("cpu"), torch.float32, native)
    full = platform.torch_threads.threads
    native.step_threads.prefers_alone = False
    platform.start_step(1, True)
    platform.finish_step()  # a step just ended: no idle spell

    def long_step(*counts: int, tokens: int = 2048) -> int:
        seen[:] = list(counts)
        threads = platform._torch_step_threads(tokens)
        assert not seen  # every look was taken
        return threads

    assert long_step(*[1] * cpu.RUNNABLE_LOOKS) == 1  # a busy program holds a core
    assert long_step(0) == full  # nobody else: one look
    assert long_step(1, 0) == full  # gone at the second look
    assert long_step(2, 1, 0) == full  # tasks about to sleep after the last step
    assert long_step(2, 2, 2, 2) == 1
    assert long_step(1, 1, 1, 2) == 1  # the fewest count
    assert long_step(tokens=cpu.RUNNABLE_PROBE_TOKENS - 1) == full  # short: no look
    native.step_threads.prefers_alone = True  # the decode steps run alone: so does it
    assert long_step() == 1  # (load outside this machine's view shows in their times only)
