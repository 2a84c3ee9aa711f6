"""Weight-only quantization: kernels against a dequantize-then-F.linear reference, GGUF
repacking, fused-shard loading, memory, and a quantized tiny model against the float one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fixtures import bind_kv_caches, build_tiny_checkpoint, make_metadata
from transformers import AutoConfig

from tinyvllm.attention.backend import AttentionBackend, get_attention_backend
from tinyvllm.gguf.weight import GGUFWeight
from tinyvllm.models.layers.embedding import VocabEmbedding
from tinyvllm.models.layers.linear import (
    MergedColumnLinear,
    QKVLinear,
    ReplicatedLinear,
    attach_fp32_gemm_weights,
)
from tinyvllm.models.loader import iter_safetensors_weights
from tinyvllm.models.registry import get_model_class
from tinyvllm.quant import QuantConfig, QuantizedWeight
from tinyvllm.quant import kernels as K

gguf = pytest.importorskip("gguf")
GT = gguf.GGMLQuantizationType
NEVER = 1 << 62


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def quantized(w: torch.Tensor | GGUFWeight, method: str, group: int = 32) -> QuantizedWeight:
    qw = QuantizedWeight(w.shape[1], w.shape[0], QuantConfig(method, group))
    qw.load_rows(w, 0, w.shape[0])
    return qw


def gguf_weight(w: torch.Tensor, qtype: int) -> GGUFWeight:
    data = gguf.quants.quantize(w.numpy(), qtype)
    return GGUFWeight(torch.from_numpy(data), int(qtype), tuple(w.shape))


def random_kquant(rows: int, cols: int, qtype: int, seed: int = 0) -> GGUFWeight:
    """Random Q4_K / Q6_K blocks (the gguf package cannot quantize k-quants) with sane
    fp16 super-block scales."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // elems, nbytes), dtype=np.uint8)
    scales = (rng.random((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == GT.Q4_K:
        blocks[:, 0:4] = scales  # d, dmin
    else:
        blocks[:, 208:210] = scales[:, :2]  # d
    data = torch.from_numpy(blocks.reshape(rows, -1).copy())
    return GGUFWeight(data, int(qtype), (rows, cols))


def gguf_reference(w: GGUFWeight) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.qtype)).reshape(w.shape)


# --- kernels ---------------------------------------------------------------------------


def test_cpu_int4_layout_is_understood() -> None:
    # 32-row blocks on AVX2 builds, 64 on AVX-512 ones: both must be recognised.
    assert K.cpu_int4_layout_known()
    block = K.cpu_int4_block_rows()
    assert block in (32, 64)
    q = torch.randint(0, 16, (3 * block, 128), dtype=torch.uint8)
    packed = K.pack_int4_cpu(q)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
    assert torch.equal(K.unpack_int4_cpu(packed, block, 3 * block), q[block:])
    assert torch.equal(K.unpack_nibbles(K.pack_nibbles(q)), q)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dense", [False, True])
def test_int4_kernel_matches_reference(rows: int, dense: bool) -> None:
    """torch's kernel computes w = (q - 8) * scale + zero; the dense path agrees."""
    n, k, group = 128, 256, 32  # whole blocks of torch's layout (32 or 64 rows)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    sz = torch.stack([torch.rand(k // group, n) * 0.1, torch.randn(k // group, n) * 0.1], -1)
    sz = sz.bfloat16()
    x = torch.randn(rows, k).bfloat16()
    y = K.int4_linear(x, K.pack_int4_cpu(q), sz, n, 0 if dense else NEVER)
    want = F.linear(x.float(), K.dequantize_int4(q, sz))
    assert y.dtype == x.dtype and y.shape == (rows, n)
    assert rel_err(y, want) < 5e-3  # bf16 output rounding
    generic = K.dequant_linear_int4(x.float(), K.pack_nibbles(q), sz)
    assert rel_err(generic, want) < 1e-6


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dense", [False, True])
def test_int8_kernel_matches_reference(rows: int, dense: bool) -> None:
    n, k = 80, 192
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = (torch.rand(n) * 0.01).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    y = K.int8_linear(x, q, scale, 0 if dense else NEVER)
    want = F.linear(x.float(), K.dequantize_int8(q, scale))
    assert rel_err(y, want) < 5e-3
    assert rel_err(K.dequant_linear_int8(x.float(), q, scale), want) < 1e-6


_TRITON_CHECK = """
import torch
from tinyvllm.quant import kernels as K
from tinyvllm.quant.triton_kernels import triton_int4_linear, triton_int8_linear
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    n, k = 80, 96
    x = torch.randn(3, k).to(dtype)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    sz = torch.stack([torch.rand(3, n) * 0.1, torch.randn(3, n) * 0.1], -1).to(dtype)
    want = x.float() @ K.dequantize_int4(q, sz).T
    got = triton_int4_linear(x, K.pack_nibbles(q), sz).float()
    assert (got - want).norm() / want.norm() < tol, ("int4", dtype)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = (torch.rand(n) * 0.01).to(dtype)
    want = x.float() @ K.dequantize_int8(q8, s8).T
    got = triton_int8_linear(x, q8, s8).float()
    assert (got - want).norm() / want.norm() < tol, ("int8", dtype)
print("ok")
"""


def test_triton_kernel_in_interpreter() -> None:
    """The CUDA kernel, run by Triton's CPU interpreter (which mishandles bf16 dots, so
    fp32 and fp16 only)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 64])  # Triton kernel / transient dequantized copy
def test_cuda_quantized_linear(method: str, rows: int) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            qw = QuantizedWeight(512, 200, QuantConfig(method))
    finally:
        torch.set_default_dtype(previous)
    qw.load_rows(torch.randn(200, 512), 0, 200)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    y = qw.linear(x)
    assert y.device.type == "cuda" and y.dtype == torch.bfloat16
    assert rel_err(y, F.linear(x.float(), qw.dequantize())) < 1e-2


# --- quantizing float and GGUF weights ---------------------------------------------------


@pytest.mark.parametrize(("method", "group", "bound"), [("int8", 32, 0.01), ("int4", 32, 0.1)])
def test_float_weight_quantization_error(method: str, group: int, bound: float) -> None:
    w = torch.randn(96, 256) * 0.05
    qw = quantized(w.bfloat16(), method, group)
    assert qw.format == method
    assert rel_err(qw.dequantize(), w) < bound
    x = torch.randn(4, 256).bfloat16()
    assert rel_err(qw.linear(x), F.linear(x.float(), w)) < bound


def test_int4_falls_back_to_int8_when_groups_do_not_fit() -> None:
    qw = quantized(torch.randn(32, 96), "int4", 64)
    assert qw.format == "int8"


@pytest.mark.parametrize("qtype", [GT.Q4_0, GT.Q4_1, GT.Q4_K])
def test_gguf_int4_blocks_repack_exactly(qtype: int) -> None:
    from tinyvllm.gguf.dequant import q4_blocks

    if qtype == GT.Q4_K:
        gw = random_kquant(64, 512, qtype)
    else:
        gw = gguf_weight(torch.randn(64, 512) * 0.05, qtype)
    qw = quantized(gw, "gguf")
    assert qw.format == "int4"
    q, scale, minimum = q4_blocks(gw.data, gw.qtype, gw.shape)
    # The 4-bit values are the file's own; only the bf16 storage of scale/zero rounds.
    assert torch.equal(K.unpack_int4_cpu(qw.packed.qweight, 0, 64), q)
    assert torch.equal(qw.packed.scales_zeros[..., 0], scale.t().bfloat16())
    assert torch.equal(qw.packed.scales_zeros[..., 1], (minimum + 8 * scale).t().bfloat16())
    reference = gguf_reference(gw)
    assert rel_err(qw.dequantize(), reference) < 4e-3
    for rows in (1, 40):
        x = torch.randn(rows, 512).bfloat16()
        assert rel_err(qw.linear(x), F.linear(x.float(), reference)) < 6e-3


@pytest.mark.parametrize("qtype", [GT.Q8_0, GT.Q6_K, GT.Q5_0])
def test_other_gguf_formats_requantize_to_int8(qtype: int) -> None:
    if qtype == GT.Q6_K:
        gw = random_kquant(48, 256, qtype)
    else:
        gw = gguf_weight(torch.randn(48, 256) * 0.05, qtype)
    qw = quantized(gw, "gguf")
    assert qw.format == "int8"
    assert rel_err(qw.dequantize(), gguf_reference(gw)) < 0.01


# --- layers ------------------------------------------------------------------------------


def test_fused_qkv_shards_in_any_order() -> None:
    layer = QKVLinear(64, 16, 4, 2, bias=True, quant_config=QuantConfig("int4"))
    shards = {"q": torch.randn(64, 64), "k": torch.randn(32, 64), "v": torch.randn(32, 64)}
    bias = torch.randn(128)
    for shard_id in ("v", "q", "k"):
        assert layer.qweight is not None and not layer.qweight.ready
        layer.weight.weight_loader(layer.weight, shards[shard_id], shard_id)
        layer.bias.weight_loader(layer.bias, bias[:64] if shard_id == "q" else bias[:32], shard_id)
    layer.bias.data[64:96] = bias[64:96]
    assert layer.qweight.ready and layer.qweight.format == "int4"
    full = torch.cat([shards["q"], shards["k"], shards["v"]])
    x = torch.randn(3, 64)
    assert rel_err(layer(x), F.linear(x, full, layer.bias)) < 0.1
    q, k, v = layer.split(layer(x))
    assert q.shape == (3, 64) and k.shape == v.shape == (3, 32)


def test_fused_gguf_shards_of_mixed_formats_become_int8() -> None:
    """Q4_K_M files store some v / down projections as Q6_K: the fused layer goes int8."""
    layer = MergedColumnLinear(256, [64, 64], bias=False, quant_config=QuantConfig("gguf"))
    gate = gguf_weight(torch.randn(64, 256) * 0.05, GT.Q4_0)
    up = random_kquant(64, 256, GT.Q6_K)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    assert layer.qweight is not None and layer.qweight.format == "int8"
    full = torch.cat([gguf_reference(gate), gguf_reference(up)])
    assert rel_err(layer.qweight.dequantize(), full) < 0.01


def test_gguf_and_float_shards_share_groups_of_32() -> None:
    layer = MergedColumnLinear(256, [64, 64], bias=False, quant_config=QuantConfig("int4", 128))
    gate = gguf_weight(torch.randn(64, 256) * 0.05, GT.Q4_1)
    up = torch.randn(64, 256) * 0.05
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    assert layer.qweight is not None and layer.qweight.format == "int4"
    assert layer.qweight.packed.scales_zeros.shape[0] == 256 // 32
    assert rel_err(layer.qweight.dequantize()[:64], gguf_reference(gate)) < 4e-3


def test_shape_and_shard_errors() -> None:
    layer = QKVLinear(64, 16, 4, 2, bias=False, quant_config=QuantConfig("int8"))
    with pytest.raises(ValueError, match=r"expected shape \(32, 64\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(64, 64), "k")
    with pytest.raises(ValueError, match="unknown shard"):
        layer.weight.weight_loader(layer.weight, torch.randn(32, 64), "x")
    with pytest.raises(RuntimeError, match="before all of its checkpoint rows"):
        layer(torch.randn(1, 64))
    with pytest.raises(ValueError, match="quantization method 'int3'"):
        QuantConfig("int3")


def test_quantization_argument_is_parsed_in_one_place() -> None:
    """EngineArgs, engine setup and the draft model share one parse of `quantization=`; the
    catalog's entries accept the same words."""
    from tinyvllm.catalog.entries import QUANTIZATIONS
    from tinyvllm.config import EngineArgs
    from tinyvllm.quant.config import (
        QUANTIZATION_OPTIONS,
        parse_quantization,
        resolve_quantization,
    )

    assert set(QUANTIZATIONS) == set(QUANTIZATION_OPTIONS)
    assert parse_quantization(None) is None and parse_quantization("none") is None
    assert parse_quantization("auto") == "auto"
    for bad in ("int3", "", "INT8"):
        with pytest.raises(ValueError, match=f"quantization must be one of .*got {bad!r}"):
            EngineArgs("m", quantization=bad).validate()
    assert resolve_quantization("int4", None) == QuantConfig("int4")
    assert resolve_quantization("auto", None) is None
    assert resolve_quantization("none", "model.gguf") is None
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF checkpoint"):
        resolve_quantization("gguf", None)


@pytest.mark.parametrize(("method", "ratio"), [("int8", 0.51), ("int4", 0.32)])
def test_quantized_layer_memory(method: str, ratio: float) -> None:
    n, k = 1536, 576
    with torch.device("cpu"):
        dense = ReplicatedLinear(k, n, bias=False).to(torch.bfloat16)
        layer = ReplicatedLinear(k, n, bias=False, quant_config=QuantConfig(method))
    layer.weight.weight_loader(layer.weight, torch.randn(n, k))

    def nbytes(module: torch.nn.Module) -> int:
        tensors = [*module.parameters(), *module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    assert nbytes(layer) <= ratio * nbytes(dense)
    assert attach_fp32_gemm_weights(layer, 8) == 0  # no float copy for quantized layers


def test_quantized_embedding_lookup() -> None:
    table = torch.randn(100, 64)
    emb = VocabEmbedding(100, 64, QuantConfig("int4"))
    emb.weight.weight_loader(emb.weight, gguf_weight(table, GT.Q8_0))
    assert emb.qweight is not None and emb.qweight.format == "int8"
    ids = torch.tensor([3, 99, 3, 0])
    assert torch.allclose(emb(ids), emb.qweight.dequantize()[ids])
    assert rel_err(emb(ids), table[ids]) < 0.01


# --- a whole quantized model -------------------------------------------------------------


@pytest.fixture(scope="module")
def calm_checkpoints(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> dict[str, Path]:
    """Tiny llama (untied) and qwen2 (tied, biases) with small weights: the default
    fixtures' activations reach ~70, where any rounding flips greedy picks."""
    root = tmp_path_factory.mktemp("quant_models")
    return {
        family: build_tiny_checkpoint(family, root / family, tokenizer_dir, initializer_range=0.1)
        for family in ("llama", "qwen2")
    }


def build(
    model_dir: Path,
    quant: QuantConfig | None,
    dtype: torch.dtype = torch.bfloat16,
    weights: dict[str, Any] | None = None,
) -> tuple[torch.nn.Module, AttentionBackend]:
    config = AutoConfig.from_pretrained(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = get_model_class(config)(config, 256, quant)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(
        iter(weights.items()) if weights is not None else iter_safetensors_weights(model_dir)
    )
    backend = get_attention_backend(torch.device("cpu"), "torch")
    bind_kv_caches(model, backend, 4, 16)
    return model.eval(), backend


def logprobs(model: torch.nn.Module, backend: AttentionBackend, ids: torch.Tensor) -> torch.Tensor:
    metadata, positions = make_metadata([len(ids)], [len(ids)], [[0, 1, 2]], 16)
    backend.plan(metadata)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, metadata)).log_softmax(-1)


def model_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.dtype != torch.float32)


def check_close_to_fp32(
    model_dir: Path,
    quant: QuantConfig,
    weights: dict[str, Any] | None = None,
    float_weights: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The quantized bf16 model's log-probs of the fp32 model's top tokens are within twice
    the deviation of the plain bf16 model (bf16 rounding alone moves them by ~0.1 here).
    The float models load `float_weights` (default: the same as the quantized one)."""
    float_weights = float_weights if float_weights is not None else weights
    ids = torch.randint(5, 2000, (40,), generator=torch.Generator().manual_seed(0))
    want = logprobs(*build(model_dir, None, torch.float32, float_weights), ids)
    top = want.argmax(-1, keepdim=True)
    bf16 = logprobs(*build(model_dir, None, torch.bfloat16, float_weights), ids)
    model, backend = build(model_dir, quant, torch.bfloat16, weights)
    got = logprobs(model, backend, ids)

    def deviation(lp: torch.Tensor) -> float:
        return (lp.gather(-1, top) - want.gather(-1, top)).abs().max().item()

    assert deviation(got) < max(0.05, 2 * deviation(bf16))
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_model_close_to_float(calm_checkpoints: dict[str, Path], family: str) -> None:
    model_dir = calm_checkpoints[family]
    model = check_close_to_fp32(model_dir, QuantConfig("int8"))
    if family == "qwen2":  # tied: one int8 table serves the lookup and the lm_head
        assert model.lm_head.qweight is model.model.embed_tokens.qweight
    float_model, _ = build(model_dir, None)
    assert model_bytes(model) < 0.56 * model_bytes(float_model)


def test_gguf_blocks_load_like_their_dequantized_floats(calm_checkpoints: dict[str, Path]) -> None:
    """Q4_0 linear weights and a Q8_0 embedding, streamed as raw blocks, give the model the
    float model loaded with the same blocks dequantized gives (int4 repack is lossless)."""
    model_dir = calm_checkpoints["llama"]
    blocks: dict[str, Any] = {}
    for name, tensor in iter_safetensors_weights(model_dir):
        if tensor.dim() == 2:
            qtype = GT.Q8_0 if "embed" in name or "lm_head" in name else GT.Q4_0
            blocks[name] = gguf_weight(tensor.float(), qtype)
        else:
            blocks[name] = tensor
    dequantized = {
        name: gguf_reference(t) if isinstance(t, GGUFWeight) else t for name, t in blocks.items()
    }
    model = check_close_to_fp32(model_dir, QuantConfig("gguf"), blocks, dequantized)
    assert model.model.layers[0].mlp.gate_up_proj.qweight.format == "int4"
    # The head keeps the file's exact (dequantized) values under "gguf".
    assert model.lm_head.qweight is not None and model.lm_head.qweight.format == "float"
