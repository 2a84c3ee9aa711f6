"""Model resolution, safetensors reading and weight loading: happy paths and clear errors."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from tinyvllm.models.loader import iter_safetensors_weights, load_model, resolve_model_path
from tinyvllm.models.registry import get_model_class, resolve_architecture, supported_architectures

SUPPORTED = (
    "BertModel, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, "
    "GraniteMoeHybridForCausalLM, Lfm2ForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
    "NemotronHForCausalLM, Qwen2ForCausalLM, "
    "Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM, VoxtralRealtimeForConditionalGeneration"
)


@pytest.fixture
def llama_copy(tiny_models: Mapping[str, Path], tmp_path: Path) -> Path:
    """A private copy of the llama checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_models["llama"], tmp_path / "llama"))


def build_model(model_dir: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cpu"):
        return get_model_class(config)(config, 128)


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors_weights(model_dir))


# --- registry ---------------------------------------------------------------------------


def test_registry_resolves_every_family(tiny_models: Mapping[str, Path]) -> None:
    assert ", ".join(supported_architectures()) == SUPPORTED
    for family in tiny_models:
        config = AutoConfig.from_pretrained(tiny_models[family])
        arch, entry = resolve_architecture(config)
        assert arch == config.architectures[0]
        assert entry.state_kind == "default"
        assert get_model_class(config).__name__ == arch


def test_unsupported_architecture_lists_supported(llama_copy: Path) -> None:
    config = AutoConfig.from_pretrained(llama_copy)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported") as info:
        load_model(llama_copy, config, torch.float32, torch.device("cpu"), 128)
    assert SUPPORTED in str(info.value)
    config.architectures = None
    with pytest.raises(ValueError, match="no 'architectures'"):
        get_model_class(config)


# --- resolve_model_path ------------------------------------------------------------------


def test_local_directory_resolves(tiny_models: Mapping[str, Path]) -> None:
    assert resolve_model_path(str(tiny_models["llama"])) == tiny_models["llama"].resolve()


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json") as info:
        resolve_model_path(str(tmp_path))
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("path", ["./no-such-model", "/no/such/model", "~/no-such-model"])
def test_nonexistent_path_does_not_try_the_hub(path: str) -> None:
    with pytest.raises(FileNotFoundError, match="no such directory") as info:
        resolve_model_path(path)
    assert path in str(info.value)


def test_offline_uncached_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("someorg/not-cached", download_dir=str(tmp_path))
    message = str(info.value)
    for words in ("'someorg/not-cached'", "not in the local", "cache", "HF_HUB_OFFLINE", "local"):
        assert words in message


