"""create_engine: the tokenizer loads in a thread beside the model, and the engine gets it
(or its error) once the model is in place."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

import tinyvllm.engine.factory as factory
from tinyvllm import LLM


def test_tokenizer_loads_beside_the_model_and_reaches_the_engine(tiny_models, monkeypatch):
    loaded_in: list[str] = []
    load = factory.load_tokenizer

    def recording_load(*args, **kwargs):
        loaded_in.append(threading.current_thread().name)
        return load(*args, **kwargs)

    monkeypatch.setattr(factory, "load_tokenizer", recording_load)
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    assert loaded_in and loaded_in[0].startswith("tinyvllm-tokenizer")
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None and hasattr(tokenizer, "encode")  # the tokenizer, not a Future
    assert llm.generate("hello", use_tqdm=False)[0].outputs[0].token_ids


def test_a_tokenizer_that_fails_to_load_fails_the_engine(tiny_models, tmp_path: Path) -> None:
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_models["llama"], model)
    for path in model.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            path.unlink()
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        LLM(str(model), dtype="float32", max_model_len=64)
    # The engine still loads without one when asked to.
    LLM(str(model), dtype="float32", max_model_len=64, skip_tokenizer_init=True)
