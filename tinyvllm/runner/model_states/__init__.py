"""Model states: what the runner does differently per model kind (see `interface.py`).

`state_kind` (from the model registry) -> the ModelState class: "default" (text models),
"mamba_hybrid" (recurrent state slots). Kinds planned next: "mrope" (video / image VLMs),
"pooling" (encoder-only).
"""

from __future__ import annotations

from types import MappingProxyType

from tinyvllm.runner.model_states.default import DefaultModelState
from tinyvllm.runner.model_states.interface import ModelInputs, ModelState
from tinyvllm.runner.model_states.mamba_hybrid import MambaHybridModelState

__all__ = [
    "DefaultModelState",
    "MambaHybridModelState",
    "ModelInputs",
    "ModelState",
    "model_state_class",
]

_KINDS = MappingProxyType({"default": DefaultModelState, "mamba_hybrid": MambaHybridModelState})


def model_state_class(state_kind: str) -> type[ModelState]:
    """The ModelState for a registry `state_kind`; ValueError naming the known kinds."""
    cls = _KINDS.get(state_kind)
    if cls is None:
        raise ValueError(
            f"unknown model state kind {state_kind!r} (from the model registry); known kinds: "
            f"{', '.join(sorted(_KINDS))}"
        )
    return cls
