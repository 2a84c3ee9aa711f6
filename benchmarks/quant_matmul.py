"""Weight-only quantized matmul vs float F.linear on this CPU, per layer shape and batch rows.

    python benchmarks/quant_matmul.py [--rows 1 16 128] [--threads N]

Shapes are SmolLM2-135M's (hidden 576, 9 q heads + 3 kv heads of 64, MLP 1536, vocab 49152).
Each call reads a different copy of the weight (--cold-mib of them in bf16, beyond the
L3 cache), as a decode step does. Columns (microseconds, the fastest of many runs, which
filters out other load on the box):
bf16 / fp32 F.linear; torch's packed kernels (int8 per channel, int4 groups of 32) on bf16
activations; our dense path (dequantize slabs to fp32, fp32 GEMM); and `auto`, what
`QuantizedWeight.linear` picks. The last line per shape gives weight bytes per format.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tinyvllm.quant import QuantConfig, QuantizedWeight
from tinyvllm.quant import kernels as K

SHAPES: dict[str, tuple[int, int]] = {  # name -> (out N, in K)
    "o_proj 576->576": (576, 576),
    "k/v 576->192": (192, 576),
    "qkv 576->960": (960, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}
NEVER = 1 << 62


def best_times_us(
    cols: dict[str, list[Callable[[], object]]],
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Fastest single call per column. Columns take turns (each call on its next weight
    copy), so a burst of load from elsewhere hits all of them alike. `clock` may be a CPU-time
    clock (time.thread_time) when the box is busy."""
    best = dict.fromkeys(cols, float("inf"))
    for fns in cols.values():
        fns[0]()
    start = time.perf_counter()
    runs = 0
    while runs < 5 or time.perf_counter() - start < budget_s:
        for name, fns in cols.items():
            fn = fns[runs % len(fns)]
            t0 = clock()
            fn()
            best[name] = min(best[name], clock() - t0)
        runs += 1
    return {name: t * 1e6 for name, t in best.items()}


def quantized(w: torch.Tensor, method: str) -> QuantizedWeight:
    n, k = w.shape
    qw = QuantizedWeight(k, n, QuantConfig(method))
    qw.load_rows(w, 0, n)
    return qw


def columns(
    x16: torch.Tensor,
    n: int,
    w16: list[torch.Tensor],
    w32: list[torch.Tensor],
    q8: list[QuantizedWeight],
    q4: list[QuantizedWeight],
) -> dict[str, list[Callable[[], object]]]:
    x32 = x16.float()
    return {
        "bf16": [lambda w=w: F.linear(x16, w) for w in w16],
        "fp32": [lambda w=w: F.linear(x32, w) for w in w32],
        "int8 pack": [
            lambda q=q: K.int8_linear(x16, q.packed.qweight, q.packed.scale, NEVER) for q in q8
        ],
        "int8 dense": [
            lambda q=q: K.int8_linear(x16, q.packed.qweight, q.packed.scale, 0) for q in q8
        ],
        "int4 pack": [
            lambda q=q: K.int4_linear(x16, q.packed.qweight, q.packed.scales_zeros, n, NEVER)
            for q in q4
        ],
        "int4 dense": [
            lambda q=q: K.int4_linear(x16, q.packed.qweight, q.packed.scales_zeros, n, 0)
            for q in q4
        ],
        "int8 auto": [lambda q=q: q.linear(x16) for q in q8],
        "int4 auto": [lambda q=q: q.linear(x16) for q in q4],
    }


def bench_shape(n: int, k: int, rows: list[int], cold_mib: float, budget_s: float) -> list[str]:
    # Enough weight copies that each call reads its weight from DRAM, as in a real decode
    # step, instead of from a cache the previous call warmed.
    copies = max(1, math.ceil(cold_mib * 2**20 / (n * k * 2)))
    w32 = [torch.randn(n, k) * 0.02 for _ in range(copies)]
    w16 = [w.bfloat16() for w in w32]
    q8 = [quantized(w, "int8") for w in w32]
    q4 = [quantized(w, "int4") for w in w32]
    lines = []
    for m in rows:
        cols = columns(torch.randn(m, k).bfloat16(), n, w16, w32, q8, q4)
        times = best_times_us(cols, budget_s * len(cols)).values()
        lines.append(f"  M={m:<4}" + "".join(f"{t:>12.0f}" for t in times))
    mib = [n * k * 2 / 2**20, n * k * 4 / 2**20, q8[0].nbytes() / 2**20, q4[0].nbytes() / 2**20]
    lines.append("  MiB: bf16 {:.2f}  fp32 {:.2f}  int8 {:.2f}  int4 {:.2f}".format(*mib))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per column")
    parser.add_argument("--cold-mib", type=float, default=96.0, help="weight bytes cycled")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = ["bf16", "fp32", "int8 pack", "int8 dense", "int4 pack", "int4 dense"]
    names += ["int8 auto", "int4 auto"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; times in us")
    print(" " * 8 + "".join(f"{name:>12}" for name in names))
    for name in args.shapes:
        print(name)
        for line in bench_shape(*SHAPES[name], args.rows, args.cold_mib, args.budget):
            print(line, flush=True)


if __name__ == "__main__":
    main()
