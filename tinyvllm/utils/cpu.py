"""CPU feature checks that change how the engine computes."""

from __future__ import annotations

import functools
from pathlib import Path

# Rows at which an fp32 GEMM on an fp32 weight copy beats torch's bf16 kernel on AVX2-only
# CPUs (measured on a 2-core AMD EPYC: bf16 wins below ~6 rows, where it is memory-bound).
FP32_GEMM_MIN_ROWS = 8


def cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict[str, str] | None:
    """The first processor's fields from /proc/cpuinfo (`flags`, `model name`, ...); None
    where there is no such file (non-Linux). The one reader of that file."""
    try:
        text = path.read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # a blank line ends the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty when unknown)."""
    return frozenset((cpuinfo() or {}).get("flags", "").split())


@functools.cache
def has_native_bf16_matmul() -> bool:
    """Whether the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX).

    Without them torch emulates bf16 GEMMs, several times slower than fp32. Non-Linux systems
    are assumed capable (nothing to read, and the fp32 copies cost memory).
    """
    if cpuinfo() is None:
        return True
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