def test_offline_cached_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_models: Mapping[str, Path]
) -> None:
    # The layout huggingface_hub writes: refs/<revision> names a snapshot directory.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someorg--tiny"
    shutil.copytree(tiny_models["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = resolve_model_path("someorg/tiny", download_dir=str(tmp_path))
    assert path == repo / "snapshots" / commit
    assert (path / "config.json").is_file()


def test_invalid_hub_id(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="neither an existing local directory nor a valid"):
        resolve_model_path("not a valid id!", download_dir=str(tmp_path))


# --- safetensors reading -------------------------------------------------------------------


def test_missing_weight_files(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors") as info:
        list(iter_safetensors_weights(llama_copy))
    assert "not loaded for safety" in str(info.value)
    (llama_copy / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match=r"found pytorch_model\.bin.*arbitrary code"):
        list(iter_safetensors_weights(llama_copy))


def test_corrupt_weight_file(llama_copy: Path) -> None:
    weights = llama_copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ValueError, match="corrupt or truncated") as info:
        list(iter_safetensors_weights(llama_copy))
    assert str(weights) in str(info.value)


def shard(model_dir: Path) -> dict[str, torch.Tensor]:
    """Rewrite model_dir's single file as two shards plus an index, as HF does."""
    tensors = checkpoint(model_dir)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for filename, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(model_dir / filename))
        weight_map.update(dict.fromkeys(part, filename))
    (model_dir / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_sharded_checkpoint(llama_copy: Path) -> None:
    expected = shard(llama_copy)
    loaded = checkpoint(llama_copy)
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[n], expected[n]) for n in expected)
    (llama_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing shard.*model-00002-of-00002"):
        next(iter_safetensors_weights(llama_copy))


# --- load_weights ------------------------------------------------------------------------


def stream(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from tensors.items()


def test_missing_tensor_is_named(tiny_models: Mapping[str, Path]) -> None:
    tensors = checkpoint(tiny_models["llama"])
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    with pytest.raises(ValueError, match="missing 2 tensor") as info:
        build_model(tiny_models["llama"]).load_weights(stream(tensors))
    assert "model.layers.1.self_attn.k_proj.weight" in str(info.value)
    assert "model.norm.weight" in str(info.value)


def test_untied_model_needs_lm_head(tiny_models: Mapping[str, Path]) -> None:
    tensors = checkpoint(tiny_models["llama"])
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensor.*lm_head\.weight"):
        build_model(tiny_models["llama"]).load_weights(stream(tensors))


def test_unexpected_tensor_is_named(tiny_models: Mapping[str, Path]) -> None:
    tensors = checkpoint(tiny_models["mistral"])
    tensors["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0.*qweight'"):
        build_model(tiny_models["mistral"]).load_weights(stream(tensors))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.0.self_attn.k_proj.weight", "(32, 64)"),  # a shard of the fused qkv
        ("model.layers.2.mlp.up_proj.weight", "(128, 64)"),  # a shard of gate_up
        ("model.embed_tokens.weight", "(2000, 64)"),  # a plain parameter
    ],
)
def test_misshaped_tensor_is_named(
    tiny_models: Mapping[str, Path], name: str, expected: str
) -> None:
    tensors = checkpoint(tiny_models["qwen3"])
    tensors[name] = torch.zeros(3, 64)
    with pytest.raises(ValueError) as info:
        build_model(tiny_models["qwen3"]).load_weights(stream(tensors))
    message = str(info.value)
    assert repr(name) in message
    assert f"expected shape {expected}, got (3, 64)" in message


def test_ignored_tensors(tiny_models: Mapping[str, Path]) -> None:
    model_dir = tiny_models["qwen2"]  # tied embeddings
    tensors = checkpoint(model_dir)
    assert "lm_head.weight" not in tensors
    model = build_model(model_dir)
    model.load_weights(stream(tensors))
    # A tied checkpoint that still stores lm_head, and HF's rotary buffers, are ignored.
    tensors["lm_head.weight"] = torch.zeros(2000, 64)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    model.load_weights(stream(tensors))
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_fused_weights_land_at_the_right_offsets(tiny_models: Mapping[str, Path]) -> None:
    tensors = checkpoint(tiny_models["qwen2"])
    model = build_model(tiny_models["qwen2"])
    model.load_weights(stream(tensors))
    attn = model.model.layers[1].self_attn
    prefix = "model.layers.1.self_attn."
    for kind in ("weight", "bias"):
        fused = getattr(attn.qkv_proj, kind)
        parts = [tensors[f"{prefix}{p}_proj.{kind}"] for p in "qkv"]
        assert torch.equal(fused, torch.cat(parts))
    mlp = model.model.layers[1].mlp
    gate, up = (tensors[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))


def test_load_model_in_bfloat16(tiny_models: Mapping[str, Path]) -> None:
    model_dir = tiny_models["llama"]
    config = AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, torch.bfloat16, torch.device("cpu"), 64)
    assert not model.training
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.cos_cache.shape == (64, 16)
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32
    expected = checkpoint(model_dir)["lm_head.weight"].to(torch.bfloat16)
    assert torch.equal(model.lm_head.weight, expected)
