"""Top-k routed experts: a linear router, softmax over each token's k best logits, SiLU-gated
expert MLPs whose weights are stored stacked ([experts, out, in], as GraniteMoe checkpoints
keep them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.models.layers.linear import new_parameter


class TopKRouter(nn.Module):
    """Router logits in float32; the k best experts per token, their weights the softmax over
    those k logits only (renormalised), in the activation dtype."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={num_experts}"
            )
        self.top_k = top_k
        self.weight = new_parameter(num_experts, hidden_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], expert ids [T, k])."""
        logits = F.linear(x, self.weight).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1).to(x.dtype), top_ids


class StackedExperts(nn.Module):
    """`num_experts` SiLU-gated MLPs: input_linear [E, 2I, H] ([gate | up] rows per expert),
    output_linear [E, H, I]. Each expert runs once on the tokens routed to it."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.input_linear = nn.Module()
        self.input_linear.weight = new_parameter(num_experts, 2 * intermediate_size, hidden_size)
        self.output_linear = nn.Module()
        self.output_linear.weight = new_parameter(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights / ids [T, k] -> sum over each token's k experts of weight * MLP."""
        out = torch.zeros_like(x)
        # One host read per layer of which experts are hit, instead of one per expert.
        for expert in torch.unique(ids).tolist():
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.input_linear.weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[expert])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out
