"""One platform switch: the runner's device-specific kernels come from the platform chosen
once, and `enforce_eager=True` is the plain PyTorch path (no native library at all)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.native import build as build_mod
from tinyvllm.native import ops as ops_mod
from tinyvllm.native import quant_ops as quant_ops_mod
from tinyvllm.native.build import unsupported_reason
from tinyvllm.platforms import CudaPlatform, Platform, select_platform
from tinyvllm.platforms.cpu import CpuPlatform
from tinyvllm.quant.weight import QuantizedWeight

native_only = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


def forbid_native_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on any attempt to load (or build) the native library fails the test."""

    def forbidden() -> None:
        pytest.fail("the native library was loaded under enforce_eager=True")

    for module in (build_mod, ops_mod, quant_ops_mod):
        monkeypatch.setattr(module, "load_library", forbidden)


@pytest.fixture
def no_native_library(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_native_library(monkeypatch)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[5, 6, 7, 8, 9], [300, 20, 1000], [11, 12]]


def test_eager_cpu_platform_is_plain_torch(no_native_library: None) -> None:
    platform = select_platform(torch.device("cpu"), torch.float32, enforce_eager=True)
    assert isinstance(platform, CpuPlatform) and platform.native is None
    assert platform.quant_kernels is None and not platform.uses_cuda_graphs
    assert platform.attention_backend(None).name == "torch"


def test_cuda_platform_captures_graphs_unless_eager() -> None:
    device = torch.device("cuda")
    assert isinstance(select_platform(device, torch.float16, False), CudaPlatform)
    eager = select_platform(device, torch.float16, True)
    assert type(eager) is Platform and not eager.uses_cuda_graphs


@native_only
def test_enforce_eager_float_model_loads_no_native_library_and_matches(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, kw = str(tiny_models["llama"]), {"dtype": "float32", "max_model_len": 128}
    native = LLM(path, **kw)
    assert native.engine.runner.decode_program is not None
    expected = _greedy(native, PROMPTS)
    forbid_native_library(monkeypatch)
    eager = LLM(path, enforce_eager=True, **kw)
    runner = eager.engine.runner
    assert runner.decode_program is None and runner.backend.name == "torch"
    assert all(getattr(m, "native", None) is None for m in runner.model.modules())
    assert _greedy(eager, PROMPTS) == expected


def test_enforce_eager_gguf_blocks_stay_in_torch(
    no_native_library: None, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """GGUF block weights used to reach the native GEMVs through a module-level global even
    under enforce_eager; now the platform hands the loader no kernels."""
    gguf = pytest.importorskip("gguf")
    from fixtures import build_tiny_checkpoint
    from gguf_writer import write_tiny_gguf

    model_dir = build_tiny_checkpoint("llama", tmp_path / "llama", tokenizer_dir)

    def qtype(name: str, weight: np.ndarray) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType.Q8_0

    write_tiny_gguf(model_dir, tmp_path / "tiny.gguf", qtype_for=qtype)
    llm = LLM(
        str(tmp_path),
        gguf_file="tiny.gguf",
        dtype="float32",
        max_model_len=128,
        quantization="gguf",
        enforce_eager=True,
    )
    weights = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedWeight)]
    assert weights and all(w.kernels is None for w in weights)
    assert {w.format for w in weights} <= {"int8", "int4", "float"}
    assert all(len(tokens) == 10 for tokens in _greedy(llm, PROMPTS))


@native_only
def test_the_model_hands_the_program_its_weight_plan(tiny_models) -> None:
    """The decode program is built from `native_decode_plan()` (the model says what it can
    express); the program refuses plans the kernels cannot run instead of reading modules."""
    from dataclasses import replace

    from tinyvllm.native.llama_decode import LlamaDecodeProgram

    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=128)
    runner = llm.engine.runner
    model, ops = runner.model, runner.platform.native
    plan = model.native_decode_plan()
    assert plan is not None and len(plan.layers) == len(model.model.layers)
    assert plan.layers[0].q_norm is model.model.layers[0].self_attn.q_norm.weight
    assert LlamaDecodeProgram.build(plan, ops) is not None
    # What the kernels cannot read: a strided weight, a cache in another dtype.
    layer = plan.layers[0]
    strided = replace(layer, o=replace(layer.o, data=layer.o.data.t()))
    assert LlamaDecodeProgram.build(replace(plan, layers=(strided,)), ops) is None
    bf16_cache = replace(layer, kv_cache=layer.kv_cache.bfloat16())
    assert LlamaDecodeProgram.build(replace(plan, layers=(bf16_cache,)), ops) is None
    # What the model cannot express: attention logit soft-capping.
    model.model.layers[1].self_attn.attn.logits_soft_cap = 30.0
    assert model.native_decode_plan() is None
