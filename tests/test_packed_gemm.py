"""bf16 GEMMs on oneDNN-prepacked weight copies (attach_packed_gemm_weights): bitwise the
results of `F.linear`, only for the row counts asked, made on first use within the budget
that `fp32_weight_copy_bytes` sets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyvllm import LLM, SamplingParams
from tinyvllm.models.layers.linear import (
    Fp32CopyBudget,
    LinearBase,
    ReplicatedLinear,
    attach_packed_gemm_weights,
    packed_gemm_supported,
)
from tinyvllm.native.build import unsupported_reason
from tinyvllm.native.decode_route import LAYERS
from tinyvllm.utils.cpu import has_native_bf16_matmul

packed_only = pytest.mark.skipif(
    not packed_gemm_supported(torch.bfloat16), reason="torch has no oneDNN packed bf16 linear"
)


def _layer(n: int, k: int, bias: bool, seed: int) -> ReplicatedLinear:
    gen = torch.Generator().manual_seed(seed)
    layer = ReplicatedLinear(k, n, bias=bias).to(torch.bfloat16)
    layer.weight.data = torch.randn(n, k, generator=gen).bfloat16()
    if bias:
        layer.bias.data = torch.randn(n, generator=gen).bfloat16()
    return layer


@packed_only
@pytest.mark.parametrize("bias", [False, True])
def test_packed_copies_give_the_plain_gemm_bitwise_in_their_row_range(bias: bool) -> None:
    layer = _layer(96, 200, bias, seed=3)
    budget = Fp32CopyBudget()
    assert attach_packed_gemm_weights(layer, 4, 16, budget) == 96 * 200 * 2
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for rows, packed in ((2, False), (4, True), (11, True), (16, True), (40, True)):
            x = torch.randn(rows, 200, generator=gen).bfloat16()
            got = layer(x)
            assert torch.equal(got, F.linear(x, layer.weight, layer.bias)), rows
            # The copy is made at the first input in [4, 16] rows and kept.
            assert (layer.gemm_weight is not None) is packed, rows
    assert layer.gemm_weight.is_mkldnn and budget.spent == 96 * 200 * 2
    # Rows outside the range never reach the copy: a 40-row input ran on the plain weight.
    assert not layer._takes_gemm_copy(40) and not layer._takes_gemm_copy(3)


@packed_only
def test_packed_copies_stay_within_the_budget() -> None:
    layers = [_layer(24, 32, False, seed=i) for i in range(3)]
    budget = Fp32CopyBudget(2 * 24 * 32 * 2 + 10)
    attach_packed_gemm_weights(torch.nn.Sequential(*layers), 8, 64, budget)
    x = torch.randn(8, 32).bfloat16()
    with torch.inference_mode():
        outs = [m(x) for m in layers]
    assert [m.gemm_weight is not None for m in layers] == [True, True, False]
    assert layers[2].gemm_min_rows == 0  # refused once: stays on its own weight
    for m, out in zip(layers, outs, strict=True):
        assert torch.equal(out, F.linear(x, m.weight))


@packed_only
@pytest.mark.skipif(unsupported_reason() is not None, reason="native kernels unavailable")
@pytest.mark.skipif(not has_native_bf16_matmul(), reason="no bf16 matmul: fp32 copies instead")
@pytest.mark.usefixtures("one_torch_thread")
def test_batched_decode_on_the_layers_takes_packed_copies(tiny_models) -> None:
    """A decode batch the route sends to the layers runs its GEMMs on the copies, with the
    same tokens as without them; fp32_weight_copy_bytes=0 forbids them."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in range(3, 15)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(**kwargs: int) -> tuple[list[list[int]], int]:
        llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", max_model_len=64, **kwargs)
        runner = llm.engine.runner
        runner.platform.decode_route.fixed = LAYERS
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
        made = sum(m.gemm_weight is not None for m in linears)
        return [list(o.outputs[0].token_ids) for o in outs], made

    tokens, made = run()
    assert made > 0
    assert run(fp32_weight_copy_bytes=0) == (tokens, 0)
