"""Streaming checkpoint tensors into a model's (possibly fused) parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tinyvllm.models.layers.linear import default_weight_loader

# (fragment of a checkpoint name, fragment of our fused parameter name, shard id)
StackedParam = tuple[str, str, str | int]

_MAX_LISTED = 8


def _shard_ids(model: nn.Module, param_name: str) -> set[str | int | None]:
    owner = model.get_submodule(param_name.rpartition(".")[0])
    return set(getattr(owner, "shard_ids", [None]))


def _checkpoint_name(
    param_name: str, shard_id: str | int | None, stacked_params: Sequence[StackedParam]
) -> str:
    for ckpt_fragment, param_fragment, stacked_shard in stacked_params:
        if shard_id == stacked_shard and param_fragment in param_name:
            return param_name.replace(param_fragment, ckpt_fragment)
    return param_name


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" (and {more} more)" if more > 0 else "")


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked_params: Sequence[StackedParam] = (),
    ignore: Callable[[str], bool] = lambda name: False,
    optional: Callable[[str], bool] = lambda name: False,
) -> list[str]:
    """Copy `(checkpoint name, tensor)` pairs into `model`'s parameters as they stream.

    A checkpoint name containing a `stacked_params` fragment goes to the fused parameter
    (with that shard id); any other name must equal a parameter name. Each parameter's
    `weight_loader` does the copy and the shape check. Raises ValueError naming the
    tensor for an unexpected or mis-shaped tensor, and listing what is missing at the end,
    except the parameters `optional` accepts (asked once every tensor is in): those missing
    are returned.
    """
    model_name = type(model).__name__
    params = dict(model.named_parameters())
    pending = {name: _shard_ids(model, name) for name in params}
    with torch.no_grad():
        for name, tensor in weights:
            if ignore(name):
                continue
            target, shard_id = name, None
            for ckpt_fragment, param_fragment, stacked_shard in stacked_params:
                if ckpt_fragment in name:
                    target = name.replace(ckpt_fragment, param_fragment)
                    shard_id = stacked_shard
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"unexpected tensor {name!r} in the checkpoint: {model_name} has no such "
                    "parameter (is the checkpoint for a different architecture, or quantized?)"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as exc:
                raise ValueError(
                    f"checkpoint tensor {name!r} does not fit {model_name} parameter "
                    f"{target!r}: {exc}"
                ) from None
            pending[target].discard(shard_id)
    skipped = [name for name, shard_ids in pending.items() if shard_ids and optional(name)]
    missing = [
        _checkpoint_name(name, shard_id, stacked_params)
        for name, shard_ids in pending.items()
        if name not in skipped
        for shard_id in sorted(shard_ids, key=str)
    ]
    if missing:
        raise ValueError(
            f"the checkpoint is missing {len(missing)} tensor(s) that {model_name} needs: "
            f"{_listing(missing)}"
        )
    return skipped


def load_language_and_towers(
    model: nn.Module,
    weights: Iterable[tuple[str, Any]],
    rename: Callable[[str], str],
    towers: Mapping[str, nn.Module],
) -> None:
    """Load a vision-language model: its language model (`model.model`, `model.lm_head`) by
    name, and each tower's tensors (names under its prefix, e.g. "visual.") through the
    tower's own `load_weights`, prefix removed.

    Tower tensors are set aside as they stream past, so the language model's fused q/k/v and
    gate/up mapping never touches a tower's layers; the towers load after it."""
    aside: dict[str, list[tuple[str, Any]]] = {prefix: [] for prefix in towers}

    def language_weights() -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            name = rename(name)
            prefix = next((p for p in towers if name.startswith(p)), None)
            if prefix is None:
                yield name, tensor
            else:
                aside[prefix].append((name.removeprefix(prefix), tensor))

    language = nn.Module()  # a view holding only the language model's modules
    language.model, language.lm_head = model.model, model.lm_head
    load_named_weights(
        language,
        language_weights(),
        stacked_params=model.stacked_params,
        ignore=model._ignored_checkpoint_tensor,
    )
    for prefix, tower in towers.items():
        tower.load_weights(aside[prefix])
