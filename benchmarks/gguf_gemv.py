"""GGUF block kernels (tinyvllm/native/quant_kernels.cpp) against the other ways to run a
quantized or float linear layer on this CPU, per SmolLM2-135M layer shape and batch rows.

    python benchmarks/gguf_gemv.py [--rows 1 4 8 16 32] [--threads N] [--cpu-time]

Columns (microseconds, the fastest call of many; columns take turns call by call, so load
from elsewhere on the box hits them alike): our GEMV on Q4_1 and Q8_0 blocks, our dense path
(Q4_1 slabs dequantized to fp32, then a GEMM), torch's int4pack kernel on the same Q4_1
values (what `quantization="gguf"` repacked to before), the native bf16 GEMV (tv_linear) and
bf16 / fp32 F.linear. Each call reads its own weight copy (--cold-mib of them in Q4_1) so
weights come from DRAM or L3 as in a decode step. With --cpu-time the clock is the thread's
CPU time (meaningful with --threads 1 on a busy machine).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch
import torch.nn.functional as F

# Same directory: run as `python benchmarks/gguf_gemv.py`.
from quant_matmul import best_times_us

from tinyvllm.gguf.weight import GGUFWeight
from tinyvllm.native import NativeCpuOps
from tinyvllm.native.abi import FORMAT_Q4_1, FORMAT_Q8_0
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.quant import QuantConfig, QuantizedWeight

SHAPES: dict[str, tuple[int, int]] = {  # name -> (out N, in K)
    "qkv 576->960": (960, 576),
    "o_proj 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}
GT = gguf.GGMLQuantizationType


def int4pack(data: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """The same Q4_1 blocks repacked for torch's int4 kernel (the pre-native gguf path: a
    weight given no native kernels)."""
    qw = QuantizedWeight(k, n, QuantConfig("gguf"))
    qw.load_rows(GGUFWeight(data, int(GT.Q4_1), (n, k)), 0, n)
    assert qw.format == "int4"
    return qw


def columns(
    x: torch.Tensor,
    n: int,
    q41s: list[torch.Tensor],
    q80s: list[torch.Tensor],
    i4: list[QuantizedWeight],
    w16: list[torch.Tensor],
    w32: list[torch.Tensor],
) -> dict[str, list[Callable[[], object]]]:
    kernels, ops = QuantKernels.load(), NativeCpuOps.load()
    assert kernels is not None and ops is not None, "native kernels unavailable here"
    xf = x.float()
    return {
        "q4_1 gemv": [lambda d=d: kernels.gemv(x, FORMAT_Q4_1, d, n) for d in q41s],
        "q8_0 gemv": [lambda d=d: kernels.gemv(x, FORMAT_Q8_0, d, n) for d in q80s],
        "q4_1 dense": [lambda d=d: kernels.dense_linear(x, FORMAT_Q4_1, d, n, None) for d in q41s],
        "int4pack": [lambda q=q: q.linear(x) for q in i4],
        "bf16 native": [lambda t=t: ops.linear(x, t, None) for t in w16],
        "bf16 torch": [lambda t=t: F.linear(x, t) for t in w16],
        "fp32 torch": [lambda t=t: F.linear(xf, t) for t in w32],
    }


def bench_shape(
    n: int, k: int, rows: list[int], cold_mib: float, budget_s: float, clock: Callable[[], float]
) -> list[str]:
    w = (np.random.default_rng(0).standard_normal((n, k)) * 0.05).astype(np.float32)
    q41 = torch.from_numpy(gguf.quants.quantize(w, GT.Q4_1).copy())
    q80 = torch.from_numpy(gguf.quants.quantize(w, GT.Q8_0).copy())
    copies = max(2, math.ceil(cold_mib * 2**20 / q41.numel()))
    bf16_copies = max(2, copies // 3)  # bf16 is 3.2x Q4_1: the same bytes cycled
    q41s = [q41.clone() for _ in range(copies)]
    q80s = [q80.clone() for _ in range(max(2, copies // 2))]
    w16 = [torch.from_numpy(w).bfloat16() for _ in range(bf16_copies)]
    w32 = [torch.from_numpy(w) for _ in range(max(2, bf16_copies // 2))]
    i4 = [int4pack(q, n, k) for q in q41s[: min(copies, 16)]]
    lines = []
    for m in rows:
        cols = columns(torch.randn(m, k).bfloat16(), n, q41s, q80s, i4, w16, w32)
        times = best_times_us(cols, budget_s * len(cols), clock)
        lines.append(f"  M={m:<4}" + "".join(f"{t:>12.0f}" for t in times.values()))
    header = " " * 8 + "".join(f"{name:>12}" for name in cols)
    gbs = n * k * 0.625 / 1e3
    lines.append(f"  Q4_1 {q41.numel() / 2**20:.2f} MiB, bf16 {n * k * 2 / 2**20:.2f} MiB; "
                 f"Q4_1 GB/s at M=1: {gbs / float(lines[0].split()[1]):.1f}")  # fmt: skip
    return [header, *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per column")
    parser.add_argument("--cold-mib", type=float, default=48.0, help="Q4_1 bytes cycled")
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time clock")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{'thread CPU time' if args.cpu_time else 'wall time'}, load {os.getloadavg()[0]:.2f}; "
        "times in us"
    )
    for name in args.shapes:
        print(name)
        for line in bench_shape(*SHAPES[name], args.rows, args.cold_mib, args.budget, clock):
            print(line, flush=True)
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
