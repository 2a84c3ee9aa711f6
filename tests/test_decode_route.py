"""Decode steps routed between the native decode program and the model's layers on torch's
GEMMs (tinyvllm/native/decode_route.py): the choice per row count follows measured step
times, is fixed when asked, and both paths decode like HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import unsupported_reason
from tinyvllm.native.decode_route import LAYERS, PROGRAM, DecodeRoute

native_only = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


def route_steps(route: DecodeRoute, rows: int, ns_per_row: dict[str, float], steps: int) -> int:
    """Steps of `rows` rows costing ns_per_row[path] per row; returns how many took the
    program."""
    on_program = 0
    for _ in range(steps):
        program = route.takes_program(rows)
        on_program += program
        route.record(rows, rows * ns_per_row[PROGRAM if program else LAYERS])
    return on_program


def test_each_row_count_takes_the_path_measured_faster() -> None:
    # The program's GEMVs win on one row, torch's GEMMs on 64 (as on an AMX CPU).
    route = DecodeRoute()
    one = route_steps(route, 1, {PROGRAM: 10e6, LAYERS: 30e6}, 300)
    many = route_steps(route, 64, {PROGRAM: 3e6, LAYERS: 1.5e6}, 300)
    assert one >= 300 - 300 // route.choice.min_interval, one  # trials of the layers only
    assert many <= 300 // route.choice.min_interval + 2, many
    # Each bucket keeps its own choice: one row still goes to the program.
    picks = [route.takes_program(1) or route.choice.trial for _ in range(5)]
    assert all(picks)


def test_the_choice_follows_a_change_in_step_times() -> None:
    """Another program taking a core can flip which path wins: the route follows within a
    back-off interval."""
    route = DecodeRoute()
    route_steps(route, 16, {PROGRAM: 2e6, LAYERS: 3e6}, 200)
    after = route_steps(route, 16, {PROGRAM: 4e6, LAYERS: 3e6}, 200)
    assert after <= route.choice.max_interval + 8, after


def test_a_path_that_loses_badly_is_tried_rarely() -> None:
    """One row on the layers costs ~3x a program step: after warm-up its trials take at most
    ~1% of the time (a fixed 1-in-64 back-off cost 3% of every single-stream run)."""
    route = DecodeRoute()
    route_steps(route, 1, {PROGRAM: 10e6, LAYERS: 30e6}, 200)  # warm-up: first samples, trials
    on_program = route_steps(route, 1, {PROGRAM: 10e6, LAYERS: 30e6}, 1000)
    trials = 1000 - on_program
    assert trials * (30e6 - 10e6) <= 0.012 * 1000 * 10e6, trials
    # A close loser keeps the usual back-off, so a change in load is still noticed soon.
    route = DecodeRoute()
    route_steps(route, 16, {PROGRAM: 2e6, LAYERS: 3e6}, 400)
    assert route.choice.interval <= route.choice.max_interval


@pytest.mark.parametrize("fixed", [PROGRAM, LAYERS])
def test_a_fixed_route_is_deterministic_and_measures_nothing(fixed: str) -> None:
    route = DecodeRoute(fixed=fixed)
    for rows in (1, 3, 16, 64) * 10:
        assert route.takes_program(rows) is (fixed == PROGRAM)
        # The platform records a step's time only for a pending (measured) choice.
        assert not route.pending
    assert route.choice.estimates == {}


def test_an_unknown_fixed_route_is_refused() -> None:
    with pytest.raises(ValueError, match="'gemm'"):
        DecodeRoute(fixed="gemm")


@native_only
def test_route_only_with_bf16_weights_on_a_cpu_with_bf16_matmul(tiny_models, monkeypatch) -> None:
    path = str(tiny_models["llama"])
    import tinyvllm.platforms.cpu as cpu

    monkeypatch.setattr(cpu, "has_native_bf16_matmul", lambda: True)
    bf16 = LLM(path, dtype="bfloat16", max_model_len=64).engine.runner.platform
    fp32 = LLM(path, dtype="float32", max_model_len=64).engine.runner.platform
    assert bf16.decode_route is not None and fp32.decode_route is None
    monkeypatch.setattr(cpu, "has_native_bf16_matmul", lambda: False)  # AVX2 only
    avx2 = LLM(path, dtype="bfloat16", max_model_len=64).engine.runner.platform
    assert avx2.decode_route is None
    assert avx2.routes_to_program(16)  # every step the program supports runs on it


@native_only
def test_with_amx_linears_every_step_stays_on_the_program(tiny_models, monkeypatch) -> None:
    """The program's AMX linears beat torch's GEMMs at every row count it takes: no step is
    sent to the layers to be measured. Without AMX the route measures both paths."""
    path = str(tiny_models["llama"])
    import tinyvllm.platforms.cpu as cpu

    monkeypatch.setattr(cpu, "has_native_bf16_matmul", lambda: True)
    for amx in (True, False):
        monkeypatch.setattr(NativeCpuOps, "__init__", _with_amx(NativeCpuOps.__init__, amx))
        route = LLM(path, dtype="bfloat16", max_model_len=64).engine.runner.platform.decode_route
        assert route is not None
        assert route.fixed == (PROGRAM if amx else None)
        if amx:
            assert all(route.takes_program(rows) for rows in (1, 16, 64) for _ in range(50))


def _with_amx(init, amx: bool):  # type: ignore[no-untyped-def]
    def wrapped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        self.amx_linears = amx

    return wrapped


@native_only
def test_only_routed_steps_leave_linears_to_torch() -> None:
    from tinyvllm.platforms.cpu import CpuPlatform

    native = NativeCpuOps.load()
    assert native is not None
    platform = CpuPlatform(torch.device("cpu"), torch.bfloat16, native)
    platform.decode_route = DecodeRoute(fixed=LAYERS)
    assert not platform.routes_to_program(16)
    with platform.torch_step(16):
        assert not native.gemv_linears
    assert native.gemv_linears
    with platform.torch_step(16):  # not routed (a prefill chunk, a hybrid's step)
        assert native.gemv_linears


def _hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[tuple]:
    """(tokens, per-step gap between HF's top two logprobs) per prompt, HF in fp32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = []
    for ids in prompts:
        with torch.inference_mode():
            gen = hf.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, output_scores=True, return_dict_in_generate=True,
                pad_token_id=0,
            )  # fmt: skip
        gaps = []
        for scores in gen.scores:
            top = torch.log_softmax(scores[0].float(), -1).topk(2).values
            gaps.append(float(top[0] - top[1]))
        out.append((gen.sequences[0, len(ids) :].tolist(), gaps))
    return out


