"""How torch's OpenMP workers wait: set before torch is imported, or it has no effect."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


def prefer_passive_omp_waits() -> bool:
    """Ask torch's OpenMP runtime to sleep between parallel regions instead of spinning
    (`OMP_WAIT_POLICY=PASSIVE`), unless the user chose a policy; True when it will apply.

    The native kernels run on their own thread pool. Spinning OpenMP workers of torch then
    hold cores the pool needs, and with one other busy program on a 2-core machine batched
    `LLM.generate` fell to 0.10x of its quiet speed (0.57x with passive waits; quiet batched
    decode costs ~12%; 16 x 32 -> 48 on a 2-vCPU Sapphire Rapids, 3 runs each). OpenMP
    reads the variable once, when torch loads its runtime, hence `import tinyvllm` before
    `import torch` for it to count.
    """
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    if "torch" in sys.modules:
        logger.debug("torch was imported before tinyvllm: its OpenMP wait policy stays as is")
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def omp_waits_spin() -> bool:
    """Whether torch's OpenMP workers spin between parallel regions: neither this package
    (imported before torch) nor the user chose a wait policy. The CPU platform then runs the
    row kernels of the steps torch runs on torch's team (native/omp_team.py)."""
    return "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
