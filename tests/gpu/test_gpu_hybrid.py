"""Granite 4.0-H on CUDA: the Triton Mamba2 decode step inside the whole engine, greedy parity
with HF transformers (fp32) and prefix caching of state snapshots on vs off."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Path]:
    from granite_hybrid_fixtures import build_granite_checkpoint

    yield build_granite_checkpoint(tmp_path_factory.mktemp("granite-gpu"), tokenizer_dir)
    gc.collect()
    torch.cuda.empty_cache()


def test_granite_greedy_matches_hf_and_caching_on_off(granite_dir: Path) -> None:
    from test_granite_engine import token_ids, token_prompts

    from tinyvllm import LLM
    from tinyvllm.parity import load_hf_reference, run_parity

    kwargs: dict[str, Any] = dict(
        device="cuda", dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20
    )
    llm = LLM(str(granite_dir), **kwargs)
    mixers = llm.engine.runner.model.recurrent_layers()
    assert all(mixer.triton_decode for mixer in mixers)
    prompts = token_prompts(0, [6, 16, 35, 61])
    report = run_parity(llm, load_hf_reference(str(granite_dir)), prompts, 12)
    assert report.identical, report.summary()
    assert report.max_logprob_diff < 1e-3, report.summary()
    shared = token_prompts(2, [4, 13, 22], prefix=token_prompts(1, [40])[0])
    off = LLM(str(granite_dir), enable_prefix_caching=False, **kwargs)
    assert token_ids(llm, shared) == token_ids(off, shared)
    assert token_ids(llm, shared[::-1]) == token_ids(off, shared[::-1])
