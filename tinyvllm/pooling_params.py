"""Per-request parameters of pooling (embedding) models, with vLLM's names."""

from __future__ import annotations

import copy
from dataclasses import dataclass

# "embed": one vector per prompt (the model's pooling); "token_embed": every token's hidden
# state (LLM.encode).
POOLING_TASKS = ("embed", "token_embed")


@dataclass
class PoolingParams:
    """How to pool one request.

    `truncate_prompt_tokens`: None keeps the prompt whole (a prompt longer than the model's
    max_model_len is an error), k keeps k tokens (text is truncated by the tokenizer on its
    truncation side with the special tokens kept, as sentence-transformers does; token ids
    keep the last k, as vLLM does), -1 means k = max_model_len (as does any larger k).
    `normalize`: L2-normalize the output; None takes the model's pooler config.
    `task`: "embed" (one vector) or "token_embed" (every token's hidden state); None means
    "embed".
    """

    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < -1 or k == 0):
            raise ValueError(
                f"truncate_prompt_tokens must be a positive int, -1 (the model's maximum) or "
                f"None, got {k!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True, False or None, got {self.normalize!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(
                f"pooling task {self.task!r} is not supported; choose one of "
                f"{', '.join(POOLING_TASKS)}"
            )

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)
