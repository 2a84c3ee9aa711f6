"""Model states: the registry's state_kind picks one, and the runner routes through its hooks."""

from __future__ import annotations

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.core.outputs import NewRequestData
from tinyvllm.models.registry import resolve_architecture, supported_architectures
from tinyvllm.runner.input_batch import InputBatch
from tinyvllm.runner.model_states import (
    DefaultModelState,
    ModelInputs,
    ModelState,
    model_state_class,
)


class RecordingState(DefaultModelState):
    """The default state, noting every hook call."""

    def __init__(self, inner: ModelState) -> None:
        super().__init__(inner.model, inner.max_num_reqs, inner.device)
        self.calls: list[tuple[str, object]] = []

    def add_request(self, row: int, new: NewRequestData) -> None:
        self.calls.append(("add", (row, new.req_id)))

    def remove_request(self, row: int) -> None:
        self.calls.append(("remove", row))

    def model_inputs(self, batch: InputBatch) -> ModelInputs:
        self.calls.append(("inputs", batch.attn_metadata.num_actual_tokens))
        return super().model_inputs(batch)

    def pre_forward(self, batch: InputBatch, inputs: ModelInputs) -> None:
        self.calls.append(("pre", inputs.attn_metadata.num_actual_tokens))

    def post_forward(self, batch: InputBatch, hidden: torch.Tensor) -> None:
        self.calls.append(("post", hidden.shape[0]))


class ZeroPositionsState(DefaultModelState):
    """Every token at rotary position 0: what a wrong position mapping would do."""

    def model_inputs(self, batch: InputBatch) -> ModelInputs:
        inputs = super().model_inputs(batch)
        inputs.positions = torch.zeros_like(inputs.positions)
        return inputs


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128)


def test_registry_state_kind_selects_the_state(llm: LLM) -> None:
    for arch in supported_architectures():
        kind = resolve_architecture(type("C", (), {"architectures": [arch]}))[1].state_kind
        assert issubclass(model_state_class(kind), ModelState)
    assert type(llm.engine.runner.model_state) is model_state_class("default") is DefaultModelState
    with pytest.raises(ValueError, match=r"kind 'mamba_x'.*known kinds: default"):
        model_state_class("mamba_x")


def test_default_dummy_inputs_have_one_position_per_token() -> None:
    state = DefaultModelState(torch.nn.Identity(), 4, torch.device("cpu"))
    metadata = AttentionMetadata(
        num_reqs=1,
        num_actual_tokens=5,
        query_start_loc=torch.tensor([0, 5]),
        seq_lens=torch.tensor([5]),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.arange(5),
        max_query_len=5,
        max_seq_len=5,
        query_start_loc_cpu=[0, 5],
        seq_lens_cpu=[5],
        block_size=16,
    )
    inputs = state.dummy_inputs(metadata)
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4] and inputs.input_ids.shape == (5,)
    assert inputs.attn_metadata is metadata


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 4) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_runner_goes_through_the_model_state_hooks(llm: LLM) -> None:
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23]]
    expected = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
    llm.engine.step()  # the runner drops the finished rows before the recording starts
    runner = llm.engine.runner
    default = runner.model_state
    recording = RecordingState(default)
    runner.model_state = recording
    try:
        outs = _generate(llm, prompts)
        llm.engine.step()  # the runner drops the finished rows
    finally:
        runner.model_state = default
    assert [o.outputs[0].token_ids for o in outs] == expected
    calls = recording.calls
    added = [c for kind, c in calls if kind == "add"]
    assert sorted(req_id for _, req_id in added) == sorted(f"{o.request_id}#0" for o in outs)
    assert sorted(c for kind, c in calls if kind == "remove") == sorted(row for row, _ in added)
    # One prefill step of 5 + 3 tokens, then three decode steps of one token per request.
    steps = [c for kind, c in calls if kind == "inputs"]
    assert steps == [8, 2, 2, 2]
    assert [c for kind, c in calls if kind == "pre"] == steps
    assert [c for kind, c in calls if kind == "post"] == steps


def test_positions_come_from_the_model_state(llm: LLM) -> None:
    prompt = [[31, 32, 33, 34, 35, 36]]
    expected = _generate(llm, prompt, max_tokens=1)[0].outputs[0].logprobs
    runner = llm.engine.runner
    default = runner.model_state
    runner.model_state = ZeroPositionsState(default.model, default.max_num_reqs, default.device)
    try:
        got = _generate(llm, prompt, max_tokens=1)[0].outputs[0].logprobs
    finally:
        runner.model_state = default
    token = next(iter(expected[0]))
    assert got[0].get(token) is None or got[0][token].logprob != expected[0][token].logprob


class FailingAddState(RecordingState):
    """Refuses requests whose first prompt token is 99, after taking part of them."""

    def add_request(self, row: int, new: NewRequestData) -> None:
        super().add_request(row, new)
        if new.prompt_token_ids[0] == 99:
            raise ValueError("this state cannot hold that request")


def test_a_model_state_that_refuses_a_request_fails_it_alone(llm: LLM) -> None:
    prompts = [[11, 12, 13], [99, 12, 13]]
    expected = _generate(llm, prompts[:1])[0].outputs[0].token_ids
    llm.engine.step()
    runner = llm.engine.runner
    default = runner.model_state
    failing = FailingAddState(default)
    runner.model_state = failing
    try:
        good, bad = _generate(llm, prompts)
        llm.engine.step()
    finally:
        runner.model_state = default
    assert good.outputs[0].token_ids == expected
    assert bad.outputs[0].finish_reason == "error"
    # The refused request's row was handed back to the state as well as to the runner's rows.
    added = dict((req_id, row) for kind, c in failing.calls if kind == "add" for row, req_id in [c])
    removed = [c for kind, c in failing.calls if kind == "remove"]
    assert sorted(removed) == sorted(added.values())
    assert not runner.states.req_id_to_row
