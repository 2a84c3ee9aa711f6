"""Model states: what the runner does differently per model kind (see `interface.py`).

`state_kind` (from the model registry) -> the ModelState class: "default" (1-D rope text
models), "mrope" (Qwen-VL: M-RoPE positions, vision encoder outputs merged into the
embeddings; with video_pruning_rate > 0 the EVS pruning state), "gemma3_mm" (Gemma 3 VLM:
1-D positions, image embeddings merged, bidirectional image spans), "mamba_hybrid" (recurrent
state slots), "realtime" (Voxtral Realtime: streaming audio embeddings added to every
position, prompt and decode).
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

from tinyvllm.runner.model_states.default import DefaultModelState
from tinyvllm.runner.model_states.gemma3_mm import Gemma3MMModelState
from tinyvllm.runner.model_states.interface import ModelInputs, ModelState
from tinyvllm.runner.model_states.mamba_hybrid import MambaHybridModelState
from tinyvllm.runner.model_states.mrope import MRopeModelState
from tinyvllm.runner.model_states.realtime import RealtimeModelState
from tinyvllm.runner.model_states.video_pruning import VideoPruningModelState

__all__ = [
    "DefaultModelState",
    "Gemma3MMModelState",
    "MRopeModelState",
    "MambaHybridModelState",
    "ModelInputs",
    "ModelState",
    "RealtimeModelState",
    "VideoPruningModelState",
    "create_model_state",
    "model_state_class",
]

_KINDS = MappingProxyType(
    {
        "default": DefaultModelState,
        "gemma3_mm": Gemma3MMModelState,
        "mamba_hybrid": MambaHybridModelState,
        "mrope": MRopeModelState,
        "realtime": RealtimeModelState,
    }
)


def model_state_class(state_kind: str) -> type[ModelState]:
    """The ModelState for a registry `state_kind`; ValueError naming the known kinds."""
    cls = _KINDS.get(state_kind)
    if cls is None:
        raise ValueError(
            f"unknown model state kind {state_kind!r} (from the model registry); known kinds: "
            f"{', '.join(sorted(_KINDS))}"
        )
    return cls


def create_model_state(
    state_kind: str,
    model: nn.Module,
    max_num_reqs: int,
    device: torch.device,
    video_pruning_rate: float = 0.0,
) -> ModelState:
    """The runner's model state; an M-RoPE model with video_pruning_rate > 0 gets the EVS
    pruning state (rate 0 is exactly the plain M-RoPE state)."""
    cls = model_state_class(state_kind)
    if cls is MRopeModelState and video_pruning_rate > 0:
        return VideoPruningModelState(model, max_num_reqs, device, video_pruning_rate)
    return cls(model, max_num_reqs, device)
