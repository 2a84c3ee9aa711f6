"""GPU checks (run by scripts/gpu_check.sh on a CUDA machine; skipped elsewhere)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_greedy_matches_hf(tiny_models) -> None:
    from tinyvllm import LLM
    from tinyvllm.parity import load_hf_reference, run_parity

    path = str(tiny_models["llama"])
    llm = LLM(path, dtype="float32", device="cuda", max_model_len=256)
    assert llm.get_stats().num_blocks > 0
    report = run_parity(llm, load_hf_reference(path), [[11, 12, 13] * 7, [40] * 33], 16)
    assert report.identical, report.summary()
    assert report.max_logprob_diff < 1e-3


def test_cuda_memory_utilization_sizes_kv(tiny_models) -> None:
    from tinyvllm import LLM

    llm = LLM(str(tiny_models["qwen2"]), device="cuda", gpu_memory_utilization=0.3)
    _free, total = torch.cuda.mem_get_info()
    assert llm.get_stats().num_blocks > 1000
    assert torch.cuda.memory_allocated() <= 0.3 * total + (1 << 28)
