"""Model states: what the runner does differently per model kind (see `interface.py`).

`state_kind` (from the model registry) -> the ModelState class: "default" (1-D rope text
models), "mrope" (Qwen-VL: M-RoPE positions, vision encoder outputs merged into the
embeddings; with video_pruning_rate > 0 the EVS pruning state), "gemma3_mm" (Gemma 3 VLM:
1-D positions, image embeddings merged, bidirectional image spans), "mamba_hybrid" (recurrent
state slots), "realtime" (Voxtral Realtime: streaming audio embeddings added to every
position, prompt and decode).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tinyvllm.runner.model_states.default import DefaultModelState
from tinyvllm.runner.model_states.interface import ModelInputs, ModelState

if TYPE_CHECKING:
    from tinyvllm.runner.model_states.gemma3_mm import Gemma3MMModelState
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

# kind -> (module, class), imported when a model of that kind loads: the vision, audio and
# recurrent states import their models' code (~20 ms of every text model's start).
_KINDS = MappingProxyType(
    {
        "default": ("default", "DefaultModelState"),
        "gemma3_mm": ("gemma3_mm", "Gemma3MMModelState"),
        "mamba_hybrid": ("mamba_hybrid", "MambaHybridModelState"),
        "mrope": ("mrope", "MRopeModelState"),
        "realtime": ("realtime", "RealtimeModelState"),
    }
)
# class -> module, for `from tinyvllm.runner.model_states import MRopeModelState`.
_MODULES = MappingProxyType(
    {name: module for module, name in _KINDS.values()} | {"VideoPruningModelState": "video_pruning"}
)


def _load(module: str, name: str) -> type[ModelState]:
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __getattr__(name: str) -> Any:
    """The states other than the default one, imported on first use."""
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _load(_MODULES[name], name)


def model_state_class(state_kind: str) -> type[ModelState]:
    """The ModelState for a registry `state_kind`; ValueError naming the known kinds."""
    entry = _KINDS.get(state_kind)
    if entry is None:
        raise ValueError(
            f"unknown model state kind {state_kind!r} (from the model registry); known kinds: "
            f"{', '.join(sorted(_KINDS))}"
        )
    return _load(*entry)


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
    if state_kind == "mrope" and video_pruning_rate > 0:
        pruning = _load("video_pruning", "VideoPruningModelState")
        return pruning(model, max_num_reqs, device, video_pruning_rate)  # type: ignore[call-arg]
    return cls(model, max_num_reqs, device)
