"""NemotronH (dense blocks) against HF transformers: the shared Mamba2 mixer inside another
family, driven step by step and through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from granite_hybrid_fixtures import build_nemotron_h_checkpoint
from test_granite_engine import MAX_TOKENS, greedy, make_llm, token_prompts
from test_granite_moe_hybrid import check_schedule

from tinyvllm.parity import hf_greedy, hf_token_logprobs, load_hf_reference


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_nemotron_h_checkpoint(tmp_path_factory.mktemp("nemotron-h"), tokenizer_dir)


def test_chunked_prefill_and_decode_match_transformers(nemotron_dir: Path) -> None:
    check_schedule(nemotron_dir, [(5, 19, 30), (1, 9, 1), (1, 1, 1)], slots=[2, 0, 5])


def test_engine_greedy_and_logprobs_match_hf(nemotron_dir: Path) -> None:
    hf = load_hf_reference(str(nemotron_dir))
    prompts = token_prompts(0, [6, 35])
    outs = greedy(make_llm(nemotron_dir, max_num_batched_tokens=24), prompts, logprobs=0)
    for prompt, comp in zip(prompts, outs, strict=True):
        assert list(comp.token_ids) == hf_greedy(hf, prompt, MAX_TOKENS)
        ours = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        ref = hf_token_logprobs(hf, prompt, list(comp.token_ids))
        assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-3


def test_moe_blocks_refused_at_build() -> None:
    from types import SimpleNamespace

    from tinyvllm.models.nemotron_h import nemotron_h_block_kinds

    config = SimpleNamespace(num_hidden_layers=2, layers_block_type=["mamba", "moe"])
    with pytest.raises(ValueError, match=r"layers_block_type\[1\] is 'moe'.*not support yet"):
        nemotron_h_block_kinds(config)
