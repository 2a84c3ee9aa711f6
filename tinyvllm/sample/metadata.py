"""Per-step sampling inputs, gathered by the model runner from its persistent request rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Temperatures below this are greedy; dividing by them would overflow.
SAMPLING_EPS = 1e-5

_MIX_A = 0x9E3779B97F4A7C15
_MIX_B = 0xBF58476D1CE4E5B9


def step_seed(seed: int, output_index: int) -> int:
    """A request's seed for its `output_index`-th token.

    Seeding by position (instead of carrying one generator along) keeps a seeded request's
    samples identical whatever it is batched with, and across preemption and recompute.
    """
    return (seed * _MIX_A + (output_index + 1) * _MIX_B) & (2**63 - 1)


@dataclass
class SamplingMetadata:
    """Sampling parameters for the B rows of one step's logits, one entry per row.

    Optional tensors are None when no row in the batch uses the feature, so the sampler can
    skip whole passes over the vocabulary. Every tensor lives on the logits' device.

    - `temperature`: [B] float32; below `SAMPLING_EPS` means greedy for that row.
    - `all_greedy` / `all_random`: whether every row is greedy / every row samples.
    - `top_k`: [B] int; `<= 0` or `>= vocab_size` disables it for that row.
    - `top_p`: [B] float32; `1.0` disables. `min_p`: [B] float32; `0.0` disables.
    - `repetition_penalty`: [B] float32; `1.0` disables. Applies to prompt and output tokens
      (HF semantics: positive logits are divided by it, negative ones multiplied).
    - `presence_penalty`, `frequency_penalty`: [B] float32; `0.0` disables. Output tokens only;
      frequency scales with how often the token was generated.
    - `prompt_token_ids`: [B, P] int64 padded with `vocab_size`; needed only for repetition.
    - `output_token_ids`: [B, O] int64 padded with `vocab_size`; needed for any penalty.
    - `generators`: row -> the request's own generator (seeded requests). Only rows that
      sample randomly need one; a greedy row's generator is never read.
    - `default_generator`: the noise source of all other random rows (the engine's seed).
    - `max_num_logprobs`: None when no row wants logprobs; else the largest top-N over rows
      (0 = the sampled token only). The runner slices each row's top-N out of the result.
    - `min_tokens_mask`: (row, token ids to forbid) for rows still below `min_tokens`.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    default_generator: torch.Generator | None = None
    max_num_logprobs: int | None = None
    min_tokens_mask: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def no_penalties(self) -> bool:
        return (
            self.repetition_penalty is None
            and self.presence_penalty is None
            and self.frequency_penalty is None
        )
