"""GGUF loading on synthetic data: block dequantization against the `gguf` package's
reference, our file parser against `gguf.GGUFReader`, tiny checkpoints converted the way
llama.cpp converts them (names, q/k permutation, quantization) and clear errors."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import write_tiny_gguf
from transformers import AutoConfig, AutoTokenizer

from tinyvllm import LLM
from tinyvllm.gguf.config import load_gguf_config
from tinyvllm.gguf.dequant import dequantize, q4_blocks, q8_blocks
from tinyvllm.gguf.paths import resolve_gguf_path
from tinyvllm.gguf.reader import read_gguf
from tinyvllm.gguf.tokenizer_cache import load_gguf_tokenizer
from tinyvllm.gguf.weight import GGUFWeight
from tinyvllm.gguf.weights import hf_tensor_name, iter_gguf_weights, unpermute_rows
from tinyvllm.models.layers.rotary import RopeConfig, compute_inv_freq
from tinyvllm.models.loader import load_model

Q = gguf.GGMLQuantizationType
# Byte offsets of the fp16 scale fields in one block, for the types `gguf.quants` cannot
# quantize: random bytes there could be inf/nan, which make equality checks meaningless.
_K_QUANT_F16_FIELDS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
_ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *_K_QUANT_F16_FIELDS]


def _raw_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes_per_row] of a tensor in `qtype`."""
    rng = np.random.default_rng(seed)
    if qtype not in _K_QUANT_F16_FIELDS:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
        return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // elems, nbytes), dtype=np.uint8)
    for offset in _K_QUANT_F16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", _ALL_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference(qtype: Q) -> None:
    rows, cols = 6, 512
    raw = _raw_blocks(qtype, rows, cols)
    expected = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    assert np.isfinite(expected).all()
    ours = dequantize(torch.from_numpy(raw), int(qtype), (rows, cols))
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert torch.equal(ours, torch.from_numpy(expected.astype(np.float32)))
    # The same bytes as a GGUFWeight, after a row permutation.
    weight = GGUFWeight(torch.from_numpy(raw), int(qtype), (rows, cols))
    index = torch.tensor([3, 0, 5, 1, 4, 2])
    assert torch.equal(weight.select_rows(index).dequantize(), ours[index])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_q4_blocks_rebuild_the_weights_exactly(qtype: Q) -> None:
    rows, cols = 4, 512
    raw = torch.from_numpy(_raw_blocks(qtype, rows, cols, seed=1))
    q, scale, minimum = q4_blocks(raw, int(qtype), (rows, cols))
    assert q.dtype == torch.uint8 and q.shape == (rows, cols) and int(q.max()) <= 15
    assert scale.shape == minimum.shape == (rows, cols // 32)
    groups = (rows, cols // 32, 32)
    rebuilt = scale.unsqueeze(-1) * q.view(groups).float() + minimum.unsqueeze(-1)
    assert torch.equal(rebuilt.view(rows, cols), dequantize(raw, int(qtype), (rows, cols)))


def test_q8_blocks_and_accessor_errors() -> None:
    raw = torch.from_numpy(_raw_blocks(Q.Q8_0, 3, 64))
    q, scale = q8_blocks(raw, int(Q.Q8_0), (3, 64))
    assert q.dtype == torch.int8 and scale.shape == (3, 2)
    rebuilt = (q.view(3, 2, 32).float() * scale.unsqueeze(-1)).view(3, 64)
    assert torch.equal(rebuilt, dequantize(raw, int(Q.Q8_0), (3, 64)))
    with pytest.raises(ValueError, match="q8_blocks takes Q8_0, not Q4_0"):
        q8_blocks(raw, int(Q.Q4_0), (3, 64))
    with pytest.raises(ValueError, match="q4_blocks takes Q4_0, Q4_1 or Q4_K, not Q8_0"):
        q4_blocks(raw, int(Q.Q8_0), (3, 64))


def test_unsupported_or_malformed_blocks_name_the_problem() -> None:
    raw = torch.zeros(2, 66, dtype=torch.uint8)
    with pytest.raises(ValueError, match="type IQ2_XXS is not supported; supported types: F32"):
        dequantize(raw, int(Q.IQ2_XXS), (2, 256))
    with pytest.raises(ValueError, match=r"shape \(2, 64\) needs 136 bytes, got 132"):
        dequantize(raw, int(Q.Q8_0), (2, 64))
    with pytest.raises(ValueError, match="not a whole number of 32-element blocks"):
        dequantize(raw, int(Q.Q8_0), (2, 48))


def test_unpermute_rows_inverts_llama_cpp_permutation() -> None:
    heads, head_dim = 3, 8
    hf = torch.arange(heads * head_dim * 5).view(heads * head_dim, 5)
    # convert_hf_to_gguf: view each head as (2 halves, head_dim/2) and interleave them.
    permuted = hf.view(heads, 2, head_dim // 2, 5).transpose(1, 2).reshape(hf.shape)
    assert torch.equal(permuted[unpermute_rows(heads, heads * head_dim)], hf)
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None


# --- tiny checkpoints converted to GGUF -------------------------------------------------

FAMILIES = ("llama", "qwen2", "qwen3")  # Mistral converts as llama (no sliding window)


@pytest.fixture(scope="module")
def f32_ggufs(
    tiny_models: Mapping[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_f32")
    return {f: write_tiny_gguf(tiny_models[f], root / f"{f}.gguf") for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_loads_the_checkpoint_weights_exactly(
    family: str, tiny_models: Mapping[str, Path], f32_ggufs: dict[str, Path]
) -> None:
    """Names, q/k un-permutation, biases, q/k norms, tying and rope scaling (llama3 via the
    rope_freqs tensor, yarn via metadata) all come back exactly from an unquantized file."""
    config = load_gguf_config(f32_ggufs[family])
    reference_config = AutoConfig.from_pretrained(tiny_models[family])
    assert config.architectures == reference_config.architectures
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "rms_norm_eps",
        "max_position_embeddings",
    ):
        assert getattr(config, key) == pytest.approx(getattr(reference_config, key)), key
    ours_rope = compute_inv_freq(RopeConfig.from_hf_config(config))
    ref_rope = compute_inv_freq(RopeConfig.from_hf_config(reference_config))
    assert torch.allclose(ours_rope[0], ref_rope[0], rtol=1e-6) and ours_rope[1] == ref_rope[1]

    ours = load_model(f32_ggufs[family], config, torch.float32, "cpu", 128).state_dict()
    ref = load_model(tiny_models[family], reference_config, torch.float32, "cpu", 128)
    ref_state = ref.state_dict()
    assert ours.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(ours[name], tensor), name


def test_keep_quantized_yields_raw_rows_in_hf_order(
    tiny_models: Mapping[str, Path], tmp_path: Path
) -> None:
    path = write_tiny_gguf(
        tiny_models["llama"], tmp_path / "q.gguf", qtype_for=lambda name, w: Q.Q4_1
    )
    gf = read_gguf(path)
    config = load_gguf_config(path)
    plain = dict(iter_gguf_weights(gf, config))
    kept = dict(iter_gguf_weights(gf, config, keep_quantized=True))
    assert plain.keys() == kept.keys()
    q_name = "model.layers.0.self_attn.q_proj.weight"
    assert isinstance(kept[q_name], GGUFWeight) and kept[q_name].qtype_name == "Q4_1"
    assert kept[q_name].shape == (64, 64)
    for name, value in kept.items():
        if isinstance(value, GGUFWeight):
            assert torch.equal(value.dequantize(), plain[name]), name
        else:
            assert value.dim() == 1 and torch.equal(value, plain[name]), name
    # Kept blocks are read into memory of their own (not views of the mapped file), which
    # the layers keep without copying them again.
    file_bytes = gf.raw("token_embd.weight")
    start = file_bytes.data_ptr() - gf.tensors["token_embd.weight"].offset
    for name, value in kept.items():
        if isinstance(value, GGUFWeight):
            assert value.owned, name
            assert not start <= value.data.data_ptr() < start + gf.path.stat().st_size, name
    assert torch.equal(kept["model.embed_tokens.weight"].data, gf.read("token_embd.weight"))
    assert torch.equal(gf.read("token_embd.weight"), file_bytes)
    bf16 = dict(iter_gguf_weights(gf, config, dtype=torch.bfloat16))
    assert bf16[q_name].dtype == torch.bfloat16
    assert torch.equal(bf16[q_name], plain[q_name].to(torch.bfloat16))


def test_reader_matches_the_gguf_package(f32_ggufs: dict[str, Path]) -> None:
    path = f32_ggufs["qwen2"]
    ours = read_gguf(path)
    reference = gguf.GGUFReader(path)
    for key, field in reference.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in reference.tensors] == list(ours.tensors)
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert (info.qtype, info.offset, info.nbytes) == (
            int(tensor.tensor_type),
            tensor.data_offset,
            tensor.n_bytes,
        )
        assert ours.raw(tensor.name).numpy().tobytes() == np.asarray(tensor.data).tobytes()


def test_gguf_tokenizer_keeps_vocab_specials_and_template(
    f32_ggufs: dict[str, Path], tokenizer_dir: Path
) -> None:
    ours = load_gguf_tokenizer(f32_ggufs["llama"])
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert ours.chat_template == reference.chat_template
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    text = "def f(x):\n    return x + 1  # héllo wörld ✓ <|im_end|>"
    assert ours.encode(text) == reference.encode(text)
    assert ours.decode(ours.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )


def test_quantized_llama_gguf_matches_transformers_gguf_loader(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Greedy tokens and logprobs against transformers loading the same quantized file
    (default rope: transformers' GGUF config reader ignores rope scaling)."""
    from fixtures import build_tiny_checkpoint

    from tinyvllm.parity import load_hf_reference, run_parity

    model_dir = build_tiny_checkpoint(
        "llama",
        tmp_path / "llama",
        tokenizer_dir,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )

    def mixed(name: str, weight: np.ndarray) -> Q:
        if name.startswith("blk.0."):
            return Q.Q5_1
        return {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "ffn_up": Q.Q5_0}.get(
            name.split(".")[-2], Q.Q8_0
        )

    path = write_tiny_gguf(model_dir, tmp_path / "tiny.gguf", qtype_for=mixed)
    llm = LLM(
        str(tmp_path), gguf_file="tiny.gguf", dtype="float32", max_model_len=128, quantization=None
    )
    assert llm.engine.config.model.model_path == str(path.resolve())
    report = run_parity(
        llm, load_hf_reference(str(path)), [[5, 6, 7, 8, 9, 10, 11], [300, 20, 1000]], 16
    )
    assert report.identical, report.summary()
    assert report.max_logprob_diff < 1e-3, report.summary()
    # Text in, text out through the tokenizer rebuilt from the file.
    out = llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)
    assert out[0].prompt_token_ids[0] == llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")
    # The directory holds one GGUF and no config.json, so naming the directory is enough.
    assert resolve_gguf_path(str(tmp_path)) == path.resolve()
    assert resolve_gguf_path(str(model_dir)) is None  # a safetensors model stays one


def test_cli_check_on_a_gguf_file(
    tiny_models: Mapping[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tinyvllm.cli import main

    path = write_tiny_gguf(tiny_models["qwen2"], tmp_path / "tiny.gguf", lambda n, w: Q.Q8_0)
    argv = ["check", "--model", str(tmp_path), "--gguf-file", "tiny.gguf", "--max-tokens", "4"]
    assert main([*argv, "def f(x):"]) == 0, capsys.readouterr()
    assert "greedy agreement 100.0%" in capsys.readouterr().out
    assert main(["generate", "--model", str(path), "--max-tokens", "3", "x = 1"]) == 0


# --- errors -----------------------------------------------------------------------------


def test_not_a_gguf_file_and_missing_files(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        LLM(str(fake))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf(fake)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        LLM(str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match=r"gguf_file 'other.gguf' is not in .*model.gguf"):
        resolve_gguf_path(str(tmp_path), "other.gguf")
    (tmp_path / "second.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_gguf_path(str(tmp_path))
    with pytest.raises(ValueError, match=r"gguf_file='x\.gguf' needs model= to be a directory"):
        resolve_gguf_path(str(fake), "x.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_gguf(truncated)


def _gguf_with_string_array(path: Path, items: list[bytes], declared_last: int) -> Path:
    """A GGUF holding one long string array whose last string declares `declared_last` bytes."""
    key = b"tokenizer.ggml.tokens"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, len(items))
    for item in items[:-1]:
        body += struct.pack("<Q", len(item)) + item
    body += struct.pack("<Q", declared_last) + items[-1]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    return path


def test_long_string_arrays_decode_lazily_and_are_bounds_checked_when_read(
    tmp_path: Path,
) -> None:
    items = [f"tok{i}-\u00fc".encode() for i in range(500)]
    good = _gguf_with_string_array(tmp_path / "good.gguf", items, len(items[-1]))
    tokens = read_gguf(good).metadata["tokenizer.ggml.tokens"]
    assert tokens == [item.decode() for item in items]
    # The vocabulary is not decoded while parsing, but its bounds are still checked then.
    bad = _gguf_with_string_array(tmp_path / "bad.gguf", items, 10**6)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_gguf(bad)


def test_hub_gguf_offline_names_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'m\.Q4_0\.gguf' of 'no-org/no-repo' is not in"):
        resolve_gguf_path("no-org/no-repo", "m.Q4_0.gguf")


def test_unsupported_architecture_and_quant_type(
    tiny_models: Mapping[str, Path], tmp_path: Path
) -> None:
    gpt2 = write_tiny_gguf(tiny_models["llama"], tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported; .*llama"):
        LLM(str(gpt2))
    granite = write_tiny_gguf(
        tiny_models["llama"], tmp_path / "granite.gguf", architecture="granitehybrid"
    )
    with pytest.raises(ValueError, match=r"'granitehybrid' .*not supported yet.*granite-4\.0-h"):
        LLM(str(granite))

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(256)
    writer.add_tensor(
        "token_embd.weight", np.zeros((4, 66), np.uint8), raw_shape=(4, 66), raw_dtype=Q.IQ2_XXS
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'token_embd\.weight' has type IQ2_XXS, which is not"):
        list(iter_gguf_weights(read_gguf(path), None))


def test_missing_tensor_is_named(tiny_models: Mapping[str, Path], tmp_path: Path) -> None:
    path = write_tiny_gguf(
        tiny_models["qwen3"], tmp_path / "m.gguf", skip=("blk.1.attn_k_norm.weight",)
    )
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\).*layers.1.self_attn.k_norm"):
        load_model(path, load_gguf_config(path), torch.float32, "cpu", 64)


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile line")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc")
def test_release_drops_a_tensors_file_pages_and_keeps_its_views_valid(tmp_path: Path) -> None:
    """Loading copies each tensor out of the mapped file; `release` then returns its pages, so
    a load does not hold the file's pages and the model's copy at once (2x peak RSS)."""
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    values = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    writer.add_tensor("token_embd.weight", values)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file):
        step()
    writer.write_tensors_to_file()
    writer.close()
    gf = read_gguf(path)
    view = gf.raw("token_embd.weight").view(torch.float32)
    assert float(view.sum()) == pytest.approx(float(values.sum()), rel=1e-4)  # pages touched
    touched = _rss_file_kib()
    gf.release("token_embd.weight")
    assert touched - _rss_file_kib() > 6 * 1024  # of the 8 MiB tensor
    assert np.array_equal(view.numpy().reshape(values.shape), values)  # read back from the file
