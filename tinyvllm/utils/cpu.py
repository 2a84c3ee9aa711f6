"""CPU feature checks that change how the engine computes."""

from __future__ import annotations

import functools
from pathlib import Path

# Rows at which an fp32 GEMM on an fp32 weight copy beats torch's bf16 kernel on AVX2-only
# CPUs (measured on a 2-core AMD EPYC: bf16 wins below ~6 rows, where it is memory-bound).
FP32_GEMM_MIN_ROWS = 8


@functools.cache
def has_native_bf16_matmul() -> bool:
    """Whether the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX).

    Without them torch emulates bf16 GEMMs, several times slower than fp32. Non-Linux systems
    are assumed capable (nothing to read, and the fp32 copies cost memory).
    """
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return bool(flags & {"avx512_bf16", "amx_bf16"})
