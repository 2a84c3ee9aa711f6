"""The CPU KV cache's memory: lazily zeroed, resident only where written."""

from __future__ import annotations

from pathlib import Path

import torch

from tinyvllm.runner.kv_cache import lazily_zeroed_cpu_tensor


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


def test_cpu_kv_cache_makes_only_written_pages_resident() -> None:
    """A short chat writes the first block of every layer's K and V: that must cost those
    blocks' pages, not 2 MiB huge pages each (60 of them for a 30-layer model: +118 MiB)."""
    cache = lazily_zeroed_cpu_tensor((2, 1024, 16, 4, 64), torch.bfloat16)  # 16 MiB

    def rss_kib() -> int:
        return int(_smaps_entry(cache.data_ptr())["Rss"].split()[0])

    # The growth, not the total: the kernel may merge the cache's mapping with a neighbouring
    # anonymous one (other allocations of the process), whose resident pages smaps then adds.
    before = rss_kib()
    cache[0, 0] = 1.0
    cache[1, 0] = 1.0
    assert rss_kib() - before <= 64, (before, rss_kib())
