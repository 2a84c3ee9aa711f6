"""Giving freed memory back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS; True where that was possible (glibc).

    glibc keeps memory that native code freed in its heap, counted in the process's RSS, until
    a later allocation reuses it. Loading a large `tokenizers` tokenizer parses a JSON file of
    tens of MB into temporaries and frees them: Gemma 3's 262k-token tokenizer left ~180 MB
    free but resident (290 MB RSS for ~100 MB it uses), which no later allocation of the load
    reused (tensors are allocated outside the heap)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:  # musl, macOS, Windows: nothing to call
        return False
    trim(0)
    return True
