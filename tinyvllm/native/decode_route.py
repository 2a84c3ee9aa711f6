"""Which path a decode or verify step takes where torch's bf16 matmul is fast: the native
decode program, or the model's layers with torch's GEMMs.

Why: the program's linears are GEMVs (one pass over each weight per step, `vdpbf16ps` on
AVX512-BF16), the best there is for a few rows. On CPUs with AMX, torch's bf16 matmul
(oneDNN) reaches 2+ TFLOP/s on many rows, and a step's linears on it overtake the program
somewhere between a few and 64 rows: where depends on the CPU, the model, the threads and
what else runs on the machine, so the crossover is measured, not assumed. Each row-count
bucket keeps a running estimate of both paths' step time (`MeasuredChoice`, as the native
step threads do) and a step takes the faster; the slower one is tried again now and then,
rarely while it keeps losing. On CPUs without bf16 dot products (AVX2 only) torch's bf16
GEMM is emulated and there is no route: every step the program supports runs on it. With
AMX the program's linears from 2 rows on run on AMX tiles too (amx_linear.cpp) and win at
every row count it takes, so the route is fixed to the program there: its trials of the layers
(oneDNN generating kernels for each new row count) cost 15-25% of a batch-16 run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyvllm.native.step_threads import MeasuredChoice

PROGRAM = "program"
LAYERS = "layers"

# Row counts up to this keep estimates of their own; larger decode batches share one per
# power of two (a mixed batch's row count changes every step, and each bucket must measure
# both paths before it can choose).
_EXACT_ROWS = 8


@dataclass
class DecodeRoute:
    """Per step: the program (the choice's first way) or the layers (its second)."""

    # Two first samples per path and bucket: a layers step of a new row count pays oneDNN's
    # kernel generation once. A path that loses badly (the layers at one row: ~3x) is retried
    # rarely enough that its trials cost at most 1% of the steps' time.
    choice: MeasuredChoice = field(
        default_factory=lambda: MeasuredChoice(
            exact_tokens=_EXACT_ROWS, first_samples=2, max_trial_cost=0.01
        )
    )
    # PROGRAM or LAYERS: every step takes that path (parity tests, benchmark comparisons).
    fixed: str | None = None
    pending: bool = False  # a step picked by `choice` is in progress and must be recorded
    on_layers: bool = False  # the step in progress was sent to the layers

    def __post_init__(self) -> None:
        if self.fixed not in (None, PROGRAM, LAYERS):
            raise ValueError(
                f"fixed route {self.fixed!r}: expected {PROGRAM!r}, {LAYERS!r} or None"
            )

    def takes_program(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` rows (one the program supports) runs on the
        program; the step's wall time goes to `record` to inform the next choice."""
        if self.fixed is not None:
            self.pending, self.on_layers = False, self.fixed == LAYERS
        else:
            self.pending, self.on_layers = True, self.choice.pick(num_tokens)
        return not self.on_layers

    def take_layers_step(self) -> bool:
        """Whether the step now starting on the layers is one this route sent there (asked
        once per torch step: prefill and other steps the program cannot run are not)."""
        on_layers, self.on_layers = self.on_layers, False
        return on_layers

    def record(self, num_tokens: int, elapsed_ns: float) -> None:
        """The wall time of the step the choice last picked."""
        self.pending = False
        self.choice.record(num_tokens, elapsed_ns)
