"""The C heap and page tables: giving freed memory back to the OS, keeping it mapped, huge
pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
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


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 << 20


def keep_freed_heap_mapped(max_free_bytes: int) -> bool:
    """Let the C heap keep up to `max_free_bytes` of freed memory mapped for reuse, and serve
    allocations up to 32 MiB from it; True where that applied (glibc).

    CPU steps allocate and free activations of several MB each (a 4,096-token prefill of a
    SmolLM2-135M-shaped model: 25 MB per gate/up output). By default glibc maps such blocks
    with mmap or trims them off the heap top when freed, and the next step faults every page
    in again: 12k-38k page faults per step there, tens of ms, against ~0 with this. Memory
    stays bounded: a free heap top past `max_free_bytes` is still trimmed, and
    `release_free_heap` still returns everything free. Call once loading is done: load-time
    temporaries kept on the heap would only add to RSS."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    # Setting either disables glibc's dynamic thresholds, so both are set.
    ok = mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) == 1
    return bool(mallopt(_M_TRIM_THRESHOLD, max_free_bytes) == 1 and ok)


HUGE_PAGE = 2 << 20
# Linux madvise advice values (asm-generic/mman-common.h).
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def huge_pages_supported() -> bool:
    """Whether `collapse_onto_huge_pages` can ask the kernel at all (Linux with libc's madvise);
    whether it agrees depends on the kernel (6.1+) and its THP mode."""
    libc = _libc()
    return sys.platform.startswith("linux") and getattr(libc, "madvise", None) is not None


def collapse_onto_huge_pages(chunks: list[int]) -> int:
    """Collapses each 2 MiB-aligned chunk (start addresses) onto a huge page in place: same
    addresses, same bytes. Returns the bytes that now are (a chunk the kernel refuses, e.g.
    file-backed or partly unmapped memory, keeps its pages; 0 where unsupported). ctypes drops
    the GIL for each call."""
    if not huge_pages_supported():
        return 0
    madvise = _libc().madvise
    size = ctypes.c_size_t(HUGE_PAGE)
    done = 0
    for start in chunks:
        address = ctypes.c_void_p(start)
        # MADV_HUGEPAGE first: khugepaged then keeps the chunk huge, and MADV_COLLAPSE
        # honours the "madvise" THP mode.
        madvise(address, size, _MADV_HUGEPAGE)
        if madvise(address, size, _MADV_COLLAPSE) == 0:
            done += HUGE_PAGE
    return done
