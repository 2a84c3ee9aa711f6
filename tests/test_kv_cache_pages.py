"""The CPU KV cache's memory: lazily zeroed, on transparent huge pages where offered."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinyvllm.runner.kv_cache import lazily_zeroed_cpu_tensor

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps_entry(address: int) -> dict[str, str]:
    """This process's /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_cpu_kv_cache_reads_as_zeros_and_takes_writes() -> None:
    cache = lazily_zeroed_cpu_tensor((2, 8, 16, 4, 64), torch.bfloat16)
    assert cache.shape == (2, 8, 16, 4, 64) and not cache.any()
    cache[1, 3] = 1.5
    assert int(cache.float().sum()) == 16 * 4 * 64 * 1.5


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_cpu_kv_cache_asks_for_transparent_huge_pages() -> None:
    """Decode attention reads blocks scattered over the cache: on 4 KiB pages most cost TLB
    misses (~15% of the kernel's time at 64 sequences x ~420 tokens). The cache is a private
    anonymous mapping advised for THP (a shared one is shmem, which THP leaves alone)."""
    cache = lazily_zeroed_cpu_tensor((2, 512, 16, 4, 64), torch.bfloat16)  # 8 MiB
    smaps = _smaps_entry(cache.data_ptr())
    assert smaps.get("THPeligible") == "1", smaps
    assert "hg" in smaps.get("VmFlags", "").split(), smaps  # MADV_HUGEPAGE
