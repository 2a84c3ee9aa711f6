"""Per-request sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import copy
import enum
import logging
import math
import numbers
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Below this temperature a request is sampled greedily (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# Temperatures in (0, _MIN_TEMP) overflow softmax(logits / t) to inf/nan in half precision, so
# they are raised to this floor, as vLLM does.
_MIN_TEMP = 1e-2
# The model runner keeps per-request values in float32 and int64 tensor columns
# (runner/states.py); a value outside these ranges would overflow them in the middle of a step.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
INT64_MAX = 2**63 - 1


class RequestOutputKind(enum.Enum):
    """What each streamed `RequestOutput` carries."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    """How to sample one request; the fields and their defaults follow vLLM.

    `top_k` 0 (or -1, normalised to 0) disables top-k; `max_tokens=None` generates until
    `max_model_len`. Invalid values raise `ValueError` naming the field, the value and the
    allowed range. A greedy request (temperature ~ 0) has top_p/top_k/min_p reset to their
    neutral values, so the sampler can treat it as a plain argmax.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    # Kept for vLLM compatibility; transformers 5 fast tokenizers ignore it when decoding.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self._normalise()
        self._verify()
        if 0.0 < self.temperature < _MIN_TEMP:
            logger.warning(
                "temperature %s is below %s, which overflows the softmax; using %s instead",
                self.temperature,
                _MIN_TEMP,
                _MIN_TEMP,
            )
            self.temperature = _MIN_TEMP
        if self.is_greedy:
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                # n greedy samples would be n copies of the same text.
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        # Dedupe but keep the caller's order: it is visible in error messages and reprs.
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        # vLLM accepts logprobs=True as "the sampled token only".
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1

    def _verify(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        self._verify_floats()
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if self.top_k > INT64_MAX:
            raise ValueError(
                f"top_k must be at most 2**63 - 1 (int64); use 0 to disable it, got {self.top_k}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < 0:
                    raise ValueError(f"{name} must be non-negative, got {value}")
        assert isinstance(self.stop, list) and isinstance(self.stop_token_ids, list)
        bad_ids = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t <= INT64_MAX]
        if bad_ids:
            raise ValueError(
                f"stop_token_ids must contain only integers in [0, 2**63 - 1] (int64), "
                f"got {bad_ids}"
            )
        bad_stops = [s for s in self.stop if not isinstance(s, str) or not s]
        if bad_stops:
            raise ValueError(f"stop must contain only non-empty strings, got {bad_stops!r}")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings need detokenize=True, got stop={self.stop!r} with detokenize=False"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind must be a RequestOutputKind "
                f"({', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}"
            )

    def _verify_floats(self) -> None:
        """The float fields, which the runner stores as float32 columns."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        penalty = _check_real("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(penalty) and penalty > 0.0):
            raise ValueError(
                f"repetition_penalty must be a finite number greater than 0, got {penalty}"
            )
        if not FLOAT32_MIN_NORMAL <= penalty <= FLOAT32_MAX:
            raise ValueError(
                f"repetition_penalty must be in [{FLOAT32_MIN_NORMAL:.4g}, {FLOAT32_MAX:.4g}] "
                f"(the float32 range the sampler uses), got {penalty}"
            )
        temperature = _check_real("temperature", self.temperature)
        if not math.isfinite(temperature):
            raise ValueError(f"temperature must be a finite number, got {temperature}")
        if temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {temperature}")
        if temperature > FLOAT32_MAX:
            raise ValueError(
                f"temperature must be at most {FLOAT32_MAX:.4g} (the float32 range the sampler "
                f"uses), got {temperature}"
            )
        if not 0.0 < _check_real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= _check_real("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without stop strings)."""
        assert isinstance(self.stop, list)
        return max((len(s) for s in self.stop), default=0)

    def stop_ids(self, eos_token_id: int | None) -> set[int]:
        """Token ids that finish the request: `stop_token_ids`, plus EOS unless ignore_eos."""
        assert isinstance(self.stop_token_ids, list)
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return ids

    def clone(self) -> SamplingParams:
        """A deep copy, so the engine can fill per-request state without touching the caller's."""
        return copy.deepcopy(self)


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `n=True` is almost certainly a bug in the caller.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_real(name: str, value: object) -> float:
    """`value` as a float; a non-number, or an int too large for a float, is a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"{name} must be at most {FLOAT32_MAX:.4g} (float32), got an integer of "
            f"{int(value).bit_length()} bits"
        ) from None
