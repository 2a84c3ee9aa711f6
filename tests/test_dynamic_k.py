"""SpeculativeConfig validation and table lookup; KController shrinking, probing, buckets."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest

from tinyvllm.spec_decode import KController, SpeculativeConfig

TABLE = {"1-8": 4, "9-32": 2, "33-256": 0}


def config(**kwargs: Any) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, **kwargs})


def test_defaults_follow_vllm() -> None:
    cfg = config()
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert (
        config(prompt_lookup_max=3).prompt_lookup_min,
        config(prompt_lookup_min=2).prompt_lookup_max,
    ) == (3, 2)
    assert (
        SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).method
        == "ngram"
    )
    draft = SpeculativeConfig.from_dict({"model": "some/draft", "num_speculative_tokens": 3})
    assert draft.method == "draft_model" and draft.model == "some/draft"
    assert SpeculativeConfig.from_dict(cfg) is cfg


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"method": "medusa"}, r"method must be one of \('ngram', 'draft_model'\), got 'medusa'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
        ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
        ({"method": "draft_model"}, "'draft_model' needs 'model'"),
        ({"model": "x/y"}, "method 'ngram' uses no draft model"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= "),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
        (
            {"num_speculative_tokens_per_batch_size": {"1-8": 5}},
            r"\['1-8'\] = 5 must be .*\[0, num_speculative_tokens=4\]",
        ),
        (
            {"num_speculative_tokens_per_batch_size": {"1-8": 2, "5-9": 1}},
            "ranges '1-8' and '5-9' overlap",
        ),
        (
            {"num_speculative_tokens_per_batch_size": {"1-8": 2, "10-12": 1}},
            r"gap: batch sizes 9\.\.9",
        ),
        ({"num_speculative_tokens_per_batch_size": {"2-8": 2}}, "must start at batch size 1"),
        (
            {"num_speculative_tokens_per_batch_size": {"1-x": 2}},
            "key '1-x' is not a batch-size range",
        ),
        ({"num_speculative_tokens_per_batch_size": {"8-1": 2}}, "need 1 <= lo <= hi"),
        ({"num_speculative_tokens_per_batch_size": {"1+": 2, "9-10": 1}}, "overlap"),
        ({"num_speculative_tokens_per_batch_size": {}}, "must be a non-empty dict"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be an integer >= 1"),
        ({"num_lookahead": 3}, r"unknown speculative_config keys \['num_lookahead'\]; known keys"),
    ],
)
def test_config_errors_name_the_problem(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**values)


def test_config_needs_method_or_model_and_k() -> None:
    with pytest.raises(ValueError, match="needs 'method'"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="needs 'num_speculative_tokens'"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(TypeError, match="must be a dict"):
        SpeculativeConfig.from_dict([("method", "ngram")])  # type: ignore[arg-type]


def test_table_lookup() -> None:
    cfg = config(num_speculative_tokens_per_batch_size=TABLE)
    assert cfg.batch_size_table == ((1, 8, 4), (9, 32, 2), (33, 256, 0))
    got = {b: cfg.k_for_batch_size(b) for b in (1, 8, 9, 32, 33, 256, 1000)}
    assert got == {1: 4, 8: 4, 9: 2, 32: 2, 33: 0, 256: 0, 1000: 0}
    assert config().k_for_batch_size(500) == 4  # no table: always K
    open_ended = config(num_speculative_tokens_per_batch_size={"1": 4, "2-3": 3, 4: 2, "5+": 1})
    assert [open_ended.k_for_batch_size(b) for b in (1, 2, 3, 4, 5, 99)] == [4, 3, 3, 2, 1, 1]
    assert config(disable_by_batch_size=16).k_for_batch_size(16) == 4
    assert config(disable_by_batch_size=16).k_for_batch_size(17) == 0


def run_steps(ctrl: KController, steps: int, acceptance: float, batch: int = 4) -> list[int]:
    """Deterministic feedback: a fraction `acceptance` of each step's drafts is accepted."""
    ks = []
    for _ in range(steps):
        k = ctrl.choose_k(batch)
        ks.append(k)
        drafted = k * batch
        accepted = round(acceptance * drafted)
        ctrl.observe(drafted, accepted)
    return ks


def test_high_acceptance_keeps_full_k() -> None:
    ctrl = KController(config())
    assert run_steps(ctrl, 20, acceptance=0.95)[-1] == 4
    assert ctrl.acceptance_rate > 0.9