@native_only
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("fixed", [PROGRAM, LAYERS])
def test_batched_greedy_matches_hf_on_either_route(tiny_models, fixed: str) -> None:
    path = tiny_models["llama"]
    llm = LLM(str(path), dtype="bfloat16", max_model_len=128)
    runner = llm.engine.runner
    if runner.platform.decode_route is None:
        pytest.skip("no route on this CPU (no bf16 matmul)")
    runner.platform.decode_route.fixed = fixed
    calls = {"program": 0, "gemv": 0}
    program, native = runner.decode_program, runner.platform.native

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    program.run = counted("program", program.run)
    native.linear = counted("gemv", native.linear)
    gen = torch.Generator().manual_seed(5)
    vocab = llm.engine.config.model.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # Decode steps ran where the route said: the program (the LM head on a native GEMV), or
    # the layers with every linear on torch's GEMMs.
    assert (calls["program"] > 0) is (fixed == PROGRAM)
    assert (calls["gemv"] > 0) is (fixed == PROGRAM)
    for out, (want, gaps) in zip(outs, _hf_greedy(path, prompts, 10), strict=True):
        got = list(out.outputs[0].token_ids)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:  # bf16 rounding may flip a near tie; nothing is compared beyond it
                assert gaps[i] < 0.1, (i, a, b, gaps[i])
                break
