"""Speculative decoding config (vLLM's `speculative_config` dict) and the per-step K choice."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

METHODS = ("ngram", "draft_model")
_RANGE = re.compile(r"^\s*(\d+)\s*(?:(-)\s*(\d+)|(\+))?\s*$")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SpeculativeConfig:
    """How to speculate; keys and defaults follow vLLM's `speculative_config`.

    - `method`: "ngram" (prompt lookup, no extra model) or "draft_model" (needs `model`).
    - `num_speculative_tokens`: K, the most draft tokens per request and step (>= 1).
    - `prompt_lookup_min` / `prompt_lookup_max`: n-gram sizes tried (ngram only). As in vLLM,
      both default to 5, and one given alone sets the other.
    - `num_speculative_tokens_per_batch_size`: optional {"lo-hi": K} table; keys are "lo-hi",
      "n" or "lo+" (open-ended, last only). The ranges must cover 1.. without gaps or overlaps;
      batch sizes past the last range use its K. Values lie in [0, num_speculative_tokens].
    - `disable_by_batch_size`: optional; batch sizes larger than it speculate with K = 0.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_speculative_tokens_per_batch_size: Mapping[str | int, int] | None = None
    disable_by_batch_size: int | None = None
    # (lo, hi or None for open-ended, K) sorted by lo; parsed from the table above.
    batch_size_table: tuple[tuple[int, int | None, int], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {METHODS}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config method 'draft_model' needs 'model' (the draft model's "
                    "path or hub id)"
                )
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("prompt_lookup_min/max are only used by method 'ngram'")
        else:
            if self.model is not None:
                raise ValueError(
                    f"method 'ngram' uses no draft model, got model={self.model!r}; "
                    "use method 'draft_model' to speculate with one"
                )
            self._resolve_lookup()
        if self.disable_by_batch_size is not None and (
            not _is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 1
        ):
            raise ValueError(
                f"disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}"
            )
        table = self.num_speculative_tokens_per_batch_size
        self.batch_size_table = () if table is None else _parse_table(table, k)

    def _resolve_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        assert low is not None and high is not None
        if low > high:
            raise ValueError(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Build from vLLM's dict form; unknown keys are errors that list the known ones.

        As in vLLM, `method` may be left out: model "ngram" / "[ngram]" means the n-gram method
        and any other model means "draft_model".
        """
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f for f in cls.__dataclass_fields__ if f != "batch_size_table"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {unknown}; known keys: {sorted(known)}"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        values = dict(config)
        model, method = values.get("model"), values.get("method")
        if model in ("ngram", "[ngram]") and method in (None, "ngram"):
            values["model"], values["method"] = None, "ngram"
        elif method is None:
            if model is None:
                raise ValueError(f"speculative_config needs 'method', one of {METHODS}")
            values["method"] = "draft_model"
        return cls(**values)

    def k_for_batch_size(self, batch_size: int) -> int:
        """The table's K for this many requests (num_speculative_tokens without a table)."""
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return 0
        k = self.num_speculative_tokens
        for low, _, table_k in self.batch_size_table:
            if batch_size < low:
                break
            k = table_k
        return k


_Table = tuple[tuple[int, int | None, int], ...]


def _parse_table(table: Mapping[str | int, int], limit: int) -> _Table:
    name = "num_speculative_tokens_per_batch_size"
    if not isinstance(table, Mapping) or not table:
        raise ValueError(f"{name} must be a non-empty dict like {{'1-8': 4, '9-32': 2}}")
    ranges: list[tuple[int, int | None, int, str]] = []
    for key, k in table.items():
        match = _RANGE.match(str(key))
        if match is None:
            raise ValueError(
                f"{name} key {key!r} is not a batch-size range; use 'lo-hi', 'n' or 'lo+'"
            )
        low = int(match.group(1))
        high = None if match.group(4) else int(match.group(3) or low)
        if low < 1 or (high is not None and high < low):
            raise ValueError(f"{name} key {key!r}: need 1 <= lo <= hi")
        if not _is_int(k) or not 0 <= k <= limit:
            raise ValueError(
                f"{name}[{key!r}] = {k!r} must be an integer in [0, num_speculative_tokens={limit}]"
            )
        ranges.append((low, high, k, str(key)))
    ranges.sort(key=lambda r: r[0])
    if ranges[0][0] != 1:
        raise ValueError(f"{name} must start at batch size 1, first range is {ranges[0][3]!r}")
    for (_, high, _, key), (low, _, _, next_key) in pairwise(ranges):
        if high is None or low <= high:
            raise ValueError(f"{name} ranges {key!r} and {next_key!r} overlap")
        if low > high + 1:
            raise ValueError(
                f"{name} has a gap: batch sizes {high + 1}..{low - 1} are in no range "
                f"(between {key!r} and {next_key!r})"
            )
    return tuple((low, high, k) for low, high, k, _ in ranges)


class KController:
    """Chooses each step's K from the batch-size table and the observed acceptance rate.

    Model: each draft is accepted with probability a (an EMA of observed per-draft acceptance)
    until the first rejection, so verifying K drafts yields sum_{i<=K} a^i tokens for a cost of
    1 + token_cost * K decode steps. The K in `allowed_k` (at most the table's K) with the most
    tokens per cost wins; K = 1 beats 0 only while a > token_cost. At K = 0 nothing is drafted and
    nothing observed, so every `probe_interval` such steps one step uses the smallest positive
    allowed K to re-measure.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        allowed_k: Sequence[int] | None = None,
        *,
        token_cost: float = 0.1,
        ema_decay: float = 0.8,
        initial_acceptance: float = 0.7,
        probe_interval: int = 16,
    ) -> None:
        k = config.num_speculative_tokens
        allowed = tuple(range(k + 1)) if allowed_k is None else tuple(sorted(set(allowed_k)))
        if not allowed or any(not _is_int(v) or not 0 <= v <= k for v in allowed):
            raise ValueError(f"allowed_k must be non-empty values in [0, {k}], got {allowed_k!r}")
        if token_cost < 0:
            raise ValueError(f"token_cost must be >= 0, got {token_cost}")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if not 0 <= initial_acceptance <= 1:
            raise ValueError(f"initial_acceptance must be in [0, 1], got {initial_acceptance}")
        if probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {probe_interval}")
        self.config = config
        self.allowed_k = allowed
        self.token_cost = token_cost
        self.ema_decay = ema_decay
        self.probe_interval = probe_interval
        self._acceptance = initial_acceptance
        self._idle_steps = 0
        # Measured seconds per step for each K (EMA); once K and 0 both have a measurement,
        # their ratio replaces the `token_cost` guess (a K + 1 row verify costs far more
        # than 1 + 0.1 K plain steps on a CPU whose kernels are compute-bound at small M).
        # Keyed by (K, batch-size bucket): a step's cost depends on both.
        self._step_time: dict[tuple[int, int], float] = {}
        self._bucket = 1

    @property
    def acceptance_rate(self) -> float:
        """Current estimate of the probability that a verified draft is accepted."""
        return self._acceptance

    def expected_tokens_per_cost(self, k: int) -> float:
        a = self._acceptance
        return sum(a**i for i in range(k + 1)) / self.relative_cost(k)

    def relative_cost(self, k: int) -> float:
        """Cost of a step with K drafts relative to a plain step: measured when possible."""
        plain = self._step_time.get((0, self._bucket))
        if k == 0 or not plain:
            return 1.0 + self.token_cost * k
        with_k = self._step_time.get((k, self._bucket))
        if with_k is not None:
            return with_k / plain
        # Unmeasured K: extrapolate the per-draft cost of the nearest measured K linearly.
        measured = [m for m, b in self._step_time if b == self._bucket and m > 0]
        if not measured:
            return 1.0 + self.token_cost * k
        near = min(measured, key=lambda m: abs(m - k))
        per_draft = max(self._step_time[(near, self._bucket)] / plain - 1.0, 0.0) / near
        return 1.0 + per_draft * k

    def observe_step_time(self, k: int, batch_size: int, seconds: float) -> None:
        """Feed the wall time of one step that verified drafts chosen with this K."""
        key = (k, _size_bucket(batch_size))
        old = self._step_time.get(key)
        if seconds <= 0 or (old is not None and seconds > 10 * old):
            return  # idle time between requests is not a step's cost
        self._step_time[key] = (
            seconds if old is None else self.ema_decay * old + (1 - self.ema_decay) * seconds
        )

    def choose_k(self, batch_size: int) -> int:
        cap = self.config.k_for_batch_size(batch_size)
        candidates = [k for k in self.allowed_k if k <= cap]
        if not candidates:
            return self.allowed_k[0]  # nothing small enough: the smallest bucket
        self._bucket = _size_bucket(batch_size)
        measured = {k for k, bucket in self._step_time if bucket == self._bucket}
        if 0 in candidates and measured and 0 not in measured:
            return 0  # measure a plain step once, so costs can be compared
        # Ties go to the smaller K: same gain for less work.
        best = max(candidates, key=lambda k: (self.expected_tokens_per_cost(k), -k))
        positive = [k for k in candidates if k > 0]
        if best > 0 or not positive:
            self._idle_steps = 0
            return best
        self._idle_steps += 1
        if self._idle_steps >= self.probe_interval:
            self._idle_steps = 0
            return positive[0]
        return best

    def observe(self, num_drafted: int, num_accepted: int, num_rejected: int | None = None) -> None:
        """Feed one step's totals over all requests.

        `num_rejected` (requests whose drafts hit a rejection) makes the estimate unbiased:
        drafts after a rejection are never judged, so accepted / (accepted + rejected) is the
        per-draft rate. Without it accepted / drafted is used, which reads low when K > 1.
        """
        if num_drafted <= 0:
            return
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"num_accepted={num_accepted} must lie in [0, {num_drafted}]")
        judged = num_drafted if num_rejected is None else num_accepted + num_rejected
        if judged <= 0:
            return
        rate = num_accepted / judged
        self._acceptance = self.ema_decay * self._acceptance + (1.0 - self.ema_decay) * rate


def _size_bucket(batch_size: int) -> int:
    """Powers of two: step costs are compared between batches of similar size."""
    return 1 << max(batch_size - 1, 0).bit_length()
