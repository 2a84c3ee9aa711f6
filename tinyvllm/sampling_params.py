"""Per-request sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Below this temperature a request is sampled greedily (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# Temperatures in (0, _MIN_TEMP) overflow softmax(logits / t) to inf/nan in half precision, so
# they are raised to this floor, as vLLM does.
_MIN_TEMP = 1e-2


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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(
                f"repetition_penalty must be a finite number greater than 0, "
                f"got {self.repetition_penalty}"
            )
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
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
        bad_ids = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad_ids:
            raise ValueError(
                f"stop_token_ids must contain only non-negative integers, got {bad_ids}"
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
