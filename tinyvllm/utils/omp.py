"""How torch's OpenMP workers wait between parallel regions, as the native kernels see it."""

from __future__ import annotations

import os


def omp_waits_spin() -> bool:
    """Whether torch's OpenMP workers spin between parallel regions: the user chose no wait
    policy (libgomp's default then spins for a while after each region).

    The CPU platform then runs the row kernels of the steps torch runs on torch's own team
    (native/omp_team.py): the pool's workers would compete with the spinning ones for the
    cores. tinyvllm sets no policy itself: a process-wide passive policy slowed torch code
    sharing the process (HF decode ~40%), and no longer helped tinyvllm under contention
    (2026-12-02: one competing program, batch 16: 255-270 tok/s spinning vs 205-221 passive).
    """
    return "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
