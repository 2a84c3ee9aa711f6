from __future__ import annotations

from typing import Any

import pytest

from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (
        16,
        0,
        None,
        None,
        None,
    )
    assert p.stop == [] and p.stop_token_ids == []
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"n": 0}, ["n", "at least 1", "0"]),
        ({"temperature": -0.5}, ["temperature", "non-negative", "-0.5"]),
        ({"temperature": float("nan")}, ["temperature", "finite", "nan"]),
        ({"top_p": 1.5}, ["top_p", "(0, 1]", "1.5"]),
        ({"top_p": 0.0}, ["top_p", "(0, 1]", "0.0"]),
        ({"top_k": -2}, ["top_k", "at least 1", "-2"]),
        ({"top_k": 2.5}, ["top_k", "integer", "2.5"]),
        ({"min_p": 1.5}, ["min_p", "[0, 1]", "1.5"]),
        ({"presence_penalty": 2.5}, ["presence_penalty", "[-2, 2]", "2.5"]),
        ({"frequency_penalty": -3.0}, ["frequency_penalty", "[-2, 2]", "-3.0"]),
        ({"repetition_penalty": 0.0}, ["repetition_penalty", "greater than 0", "0.0"]),
        ({"max_tokens": 0}, ["max_tokens", "at least 1", "0"]),
        ({"min_tokens": -1}, ["min_tokens", "at least 0", "-1"]),
        ({"min_tokens": 20, "max_tokens": 10}, ["min_tokens", "max_tokens=10", "20"]),
        ({"logprobs": -1}, ["logprobs", "non-negative", "-1"]),
        ({"prompt_logprobs": -3}, ["prompt_logprobs", "non-negative", "-3"]),
        ({"stop": ["ok", ""]}, ["stop", "non-empty", "''"]),
        ({"stop": "x", "detokenize": False}, ["stop", "detokenize"]),
        ({"stop_token_ids": [1, -4]}, ["stop_token_ids", "-4"]),
        ({"seed": "abc"}, ["seed", "integer", "abc"]),
        ({"n": True}, ["n", "integer", "True"]),
        ({"temperature": 0.0, "n": 2}, ["n", "greedy", "2"]),
        ({"output_kind": "delta"}, ["output_kind", "DELTA", "delta"]),
        # Values the runner's float32 / int64 columns cannot hold.
        ({"temperature": 1e39}, ["temperature", "3.403e+38", "float32", "1e+39"]),
        ({"temperature": 10**400}, ["temperature", "3.403e+38", "1329 bits"]),
        ({"repetition_penalty": 1e39}, ["repetition_penalty", "3.403e+38", "1e+39"]),
        ({"repetition_penalty": 1e-46}, ["repetition_penalty", "1.175e-38", "1e-46"]),
        ({"top_k": 2**63}, ["top_k", "2**63 - 1", "int64", str(2**63)]),
        ({"stop_token_ids": [3, 2**70]}, ["stop_token_ids", "2**63 - 1", str(2**70)]),
        ({"temperature": "hot"}, ["temperature", "number", "'hot'"]),
        ({"top_p": None}, ["top_p", "number", "None"]),
        ({"presence_penalty": True}, ["presence_penalty", "number", "True"]),
    ],
)
def test_bad_values_name_field_value_and_range(
    kwargs: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_boundary_values_are_accepted() -> None:
    SamplingParams(top_p=1.0, min_p=0.0, presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(min_p=1.0, top_k=1, logprobs=0, prompt_logprobs=0, min_tokens=16)
    SamplingParams(max_tokens=None, min_tokens=1000)
    SamplingParams(temperature=3.4e38, repetition_penalty=1.2e-38, top_k=2**63 - 1)
    SamplingParams(repetition_penalty=3.4e38, stop_token_ids=[2**63 - 1], min_tokens=1)


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[5, 3, 5], top_k=-1, seed=-1, logprobs=True)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 3]
    assert p.top_k == 0
    assert p.seed is None
    assert p.logprobs == 1
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_greedy_resets_filters() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=20, min_p=0.3)
    assert p.is_greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    sampled = SamplingParams(temperature=0.7, top_p=0.5, top_k=20, min_p=0.3)
    assert not sampled.is_greedy
    assert (sampled.top_p, sampled.top_k, sampled.min_p) == (0.5, 20, 0.3)


def test_tiny_temperature_is_raised_to_the_floor() -> None:
    p = SamplingParams(temperature=1e-4)
    assert p.temperature == pytest.approx(1e-2)
    assert not p.is_greedy


def test_stop_ids_honour_ignore_eos() -> None:
    p = SamplingParams(stop_token_ids=[7, 9])
    assert p.stop_ids(2) == {2, 7, 9}
    assert p.stop_ids(None) == {7, 9}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).stop_ids(2) == {7}


def test_max_stop_len() -> None:
    assert SamplingParams().max_stop_len == 0
    assert SamplingParams(stop=["a", "abcd", "xy"]).max_stop_len == 4


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    q = p.clone()
    assert q == p
    q.stop.append("y")  # type: ignore[union-attr]
    q.stop_token_ids.append(2)  # type: ignore[union-attr]
    assert p.stop == ["x"] and p.stop_token_ids == [1]


def test_outputs_shapes_and_reprs() -> None:
    lp = Logprob(-0.5)
    assert lp.rank is None and lp.decoded_token is None
    done = CompletionOutput(0, "hi", [1, 2], -1.0, [{1: lp}, {2: Logprob(-0.1, 1, "i")}], "stop")
    running = CompletionOutput(1, "h", list(range(100)), None, None)
    assert done.finished() and not running.finished()
    assert "len=100" in repr(running)  # long id lists are abbreviated
    assert "<2 positions>" in repr(done)

    metrics = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=11.0,
        last_token_time=13.0,
        finished_time=13.5,
        num_generation_tokens=5,
    )
    assert metrics.ttft == pytest.approx(1.0)
    assert metrics.time_in_queue == pytest.approx(0.5)
    assert metrics.e2e_latency == pytest.approx(3.5)
    assert metrics.mean_tpot == pytest.approx(0.5)
    assert RequestMetrics(arrival_time=1.0).ttft is None

    out = RequestOutput("r1", "hello", [5, 6], None, [done], True, metrics)
    assert out.error is None and out.num_cached_tokens == 0
    assert "error" not in repr(out) and "'r1'" in repr(out)
    failed = RequestOutput(
        "r2",
        None,
        [5],
        None,
        [CompletionOutput(0, "", [], None, None, finish_reason="error")],
        True,
        error="prompt is longer than max_model_len",
    )
    assert "max_model_len" in repr(failed)
    assert failed.outputs[0].finish_reason == "error"
