"""The opt-in int8-activation GEMVs (tinyvllm/native/int8_kernels.cpp) against a torch
reference of exactly their arithmetic: activations rounded to int8 per block of 32 (dx =
max|x| / 127, qx = round(x / dx)), integer dot products with the weight's quants per block,
then (dw * dx) * dot + mw * dx * sum(qx) in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinyvllm.native.abi import FORMAT_INT8_ACT, FORMAT_Q4_0, FORMAT_Q4_1, FORMAT_Q8_0
from tinyvllm.native.build import load_library, unsupported_reason
from tinyvllm.native.quant_ops import QuantKernels

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)
FORMATS = {FORMAT_Q4_0: ("Q4_0", 18), FORMAT_Q4_1: ("Q4_1", 20), FORMAT_Q8_0: ("Q8_0", 34)}


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    lib = load_library()
    assert lib is not None
    lib.tv_set_isa(0)
    return QuantKernels(lib, 2)


def random_blocks(fmt: int, rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random quants with small positive fp16 scales (and negative Q4_1 mins)."""
    nbytes = FORMATS[fmt][1]
    blocks = torch.randint(0, 256, (rows, k // 32, nbytes), generator=gen, dtype=torch.uint8)
    d = (torch.rand(rows, k // 32, 1, generator=gen) * 0.02 + 1e-3).half()
    blocks[..., :2] = d.view(torch.uint8)
    if fmt == FORMAT_Q4_1:
        blocks[..., 2:4] = (-d * 8).half().view(torch.uint8)
    return blocks.reshape(rows, -1)


def split_blocks(fmt: int, blocks: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(quants [N, G, 32] as int, dw [N, G], mw [N, G]) with w = dw * q + mw."""
    b = blocks.reshape(blocks.shape[0], k // 32, FORMATS[fmt][1])
    dw = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if fmt == FORMAT_Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).int(), dw, torch.zeros_like(dw)
    qs = b[..., 4:] if fmt == FORMAT_Q4_1 else b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).int()
    if fmt == FORMAT_Q4_1:
        return q, dw, b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    return q, dw, -8.0 * dw


def reference(x: torch.Tensor, fmt: int, blocks: torch.Tensor) -> torch.Tensor:
    """The int8-activation GEMV in torch: fp32 scales, exact integer dots, fp64 sums."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    qx = torch.round(xb * inv[..., None]).int()
    sx = dx * qx.sum(-1).float()
    q, dw, mw = split_blocks(fmt, blocks, k)
    dots = torch.einsum("mgi,ngi->mng", qx.double(), q.double())  # exact integers
    out = ((dw[None] * dx[:, None]).double() * dots + (mw[None] * sx[:, None]).double()).sum(-1)
    return out.float()


def check(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor,
          fmt: int) -> None:  # fmt: skip
    """fp32 rounding of the per-block products and sums: relative to sum |terms|."""
    k = x.shape[1]
    q, dw, mw = split_blocks(fmt, blocks, k)
    mag = (
        x.float().abs()
        @ (dw.abs()[..., None] * q.abs() + mw.abs()[..., None]).reshape(q.shape[0], k).t()
    )
    bound = 2e-6 * mag + 1e-7
    if got.dtype == torch.bfloat16:
        bound = bound + want.abs() * 2.0**-8
    excess = ((got.float() - want).abs() - bound).max().item()
    assert excess <= 0, excess


@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: FORMATS[f][0])
@pytest.mark.parametrize("k", [32, 96, 576, 1536])  # odd block counts take the tail path
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_int8_gemv_matches_the_reference(kernels: QuantKernels, fmt: int, k: int, m: int) -> None:
    if not kernels.lib.tv_int8_act_supported(fmt):
        pytest.skip("no AVX512-VNNI here: the int8-activation kernels fall back to exact ones")
    gen = torch.Generator().manual_seed(fmt * 1000 + k + m)
    rows = 67  # an odd last row and a short last item
    blocks = random_blocks(fmt, rows, k, gen)
    x = torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero block: dx = 0
    got = kernels.gemv(x, fmt | FORMAT_INT8_ACT, blocks, rows)
    check(got, reference(x, fmt, blocks), x, blocks, fmt)
    xb = x.bfloat16()
    got = kernels.gemv(xb, fmt | FORMAT_INT8_ACT, blocks, rows)
    assert got.dtype == torch.bfloat16
    check(got, reference(xb, fmt, blocks), xb, blocks, fmt)


def test_int8_gemv_differs_from_the_exact_kernel(kernels: QuantKernels) -> None:
    """The flag really switches kernels (and the exact one stays the default)."""
    if not kernels.lib.tv_int8_act_supported(FORMAT_Q4_1):
        pytest.skip("no AVX512-VNNI here")
    gen = torch.Generator().manual_seed(5)
    blocks = random_blocks(FORMAT_Q4_1, 64, 576, gen)
    x = torch.randn(1, 576, generator=gen)
    exact = kernels.gemv(x, FORMAT_Q4_1, blocks, 64)
    int8 = kernels.gemv(x, FORMAT_Q4_1 | FORMAT_INT8_ACT, blocks, 64)
    assert not torch.equal(exact, int8)
    assert (exact - int8).abs().max() <= 0.02 * exact.abs().max()


def test_int8_flag_falls_back_to_exact_on_avx2(kernels: QuantKernels) -> None:
    """A CPU without the AVX-512 kernels computes the exact result for a flagged code."""
    gen = torch.Generator().manual_seed(6)
    blocks = random_blocks(FORMAT_Q8_0, 40, 96, gen)
    x = torch.randn(2, 96, generator=gen)
    try:
        kernels.lib.tv_set_isa(1)  # AVX2 only
        assert not kernels.lib.tv_int8_act_supported(FORMAT_Q8_0)
        flagged = kernels.gemv(x, FORMAT_Q8_0 | FORMAT_INT8_ACT, blocks, 40)
        exact = kernels.gemv(x, FORMAT_Q8_0, blocks, 40)
    finally:
        kernels.lib.tv_set_isa(0)
    assert torch.equal(flagged, exact)


# --- engine ------------------------------------------------------------------------------


# A prompt for the tiny models' logprob comparisons.
PROMPT = [(37 * i + 11) % 500 + 3 for i in range(24)]


def tiny_q4_1_gguf(tiny_models: object, tmp_path: Path) -> Path:
    """The tiny Llama as a GGUF of Q4_1 layers and a Q8_0 embedding / lm_head."""
    import gguf
    from gguf_writer import write_tiny_gguf

    q = gguf.GGMLQuantizationType
    return write_tiny_gguf(
        tiny_models["llama"],  # type: ignore[index]
        tmp_path / "tiny.gguf",
        qtype_for=lambda name, w: q.Q8_0 if name.startswith("token_embd") else q.Q4_1,
    )


def _prompt_logprobs(llm: object, prompt: list[int]) -> list[float]:
    from tinyvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0]


def test_engine_int8_activations_are_close_to_the_exact_default(
    tiny_models: object, tmp_path: Path, kernels: QuantKernels
) -> None:
    """A tiny Llama with Q4_1 layers and a Q8_0 embedding / lm_head: the default stays exact
    (its GEMVs take the plain codes), the opt-in moves prompt logprobs by a little."""
    from tinyvllm import LLM

    if not kernels.int8_activations_supported(FORMAT_Q4_1):
        pytest.skip("no AVX512-VNNI here: the opt-in runs the exact kernels")
    path = tiny_q4_1_gguf(tiny_models, tmp_path)
    prompt = PROMPT
    got = {}
    for int8 in (False, True):
        llm = LLM(str(path), dtype="float32", max_model_len=128, int8_activations=int8)
        layer = llm.engine.runner.model.model.layers[0].mlp.gate_up_proj.qweight.packed
        assert (layer.gemv_code != layer.code) == int8
        got[int8] = _prompt_logprobs(llm, prompt)
    diffs = [abs(a - b) for a, b in zip(got[False], got[True], strict=True)]
    scale = sum(abs(v) for v in got[False]) / len(diffs)
    # Measured: mean |dlogprob| 0.43 (1.6% of the mean |logprob|, 27: the random model's
    # logits span ~40 nats), largest 1.4.
    assert 0 < sum(diffs) / len(diffs) < 0.03 * scale, (diffs, scale)
    assert max(diffs) < 0.1 * scale, (diffs, scale)


def test_engine_refuses_int8_activations_without_gguf_blocks(tiny_models: object) -> None:
    from tinyvllm import LLM

    with pytest.raises(ValueError, match="int8_activations=True needs quantized GGUF weights"):
        LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, int8_activations=True)


def test_cli_flag_reaches_the_engine_arguments() -> None:
    import argparse

    from tinyvllm.cli.common import add_engine_args, cli_engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert cli_engine_kwargs(p.parse_args(["--int8-activations"]))["int8_activations"] is True
    assert "int8_activations" not in cli_engine_kwargs(p.parse_args([]))
