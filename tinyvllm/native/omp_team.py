"""torch's OpenMP team as a place to run native kernels (native/omp_team.h).

Why: between torch's parallel ops its OpenMP workers spin (libgomp's default wait policy) on the
cores the native thread pool would need. Kernels that sit between torch ops (prefill attention,
the row kernels of a step torch runs) then run their items on torch's own team.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch


def _torch_omp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs its ops on, as loaded here (None: torch uses none, or it
    cannot be told apart from another one loaded here)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    rows = (line.split(maxsplit=5) for line in maps.splitlines())
    paths = sorted(
        {r[5] for r in rows if len(r) == 6 and Path(r[5]).name.startswith(("libgomp", "libiomp5"))}
    )
    # Torch's own copy where it ships one; any other runtime only when it is the only one.
    torch_dir = str(Path(torch.__file__).resolve().parent.parent)
    own = [path for path in paths if path.startswith(torch_dir)]
    candidates = own or (paths if len(paths) == 1 else [])
    for path in candidates:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # never a second copy
        except OSError:
            continue
        if getattr(lib, "GOMP_parallel", None) is not None:
            return lib
    return None


def torch_omp_parallel() -> int | None:
    """The address of GOMP_parallel in the OpenMP runtime torch runs its ops on (None where
    there is none to find)."""
    lib = _torch_omp_runtime()
    return None if lib is None else ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value


def release_thread_team() -> bool:
    """Ends the idle OpenMP workers of the calling thread's team (`omp_pause_resource_all`,
    soft: a later parallel op of this thread starts new ones); False where there is nothing
    to call.

    Why: libgomp counts every thread of every team against the cores, and while there are
    more than cores, all teams' workers sleep between parallel ops instead of spinning. The
    thread that built an engine for another thread to run (AsyncLLM's engine thread) leaves
    a team behind that way, and every torch op of the engine thread then paid a futex sleep
    and wake-up per worker (a 64 x 1024 SiLU on 2 threads: 77-83 us instead of 14-16; a
    16 x 32-token prefill 94 ms instead of 63)."""
    lib = _torch_omp_runtime()
    pause = None if lib is None else getattr(lib, "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(1) == 0  # omp_pause_soft
