"""Finding a model's files, reading its safetensors weights, building the model."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinyvllm.models.checkpoint_check import (
    TensorDirectory,
    check_against_checkpoint,
    open_safetensors,
    read_tensor_directory,
)
from tinyvllm.models.registry import get_model_class
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.weight import bind_quant_kernels
from tinyvllm.utils.hub import HUB_ALLOW_PATTERNS
from tinyvllm.utils.memory import release_free_heap

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(model))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_path(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """A local model directory, or the snapshot directory of a hub id (downloaded if needed).

    Raises FileNotFoundError when a path does not exist, has no config.json, or a hub
    model is neither cached nor downloadable; ValueError for a malformed hub id.
    """
    if _looks_like_path(model):
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"no such directory: {model!r} (pass a local model directory containing "
                "config.json, or a Hugging Face hub id such as 'Qwen/Qwen3-0.6B')"
            )
        if not path.is_dir():
            raise FileNotFoundError(f"{model!r} is a file, not a model directory")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {str(path)!r} has no config.json; a model directory needs "
                "config.json, *.safetensors weights and the tokenizer files"
            )
        return path.resolve()
    return _download_from_hub(model, revision, download_dir)


def _download_from_hub(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # huggingface_hub reads HF_HUB_OFFLINE once at import; honour a later change too.
    offline = _env_flag("HF_HUB_OFFLINE") or constants.HF_HUB_OFFLINE
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            local_files_only=offline,
        )
    except HFValidationError as exc:
        raise ValueError(
            f"{repo_id!r} is neither an existing local directory nor a valid Hugging Face "
            f"hub id ({exc})"
        ) from None
    except LocalEntryNotFoundError:
        cache = download_dir or constants.HF_HUB_CACHE
        if offline:
            why, fix = "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE"
        else:
            why, fix = "the Hugging Face hub could not be reached", "check the network connection"
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({cache}) and {why}: "
            f"{fix}, download it on a machine with network access (`hf download {repo_id}`) "
            "and copy the cache over, or pass a local model directory"
        ) from None
    except GatedRepoError:
        raise PermissionError(
            f"model {repo_id!r} is gated: accept its license on huggingface.co and log in "
            "with `hf auth login` (or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(
            f"revision {revision!r} does not exist for model {repo_id!r}"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} was not found on the Hugging Face hub (check the id; for a "
            "private repo log in with `hf auth login`)"
        ) from None
    path = Path(snapshot)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"hub repo {repo_id!r} has no config.json, so it is not a transformers model"
        )
    return path


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / _SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{str(index)!r} is not a valid safetensors index ({exc!r})") from None
        strange = [n for n in names if not isinstance(n, str) or Path(n).name != n or n == ".."]
        if strange:
            raise ValueError(
                f"{str(index)!r}: weight_map names {strange[0]!r}, which is not a file name "
                "in the model directory"
            )
        missing = [name for name in names if not (model_dir / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{_SAFETENSORS_INDEX} in {str(model_dir)!r} references missing shard file(s): "
                f"{', '.join(missing)} (the download is incomplete)"
            )
        return [model_dir / name for name in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    hint = (
        f"; found {', '.join(pickles)}, but PyTorch pickle weights (.bin/.pt) are not loaded "
        "because unpickling can run arbitrary code: convert them to safetensors"
        if pickles
        else "; .bin/.pt pickle weights are not loaded for safety, only safetensors"
    )
    raise FileNotFoundError(f"no *.safetensors weight files in {str(model_dir)!r}{hint}")


def tensor_directory(path: Path) -> TensorDirectory:
    """Tensor names and shapes of a GGUF file or a safetensors model directory."""
    from tinyvllm.gguf.reader import is_gguf_file

    path = Path(path)
    return read_tensor_directory(path, None if is_gguf_file(path) else _weight_files(path))


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of the checkpoint, one at a time."""
    for path in _weight_files(Path(model_dir)):
        with open_safetensors(path) as handle:
            for name in handle.keys():  # noqa: SIM118 - the handle is not iterable
                yield name, handle.get_tensor(name)


def _iter_weights(
    path: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_quantized: bool,
) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors of a safetensors model directory or a GGUF file (dequantized, or
    raw GGUF blocks with `keep_quantized`)."""
    from tinyvllm.gguf.reader import is_gguf_file, read_gguf

    if is_gguf_file(path):
        from tinyvllm.gguf.weights import iter_gguf_weights

        return iter_gguf_weights(
            read_gguf(path), hf_config, dtype=dtype, device=device, keep_quantized=keep_quantized
        )
    return iter_safetensors_weights(path)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _one_torch_thread(enabled: bool) -> Iterator[None]:
    """Run torch ops on one thread while `enabled`. Loading kept GGUF blocks is memory copies
    (stacking fused shards, permuting q/k rows): one thread already saturates memory bandwidth,
    and torch's parallel copy waits for every OpenMP worker, so with another program on the
    cores (a descheduled worker) it ran 6x slower than one thread (a 3.7 s load took 10-15 s at
    load average 10)."""
    if not enabled:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_model(
    model_dir: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    max_model_len: int,
    quant_config: QuantConfig | None = None,
    quant_kernels: QuantKernels | None = None,
) -> nn.Module:
    """Build the registered model class for `hf_config` on `device` in `dtype` and load
    its weights from `model_dir` (safetensors) or a .gguf file.

    With a `quant_config` ("int8", "int4", "gguf") linear layers, the embedding and the
    lm_head hold weight-only quantized tensors; "gguf" streams the file's raw blocks into
    them, the others quantize float weights as they arrive. `quant_kernels` are the native
    CPU block kernels the platform chose (see tinyvllm/platforms/); without them GGUF blocks
    are converted for torch's kernels.
    """
    model_cls = get_model_class(hf_config)
    path = Path(model_dir)
    # Every size the model allocates must agree with a tensor really in the file (a model
    # family with other tensor names brings its own check, or its own layer shapes).
    own_check = getattr(model_cls, "check_checkpoint", None)
    if own_check is not None:
        own_check(hf_config, tensor_directory(path))
    else:
        check_against_checkpoint(hf_config, tensor_directory(path), model_cls)
    # Parameters are allocated directly on the device in the target dtype (uninitialised:
    # the checkpoint overwrites them), so no full-size fp32 copy ever exists.
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(hf_config, max_model_len, quant_config=quant_config)  # type: ignore[call-arg]
    bind_quant_kernels(model, quant_kernels)
    keep_blocks = quant_config is not None and quant_config.method == "gguf"
    weights = _iter_weights(path, hf_config, dtype, device, keep_blocks)
    try:
        with _one_torch_thread(keep_blocks and torch.device(device).type == "cpu"):
            model.load_weights(weights)  # type: ignore[operator]
    except (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", torch.OutOfMemoryError)):
        raise  # the device's failures, not the file's
    except (ValueError, ArithmeticError, RuntimeError, IndexError) as exc:
        # Numpy/torch shape messages and the loader's own name no file: add it.
        detail = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"cannot load the weights of {str(path)!r}: {detail}") from None
    release_free_heap()  # the load's temporaries (rope tables, fused shards) stay otherwise
    return model.eval()


def module_bytes(model: nn.Module) -> int:
    """Bytes held by a model's parameters and buffers (what its weights cost in memory)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
