"""Checking a model's config against its checkpoint before anything is built from it.

Sizes in a config (layer count, vocabulary, hidden size, heads) decide what the model
allocates, and they come from a file someone else wrote. Each is checked to be a sane value
and then pinned to the shape of a tensor that is really in the checkpoint (whose bytes the
reader has already checked against the file size), so a config claiming a million layers or a
2^40-token vocabulary fails here, naming the file and the field, instead of allocating.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Decoder layers (model.layers.N; backbone.layers.N in NemotronH; layers.N in a headless
# backbone such as Qwen3-Embedding) and BERT encoder layers (encoder.layer.N, maybe under bert.).
_LAYER = re.compile(r"^(?:(?:model\.|backbone\.)?layers|(?:bert\.)?encoder\.layer)\.(\d+)\.")
_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_OPTIONAL_POSITIVE_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True)
class TensorDirectory:
    """Tensor shapes of a checkpoint under HF names, without reading the tensor bytes.

    `origin` names the file(s) for messages; `field_names` maps an HF config field to what
    the file calls it (GGUF metadata keys), so errors name the field the user can find.
    """

    origin: str
    shapes: dict[str, tuple[int, ...]]
    field_names: Mapping[str, str] = field(default_factory=dict)

    def describe(self, hf_field: str) -> str:
        alias = self.field_names.get(hf_field)
        return hf_field if alias is None else f"{alias} ({hf_field})"


@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open(path)`, with a corrupt or truncated file reported by name."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as exc:
        raise ValueError(
            f"cannot read weight file {str(path)!r}: it is corrupt or truncated ({exc}); "
            "re-download or re-save it"
        ) from None


def read_tensor_directory(path: Path, weight_files: list[Path] | None = None) -> TensorDirectory:
    """The tensor directory of a GGUF file, or of the safetensors files of a model directory
    (`weight_files`, as the loader lists them)."""
    from tinyvllm.gguf.reader import is_gguf_file

    if is_gguf_file(path):
        from tinyvllm.gguf.config import hf_field_names
        from tinyvllm.gguf.reader import read_gguf
        from tinyvllm.gguf.weights import hf_tensor_name

        gf = read_gguf(path)
        shapes = {}
        for name, info in gf.tensors.items():
            hf_name = hf_tensor_name(name, gf.architecture)
            if hf_name is not None:
                shapes[hf_name] = info.shape
        return TensorDirectory(f"GGUF file {str(path)!r}", shapes, hf_field_names(gf.architecture))
    shapes = {}
    for file in weight_files or []:
        with open_safetensors(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - the handle is not iterable
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return TensorDirectory(f"{str(Path(path) / 'config.json')!r}", shapes)


def check_config_values(config: Any, origin: str, describe: Callable[[str], str] = str) -> None:
    """Every size the model is built from is a positive integer, and the norm epsilon and rope
    base are finite and positive. Raises ValueError naming `origin` and the field."""

    def bad(name: str, why: str, value: Any) -> ValueError:
        return ValueError(f"{origin}: {describe(name)} {why}, got {value!r}")

    for name in (*_POSITIVE_INTS, *_OPTIONAL_POSITIVE_INTS):
        value = getattr(config, name, None)
        if value is None and name in _OPTIONAL_POSITIVE_INTS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(name, "must be a positive integer", value)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise bad("num_key_value_heads", f"must divide num_attention_heads={heads}", kv_heads)
    rope = getattr(config, "rope_parameters", None)
    theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
    for name, value in (
        ("rms_norm_eps", getattr(config, "rms_norm_eps", 1e-6)),
        ("rope_theta", theta if theta is not None else getattr(config, "rope_theta", None)),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(name, "must be a number", value)
        if not math.isfinite(value) or value <= 0:
            raise bad(name, "must be a finite positive number", value)


def check_renamed_checkpoint(
    config: Any, directory: TensorDirectory, rename: Callable[[str], str]
) -> None:
    """`check_against_checkpoint` on tensor names mapped through `rename` first: multimodal
    checkpoints nest the language model under prefixes of their own."""
    shapes = {rename(name): shape for name, shape in directory.shapes.items()}
    check_against_checkpoint(config, replace(directory, shapes=shapes))


def check_against_checkpoint(
    config: Any, directory: TensorDirectory, model_cls: type | None = None
) -> None:
    """The config's sizes agree with the checkpoint's tensor shapes (layer count from the layer
    tensors, vocabulary and hidden size from the embedding, heads and MLP width from layer 0).
    A model class whose layers differ from Llama's (hybrids) names its own layer tensors with
    a static `checkpoint_shapes(config) -> {name: (shape, config fields)}`, and its embedding
    with `embedding_tensor` when that is not `model.embed_tokens.weight`.
    Raises ValueError naming the file and the field."""
    check_config_values(config, directory.origin, directory.describe)
    layers = config.num_hidden_layers
    check_layer_count(layers, directory)
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    # A headless backbone (the base model saved without its LM head) names tensors without
    # the "model." prefix.
    headless = "model.embed_tokens.weight" not in directory.shapes and (
        "embed_tokens.weight" in directory.shapes
    )
    base = "" if headless else "model."
    embedding = getattr(model_cls, "embedding_tensor", f"{base}embed_tokens.weight")
    expected: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
        embedding: ((config.vocab_size, hidden), ("vocab_size", "hidden_size")),
    }
    own_shapes = getattr(model_cls, "checkpoint_shapes", None)
    if own_shapes is not None:
        expected |= own_shapes(config)
    elif layers:
        attn, mlp = f"{base}layers.0.self_attn", f"{base}layers.0.mlp"
        expected |= {
            f"{attn}.q_proj.weight": ((q_rows, hidden), ("num_attention_heads", "hidden_size")),
            f"{attn}.k_proj.weight": ((kv_rows, hidden), ("num_key_value_heads", "hidden_size")),
            f"{attn}.v_proj.weight": ((kv_rows, hidden), ("num_key_value_heads", "hidden_size")),
            f"{attn}.o_proj.weight": ((hidden, q_rows), ("hidden_size", "num_attention_heads")),
            f"{mlp}.gate_proj.weight": ((inter, hidden), ("intermediate_size", "hidden_size")),
            f"{mlp}.up_proj.weight": ((inter, hidden), ("intermediate_size", "hidden_size")),
            f"{mlp}.down_proj.weight": ((hidden, inter), ("hidden_size", "intermediate_size")),
        }
    for name, (shape, fields) in expected.items():
        check_shape(directory, name, shape, fields)


def check_layer_count(layers: int, directory: TensorDirectory) -> None:
    """The checkpoint holds tensors for exactly layers 0..layers-1."""
    present = {int(m.group(1)) for name in directory.shapes if (m := _LAYER.match(name))}
    if len(present) != layers or (present and max(present) != layers - 1):
        found = f"layers 0..{max(present)}" if present else "no layers"
        raise ValueError(
            f"{directory.origin}: {directory.describe('num_hidden_layers')} is {layers}, but "
            f"the checkpoint's tensors have {len(present)} layer(s) ({found})"
        )


def check_shape(
    directory: TensorDirectory, name: str, shape: tuple[int, ...], fields: tuple[str, ...]
) -> None:
    actual = directory.shapes.get(name)
    if actual is None:
        raise ValueError(f"{directory.origin}: the checkpoint has no tensor {name!r}")
    if tuple(actual) != shape:
        named = " and ".join(directory.describe(f) for f in dict.fromkeys(fields))
        raise ValueError(
            f"{directory.origin}: tensor {name!r} has shape {tuple(actual)}, but the config's "
            f"{named} give {shape}"
        )
