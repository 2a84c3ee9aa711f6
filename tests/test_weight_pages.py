"""GGUF block weights collapsed onto transparent huge pages in place
(tinyvllm.platforms.weight_pages.py): same address, same bytes, huge pages where the kernel has
them."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from tinyvllm.platforms.weight_pages import huge_page_chunks
from tinyvllm.utils.memory import HUGE_PAGE, collapse_onto_huge_pages, huge_pages_supported

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    if not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _kernel_has_collapse() -> bool:  # MADV_COLLAPSE: Linux 6.1
    major, minor = (int(p) for p in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


def _anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(
    not huge_pages_supported()
    or _thp_mode() not in ("always", "madvise")
    or not _kernel_has_collapse(),
    reason="needs Linux 6.1+ with transparent huge pages (always or madvise)",
)
def test_collapse_keeps_address_and_bytes_and_takes_huge_pages() -> None:
    gen = torch.Generator().manual_seed(3)
    t = torch.randint(0, 256, (5 * HUGE_PAGE + 12345,), dtype=torch.uint8, generator=gen)
    small = torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=gen)
    before, small_before = t.clone(), small.clone()
    ptr = t.data_ptr()
    chunks = huge_page_chunks([t, small])
    first, last = ptr // HUGE_PAGE, (ptr + t.numel() - 1) // HUGE_PAGE
    assert {c // HUGE_PAGE for c in chunks} >= set(range(first, last + 1))
    assert chunks == sorted(set(chunks))
    moved = collapse_onto_huge_pages(chunks)
    assert moved >= 5 * HUGE_PAGE  # every chunk of t (the heap may refuse an edge)
    assert t.data_ptr() == ptr
    assert torch.equal(t, before) and torch.equal(small, small_before)
    assert _anon_huge_kib(first * HUGE_PAGE, (last + 1) * HUGE_PAGE) * 1024 >= 5 * HUGE_PAGE


def test_chunks_of_a_small_tensor() -> None:
    t = torch.zeros(HUGE_PAGE // 2, dtype=torch.uint8)
    chunks = huge_page_chunks([t])
    assert 1 <= len(chunks) <= 2  # it may straddle a 2 MiB edge
    assert chunks[0] <= t.data_ptr() < chunks[-1] + HUGE_PAGE


def test_engine_weights_move_once_and_results_stay_identical(
    tiny_models: object, tmp_path: Path
) -> None:
    """Every GGUF block weight counts, a tied embedding / lm_head once; collapsing them (again:
    the engine did at load) changes no output bit."""
    import gguf
    from gguf_writer import write_tiny_gguf

    from tinyvllm import LLM, SamplingParams
    from tinyvllm.platforms import weight_pages

    q = gguf.GGMLQuantizationType
    path = write_tiny_gguf(
        tiny_models["llama"], tmp_path / "tiny.gguf", qtype_for=lambda name, w: q.Q8_0
    )
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    if llm.engine.runner.platform.quant_kernels is None:
        pytest.skip("native kernels unavailable: no GGUF block weights")
    model = llm.engine.runner.model
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 99, 3, 42]}]
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    weights = weight_pages.model_weights(model)
    assert len({t.data_ptr() for t in weights}) == len(weights) > 0
    thread = weight_pages.move_weights_to_huge_pages(model)
    if thread is not None:
        thread.join()
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before
