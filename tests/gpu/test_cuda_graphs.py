"""Full-model CUDA graphs: replay gives the eager path's greedy tokens, on every tiny family,
for decode batches of many sizes (padded to their bucket) and with n-gram spec decoding
(uniform K + 1 verify batches)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KV_BYTES = 64 << 20


def _prompts(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(n)
    lengths = torch.randint(3, 60, (n,), generator=gen).tolist()
    return [
        {"prompt_token_ids": torch.randint(5, 500, (m,), generator=gen).tolist()} for m in lengths
    ]


def _greedy(llm, prompts: list[dict], max_tokens: int = 24) -> list[list[int]]:
    from tinyvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager(tiny_model_dir: Path, dtype: str) -> None:
    from tinyvllm import LLM

    kw = {"device": "cuda", "dtype": dtype, "max_model_len": 256, "max_num_seqs": 48,
          "kv_cache_memory_bytes": KV_BYTES}  # fmt: skip
    eager = LLM(str(tiny_model_dir), enforce_eager=True, **kw)
    graphs = LLM(str(tiny_model_dir), **kw)
    runner = graphs.engine.runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.graphs
    for n in (1, 3, 8, 17, 48):
        prompts = _prompts(n)
        assert _greedy(graphs, prompts) == _greedy(eager, prompts), n
    del eager, graphs
    gc.collect()
    torch.cuda.empty_cache()


def test_graphs_with_ngram_verify_batches(tiny_models) -> None:
    from tinyvllm import LLM

    path = str(tiny_models["llama"])
    kw = {"device": "cuda", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 16,
          "kv_cache_memory_bytes": KV_BYTES}  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    eager = LLM(path, enforce_eager=True, **kw)
    graphs = LLM(path, speculative_config=spec, **kw)
    assert 4 in graphs.engine.runner.cuda_graphs.dispatcher.query_lens
    repetitive = [{"prompt_token_ids": [7, 8, 9, 10] * 8 + [7, 8]} for _ in range(4)]
    prompts = repetitive + _prompts(4)
    assert _greedy(graphs, prompts, 32) == _greedy(eager, prompts, 32)
