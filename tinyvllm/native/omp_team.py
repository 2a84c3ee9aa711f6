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


def torch_omp_parallel() -> int | None:
    """The address of GOMP_parallel in the OpenMP runtime torch runs its ops on (None: torch
    uses none, or it cannot be told apart from another one loaded here)."""
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
        fn = getattr(lib, "GOMP_parallel", None)
        if fn is not None:
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None
