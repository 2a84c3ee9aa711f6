"""CPU feature checks that change how the engine computes, and how many cores it may use."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch

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


def _cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (None: unlimited or unknown).

    cgroup v2 `cpu.max` ("quota period" or "max period"), else v1's cfs_quota_us/cfs_period_us.
    Containers often see every core of the host but may use only their quota: a thread per
    visible core then waits out most of each time slice.
    """
    try:
        line = (root / "cpu.max").read_text().split()
        if line[0] != "max":
            return int(line[0]) / int(line[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_time_jiffies(path: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(idle, total) clock ticks of all the machine's CPUs since boot (Linux /proc/stat; None
    elsewhere). ~7 us a call."""
    try:
        with open(path, "rb") as f:
            fields = f.readline().split()
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    return ticks[3] + ticks[4], sum(ticks)


def _own_runnable_tids(tasks: Path) -> set[str]:
    """This process's threads that are running or waiting for a core (by thread id)."""
    tids = set()
    for task in os.scandir(tasks):
        with open(os.path.join(task.path, "stat"), "rb") as f:
            stat = f.read()
        # The state follows the command name, which is in parentheses and may hold any.
        if stat[stat.rindex(b")") + 2] == ord("R"):
            tids.add(task.name)
    return tids


def runnable_elsewhere(
    loadavg: Path = Path("/proc/loadavg"), tasks: Path = Path("/proc/self/task")
) -> int | None:
    """Tasks of other processes that are runnable right now (running or waiting for a core):
    the kernel's count in /proc/loadavg less this process's own runnable threads (Linux; None
    elsewhere). ~0.2 ms with a dozen threads.

    Our threads are looked at before and after the count, and one runnable at either look is
    ours: a worker that spins for a while after a parallel region may fall asleep between two
    reads, and counted once as "running" but not as ours it would pass for another program's
    task (seen: 1-2 phantom tasks in a third of long steps on a quiet machine, each halving
    a prefill's threads)."""
    try:
        before = _own_runnable_tids(tasks)
        running = int(loadavg.read_text().split()[3].split("/")[0])
        own = before | _own_runnable_tids(tasks)
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - len(own))


@functools.cache
def available_cpus() -> int:
    """Cores this process may run on: its affinity mask, capped by its cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def native_threads() -> int:
    """Threads for the native kernels: torch's intra-op count (so `torch.set_num_threads`
    still rules), never more than the cores this process may actually use."""
    return max(1, min(torch.get_num_threads(), available_cpus()))


@contextlib.contextmanager
def torch_intra_op_threads(count: int) -> Iterator[None]:
    """Run the block with torch's intra-op thread count set to `count`, then restore it.

    For steps whose heavy work runs on the native kernels' own threads: torch's OpenMP
    workers spin for milliseconds after each parallel op (sampling on a logits row), taking a
    core from the native workers. Setting the count is a sub-microsecond call.
    """
    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