def test_k_shrinks_to_zero_then_probes_and_recovers() -> None:
    ctrl = KController(config(), probe_interval=5)
    ks = run_steps(ctrl, 30, acceptance=0.02)
    assert ks[0] == 4 and 0 in ks
    first_zero = ks.index(0)
    assert all(a >= b for a, b in pairwise(ks[: first_zero + 1]))
    # While drafts keep failing, every fifth step at K = 0 is a K = 1 probe.
    tail = ks[first_zero:]
    assert set(tail) == {0, 1}
    assert all(tail[i] == 1 for i in range(len(tail)) if (i + 1) % 5 == 0)
    # Once drafts succeed again, a probe brings K back up.
    after = run_steps(ctrl, 12, acceptance=1.0)
    assert after[-1] == 4
    assert after.index(1) < 5


def test_partial_acceptance_picks_intermediate_k() -> None:
    ctrl = KController(config(), token_cost=0.3)
    ks = run_steps(ctrl, 30, acceptance=0.5)
    assert 0 < ks[-1] < 4  # worth some speculation, not the most
    assert ctrl.expected_tokens_per_cost(ks[-1]) >= max(
        ctrl.expected_tokens_per_cost(k) for k in range(5)
    )


def test_choices_stay_in_allowed_k_and_under_the_table() -> None:
    cfg = config(num_speculative_tokens_per_batch_size=TABLE)
    allowed = (0, 1, 3)
    ctrl = KController(cfg, allowed_k=allowed, probe_interval=3)
    for acceptance in (0.9, 0.0, 0.6, 1.0):
        for batch in (1, 8, 9, 20, 40):
            ks = run_steps(ctrl, 8, acceptance, batch=batch)
            assert set(ks) <= set(allowed)
            assert max(ks) <= cfg.k_for_batch_size(batch)
    # Large batches never probe: the table said 0.
    assert set(run_steps(ctrl, 10, 1.0, batch=100)) == {0}
    # A bucket set without anything under the table's K falls back to the smallest bucket.
    assert KController(cfg, allowed_k=(2, 4)).choose_k(9) == 2
    assert KController(cfg, allowed_k=(2, 4)).choose_k(100) == 2


def test_observe_estimates_per_draft_acceptance() -> None:
    ctrl = KController(config(), ema_decay=0.0)
    # 4 requests drafted 4 each; 2 accepted all, 2 accepted 1 then were rejected: a = 10 / 12.
    ctrl.observe(16, 10, num_rejected=2)
    assert ctrl.acceptance_rate == pytest.approx(10 / 12)
    ctrl.observe(16, 10)
    assert ctrl.acceptance_rate == pytest.approx(10 / 16)
    ctrl.observe(0, 0)  # nothing drafted: nothing learned
    assert ctrl.acceptance_rate == pytest.approx(10 / 16)
    with pytest.raises(ValueError, match="num_accepted=5 must lie in"):
        ctrl.observe(4, 5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allowed_k": (0, 5)}, r"allowed_k must be non-empty values in \[0, 4\]"),
        ({"allowed_k": ()}, "allowed_k must be non-empty"),
        ({"token_cost": -1.0}, "token_cost must be >= 0"),
        ({"ema_decay": 1.0}, r"ema_decay must be in \[0, 1\)"),
        ({"initial_acceptance": 2.0}, "initial_acceptance"),
        ({"probe_interval": 0}, "probe_interval must be >= 1"),
    ],
)
def test_controller_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KController(config(), **kwargs)


def test_measured_step_cost_turns_unprofitable_speculation_off() -> None:
    """61% acceptance looks worth K=4 under the default cost guess, but if a K=4 step takes
    3.2x a plain step (a CPU verifying 4 rows), speculation must stop."""
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    ctl = KController(config, initial_acceptance=0.61, ema_decay=0.5)
    k = ctl.choose_k(1)
    assert k > 0
    ctl.observe_step_time(k, 1, 0.160)
    assert ctl.choose_k(1) == 0  # a plain step gets measured once
    ctl.observe_step_time(0, 1, 0.050)
    assert ctl.relative_cost(k) == pytest.approx(3.2)
    assert ctl.choose_k(1) == 0
    # Cheap verification (a GPU) keeps speculating at the same acceptance.
    gpu = KController(config, initial_acceptance=0.61, ema_decay=0.5)
    k = gpu.choose_k(1)
    gpu.observe_step_time(k, 1, 0.011)
    gpu.choose_k(1)
    gpu.observe_step_time(0, 1, 0.010)
    assert gpu.choose_k(1) >= k > 0
    # Idle gaps between requests are ignored.
    gpu.observe_step_time(k, 1, 5.0)
    assert gpu.relative_cost(k) == pytest.approx(1.1)
