"""A model's weights (GGUF blocks, dense matrices) moved onto transparent huge pages in place.

Why: a single-stream decode step of SmolLM2-135M Q4_1 reads 96 MiB of layer weights, then the
30 MiB Q8_0 lm_head, and on a shared host they do not all stay in the cache: the weights
stream from memory every token. On 4 KiB pages that stream takes a TLB miss every 4 KiB
(~32,000 per token) and the kernels' software prefetches wait on page walks at every page
edge. On 2 MiB pages, measured in one process before and after collapsing them (thread CPU
time, one thread, int8 activations): the decode program back to back 15.1-23.9 -> 8.9-9.7 ms
(median; min 11.3 -> 7.2), the program in turn with the lm_head 16.9-21.2 -> 11.1-11.8 ms; the
lm_head alone after the layers (2 threads, wall) 4.4-7.7 -> 2.4 ms.

MADV_COLLAPSE (Linux 6.1+; utils/memory.py) rewrites 2 MiB-aligned ranges into huge pages:
bytes and addresses stay the same (results stay bit-identical) and no second copy stays
resident. Each weight is its own allocation (0.3-30 MiB), so every 2 MiB chunk a weight touches
is collapsed whole; the heap bytes around the weights that were not resident yet become so
(peak RSS +6 MiB for SmolLM2 Q4_1). It runs on a background thread (0.1-0.5 s here), off the
start-up's critical path. Elsewhere (older kernels, THP off, not Linux) the calls fail and the
weights keep their pages. Copying the weights into one fresh huge-page buffer instead cost ~1.3
s of start-up (huge-page faults compact memory) and 84 MiB of peak RSS (the loader's pages stay
mapped).
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from tinyvllm.quant.formats import GGUFBlocks
from tinyvllm.utils.memory import HUGE_PAGE, collapse_onto_huge_pages, huge_pages_supported

logger = logging.getLogger(__name__)

# Smaller dense parameters (norms, biases) share chunks with their neighbours: collapsing
# around them would make bytes resident that no weight uses.
DENSE_MIN_BYTES = 256 << 10


def huge_page_chunks(tensors: list[torch.Tensor]) -> list[int]:
    """Start addresses of the 2 MiB-aligned chunks that hold any byte of `tensors`, sorted."""
    chunks: set[int] = set()
    for t in tensors:
        first = t.data_ptr() // HUGE_PAGE
        last = (t.data_ptr() + max(t.numel() * t.element_size(), 1) - 1) // HUGE_PAGE
        chunks.update(range(first, last + 1))
    return [c * HUGE_PAGE for c in sorted(chunks)]


def model_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of `model` worth huge pages: GGUF block weights and dense CPU parameters of
    `DENSE_MIN_BYTES` and more (a tied embedding and lm_head once). Dense bf16 decode streams
    its matrices from memory the same way: on a batch-16 step the AMX GEMMs wait mostly on
    weight tile loads."""
    found: dict[int, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, GGUFBlocks):
            found.setdefault(m.qweight.data_ptr(), m.qweight)
    for p in model.parameters():
        nbytes = p.numel() * p.element_size()
        if p.device.type == "cpu" and nbytes >= DENSE_MIN_BYTES:
            found.setdefault(p.data_ptr(), p.data)
    return list(found.values())


def move_weights_to_huge_pages(model: nn.Module) -> threading.Thread | None:
    """Collapses the chunks of `model_weights(model)` onto huge pages on a background thread
    (None: nothing to do, or not Linux). The GIL is free during each madvise, so start-up
    goes on meanwhile, and the pages stay valid throughout (a step reading a chunk being rewritten
    waits for it). The thread holds the tensors until it is done."""
    weights = model_weights(model)
    if not huge_pages_supported() or not weights:
        return None

    def collapse_all() -> None:
        done = collapse_onto_huge_pages(huge_page_chunks(weights))
        logger.debug("weights on huge pages: %.0f MiB", done / 2**20)

    thread = threading.Thread(target=collapse_all, name="tinyvllm-huge-pages", daemon=True)
    thread.start()
    return thread
