"""The CPU platform: the native kernels (tinyvllm/native/) where they load, and fp32 copies
of GEMM weights where the CPU has no bf16 matmul."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionBackend
from tinyvllm.attention.cpu_native import NativeCpuAttentionBackend
from tinyvllm.models.layers.linear import (
    Fp32CopyBudget,
    attach_fp32_gemm_weights,
    attach_packed_gemm_weights,
    packed_gemm_supported,
)
from tinyvllm.native.decode_route import PROGRAM, DecodeRoute
from tinyvllm.native.llama_decode import LlamaDecodeProgram
from tinyvllm.native.omp_team import release_thread_team, torch_omp_parallel
from tinyvllm.native.ops import NativeCpuOps, attach_native_ops
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.native.step_threads import LONG_STEP_TOKENS, StepThreadChoice
from tinyvllm.platforms.interface import Platform
from tinyvllm.platforms.weight_pages import move_weights_to_huge_pages
from tinyvllm.utils.cpu import (
    FP32_GEMM_MIN_ROWS,
    cpu_time_jiffies,
    has_native_bf16_matmul,
    runnable_elsewhere,
)
from tinyvllm.utils.memory import release_free_heap
from tinyvllm.utils.omp import omp_waits_spin

logger = logging.getLogger(__name__)

# Row counts whose bf16 GEMMs run on oneDNN-prepacked weight copies where the CPU has bf16
# matmul (attach_packed_gemm_weights): decode batches the route sends to the layers, and small
# mixed steps. Fewer rows run on the native program (a single stream never takes the copies,
# not even in the route's trials of the layers); a prefill chunk's thousands of rows amortise
# oneDNN's per-call reorder of the plain weight.
PACKED_GEMM_MIN_ROWS = 8
PACKED_GEMM_MAX_ROWS = 256
# A decode-sized step (up to this many tokens) right after a step of at least
# HEAP_RELEASE_AFTER_TOKENS hands the C heap's free memory back to the OS first
# (release_free_heap). Why: the big step's freed activations stay mapped for the next big step
# (keep_freed_heap_mapped) and sat in RSS under the KV cache the decode steps then grow: the
# real SmolLM2-135M Q4_1's 16-request batch peaked at 443-444 MiB, 427-429 with this. One
# malloc_trim per burst of prefill; the next big step faults its activations in again.
HEAP_RELEASE_STEP_TOKENS = 64
HEAP_RELEASE_AFTER_TOKENS = 256
# A long torch step this long after the last step ended (an idle spell) counts the clock ticks
# other programs used meanwhile, over at least this many ticks (/proc/stat counts 100 a second
# per CPU), to choose its thread count.
IDLE_PROBE_NS = 100_000_000
IDLE_PROBE_MIN_TICKS = 10
# A spell longer than this is an old average: where it says another program held a core, a
# look at who is runnable now must agree (seen: a benchmark peer that ran for minutes and had
# just exited cost the next 4,096-token prefill half its threads, 1.9x its time).
IDLE_SPELL_STALE_NS = 2_000_000_000
# Long steps from this many tokens on, without an idle spell before them, count the runnable
# tasks of other programs (/proc, ~0.1-0.3 ms: under 1% of such a step even with AMX).
RUNNABLE_PROBE_TOKENS = 256
# Where the first look sees some, up to this many looks this far apart, the fewest counting:
# right after a step, tasks that are about to sleep (seen: 1-2 at the first look or two, in a
# third of the long steps on a quiet machine, gone ~0.5 ms later) pass for other programs'
# runnable tasks; a CPU-bound competitor is there at every look. At most ~1.5 ms a step.
RUNNABLE_LOOKS = 4
RUNNABLE_LOOK_GAP_S = 0.0005


class CpuPlatform(Platform):
    """`native`: the loaded kernel library (None: torch ops only, as under enforce_eager or
    where the library cannot build). With it, decode steps run through native kernels that
    cut per-op dispatch and read weights and paged KV in place: the CPU counterpart of CUDA
    graphs."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        native: NativeCpuOps | None,
        fp32_weight_copy_bytes: int | None = None,
    ) -> None:
        super().__init__(device, dtype)
        self.native = native
        # fp32 GEMM weight copies are made on first use within this; target and draft share it.
        self.fp32_copy_budget = Fp32CopyBudget(fp32_weight_copy_bytes)
        self.name = "cpu" if native is None else "cpu_native"
        # torch's intra-op threads per torch-run step: all, or one when that measures faster
        # (another program on the cores makes every OpenMP region wait for its time slice).
        self.torch_threads = StepThreadChoice(
            torch.get_num_threads(), max_interval=256, first_samples=2
        )
        # Program or layers per decode step (decode_route.py); set with a bf16 program on a
        # CPU with bf16 dot products (fixed to the program where it has AMX linears), None
        # elsewhere (every step the program supports).
        self.decode_route: DecodeRoute | None = None
        self._quant_kernels = (
            None if native is None else QuantKernels(native.lib, native.num_threads)
        )
        # torch's OpenMP team, where its workers spin between ops (no wait policy chosen, see
        # utils/omp.py): the row kernels of a step torch runs go to that team,
        # as the prefill attention does, instead of the pool's workers competing with the
        # spinning ones for the cores (8 x 512-token prefill: norms 196 -> ~100 ms).
        self._spinning_team = (
            torch_omp_parallel() if native is not None and omp_waits_spin() else None
        )
        # Inside `steps_in_a_row`: torch's thread count before the block (0: outside one).
        self._threads_before_steps = 0
        # The step in progress (one at a time), from `start_step` for `finish_step`.
        self._step_tokens = self._step_start = self._step_restore_threads = 0
        self._last_step_tokens = 0  # the previous step's, for HEAP_RELEASE_AFTER_TOKENS
        # When the last step ended (perf_counter_ns), and a mark taken at most every
        # IDLE_PROBE_NS / 2 at a step's end: (perf_counter_ns, the machine's (idle, total)
        # CPU ticks, this process's CPU seconds). A long step after an idle spell measures
        # what other programs used since the mark.
        self._finish_ns = 0
        self._cpu_mark: tuple[int, tuple[int, int], float] | None = None
        self._step_native = self._step_gemms = self._step_chooses_threads = False

    @property
    def quant_kernels(self) -> QuantKernels | None:
        return self._quant_kernels

    @property
    def native_layer_ops(self) -> bool:
        return self.native is not None

    def routes_to_program(self, num_tokens: int) -> bool:
        route = self.decode_route
        return route is None or route.takes_program(num_tokens)

    def hand_over_steps(self) -> None:
        # The builder's idle OpenMP workers would make torch's workers in the stepping thread
        # sleep between ops (omp_team.release_thread_team).
        release_thread_team()

    @contextlib.contextmanager
    def steps_in_a_row(self) -> Iterator[None]:
        # Decode steps keep torch at one thread: without the block each one sets it and sets
        # it back (~25 us a step once the weights have streamed through the caches).
        if self._threads_before_steps:  # nested: the outer block restores
            yield
            return
        self._threads_before_steps = torch.get_num_threads()
        try:
            yield
        finally:
            if torch.get_num_threads() != self._threads_before_steps:
                torch.set_num_threads(self._threads_before_steps)
            self._threads_before_steps = 0

    def start_step(self, num_tokens: int, native: bool) -> None:
        native_ops = self.native
        if (
            0 < num_tokens <= HEAP_RELEASE_STEP_TOKENS
            and self._last_step_tokens >= HEAP_RELEASE_AFTER_TOKENS
        ):
            release_free_heap()
        if num_tokens:
            self._last_step_tokens = num_tokens
        self._step_tokens = num_tokens
        self._step_native = native and native_ops is not None
        self._step_gemms = self._step_chooses_threads = False
        if num_tokens == 0:
            # An empty step (AsyncLLM's flush after a request finished): nothing to choose a
            # thread count for, and its time would teach the choices noise (the winner of
            # the decode choice's bucket 0 set `prefers_alone`, which long steps follow).
            self._step_native = False
            self._step_restore_threads = 0
            self._step_start = time.perf_counter_ns()
            return
        if self._step_native:
            assert native_ops is not None
            # The native kernels run this step on their own threads (all, or the caller
            # alone: `step_threads`); torch's OpenMP workers, woken by sampling, would spin
            # for milliseconds on the same cores.
            native_ops.lib.tv_pool_govern(native_ops.step_threads.choose(num_tokens))
            threads = 1
        else:
            route = self.decode_route
            if route is not None and route.take_layers_step():
                # The route sent this decode step to the layers: their linears go to torch's
                # GEMMs (the point of the route), timed against the program's steps.
                assert native_ops is not None
                native_ops.gemv_linears = False
                self._step_gemms = True
            threads = self._torch_step_threads(num_tokens)
            if native_ops is not None:
                native_ops.row_team = self._spinning_team
        # Set only where it changes (then restored by `finish_step`; 0: nothing to restore,
        # or steps in a row: the next step sets what it needs, the block's end restores).
        before = torch.get_num_threads()
        held = self._threads_before_steps
        self._step_restore_threads = before if threads != before and not held else 0
        if threads != before:
            torch.set_num_threads(threads)
        self._step_start = time.perf_counter_ns()

    def _torch_step_threads(self, num_tokens: int) -> int:
        if num_tokens > LONG_STEP_TOKENS and self.native is not None:
            # A long step (a prefill chunk, a vision tower over a video) is too dear to try
            # both ways: one trial on one thread costs seconds on a quiet machine (a 2k-token
            # video prefill: 2x). The decode steps' cheap trials already tell whether another
            # program holds a core; follow them, unless the engine was idle: then what other
            # programs used meanwhile is measured (the steps' choice is stale, and torch's
            # spinning threads with a core taken ran a 16 x 32-token prefill 10x slower).
            threads = self.torch_threads.threads
            busy = self._cpus_busy_while_idle()
            if (
                busy is not None
                and busy > 0.25
                and time.perf_counter_ns() - self._finish_ns > IDLE_SPELL_STALE_NS
            ):
                now = self._runnable_elsewhere_now()
                busy = busy if now is None else min(busy, now)
            if busy is None:
                threads = 1 if self.native.step_threads.prefers_alone else threads
                if threads == 1 or num_tokens < RUNNABLE_PROBE_TOKENS:
                    return threads
                # The decode steps' choice can lag a competitor that just started (their
                # trials are seconds apart): count who wants a core right now. Only to take
                # fewer threads: load from outside this machine's view (a VM's neighbours)
                # shows in the steps' times, not in /proc.
                busy = self._runnable_elsewhere_now()
            if busy is not None:
                # Biased to fewer threads: one too many with a core taken costs ~10x, one
                # too few on an idle core 2x.
                free = (os.cpu_count() or threads) - busy
                return threads if free >= threads - 0.25 else max(1, int(free + 0.25))
            return threads
        self._step_chooses_threads = True
        return self.torch_threads.choose(num_tokens)

    @staticmethod
    def _runnable_elsewhere_now() -> float | None:
        """Other programs' runnable tasks now: where the first look sees some, more looks a
        little later, the fewest counting (a short-lived task must not cost a step half its
        threads)."""
        others = runnable_elsewhere()
        for _ in range(RUNNABLE_LOOKS - 1):
            if not others:
                break
            time.sleep(RUNNABLE_LOOK_GAP_S)
            others = min(others, runnable_elsewhere() or 0)
        return None if others is None else float(others)

    def _cpus_busy_while_idle(self) -> float | None:
        """CPUs other programs kept busy since the last mark, when the last step ended an
        idle spell ago and enough clock ticks passed to count (None otherwise, or without
        /proc). This process's own CPU time since the mark (the steps before the spell) is
        not theirs."""
        now_ns = time.perf_counter_ns()
        mark = self._cpu_mark
        if mark is None or now_ns - self._finish_ns < IDLE_PROBE_NS:
            return None
        ticks = cpu_time_jiffies()
        if ticks is None or ticks[1] - mark[1][1] < IDLE_PROBE_MIN_TICKS:
            return None
        idle, total = ticks[0] - mark[1][0], ticks[1] - mark[1][1]
        wall_s = (now_ns - mark[0]) / 1e9
        busy_s = (total - idle) / total * (os.cpu_count() or 1) * wall_s
        return max(0.0, busy_s - (time.process_time() - mark[2])) / wall_s

    def finish_step(self) -> None:
        num_tokens = self._step_tokens
        elapsed = time.perf_counter_ns() - self._step_start
        if self._step_restore_threads:
            torch.set_num_threads(self._step_restore_threads)
        native_ops = self.native
        if self._step_native:
            assert native_ops is not None
            native_ops.step_threads.record(num_tokens, elapsed)
            native_ops.lib.tv_pool_govern(0)
        elif self._step_gemms:
            assert native_ops is not None
            native_ops.gemv_linears = True
        if native_ops is not None:
            native_ops.row_team = None
        if self._step_chooses_threads:
            self.torch_threads.record(num_tokens, elapsed)
        route = self.decode_route
        # Steps the route picked (either path) inform its next choice; others pass through.
        if route is not None and route.pending and (self._step_native or self._step_gemms):
            route.record(num_tokens, elapsed)
        if native_ops is not None and self.torch_threads.threads > 1:
            self._finish_ns = now = time.perf_counter_ns()
            # A /proc read (~7 us) per half probe window, not per step.
            if self._cpu_mark is None or now - self._cpu_mark[0] > IDLE_PROBE_NS // 2:
                ticks = cpu_time_jiffies()
                self._cpu_mark = None if ticks is None else (now, ticks, time.process_time())

    def prepare_model(self, model: nn.Module) -> None:
        if self.dtype == torch.bfloat16 and not has_native_bf16_matmul():
            most = attach_fp32_gemm_weights(model, FP32_GEMM_MIN_ROWS, self.fp32_copy_budget)
            self.fp32_copy_budget.reserved += most
            limit = self.fp32_copy_budget.left
            logger.info(
                "CPU without native bf16 matmul: fp32 weight copies for batched GEMMs, made on "
                "first use (up to %.0f MiB%s)",
                most / 2**20,
                "" if limit is None else f", budget {limit / 2**20:.0f} MiB",
            )
        elif self.dtype == torch.bfloat16 and packed_gemm_supported(self.dtype):
            most = attach_packed_gemm_weights(
                model, PACKED_GEMM_MIN_ROWS, PACKED_GEMM_MAX_ROWS, self.fp32_copy_budget
            )
            self.fp32_copy_budget.reserved += most
            logger.debug("oneDNN-prepacked bf16 weight copies: up to %.0f MiB", most / 2**20)
        if self.native is not None:
            move_weights_to_huge_pages(model)
            attach_native_ops(model, self.native)

    def attention_backend(self, requested: str | None) -> AttentionBackend:
        if self.native is not None and requested is None:
            return NativeCpuAttentionBackend(self.native)
        return super().attention_backend(requested)

    def decode_program(self, model: nn.Module) -> LlamaDecodeProgram | None:
        build_plan = getattr(model, "native_decode_plan", None)
        if self.native is None or build_plan is None:
            return None
        plan = build_plan()
        program = (
            None
            if plan is None
            else LlamaDecodeProgram.build(plan, self.native, self.fp32_copy_budget.take_spare)
        )
        if program is not None and program.bf16_linears and has_native_bf16_matmul():
            # With AMX the program's own linears (AMX from 2 rows) beat torch's too (batch
            # 16: 18 ms a step against 66-220 ms on the layers), so measuring the layers only
            # costs: every step stays on the program.
            self.decode_route = DecodeRoute(fixed=PROGRAM if self.native.amx_linears else None)
        return program
