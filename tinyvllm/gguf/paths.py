"""Which GGUF file a `model` (+ `gguf_file`) argument names: a local file, a file in a
local directory, or a file in a Hugging Face hub repo."""

from __future__ import annotations

import os
from pathlib import Path

from tinyvllm.gguf.reader import GGUF_MAGIC, is_gguf_file

GGUF_SUFFIX = ".gguf"


def _local(model: str) -> Path | None:
    path = Path(model).expanduser()
    if model.startswith(("/", ".", "~")) or path.exists():
        return path
    return None


def _check_magic(path: Path) -> Path:
    with open(path, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise ValueError(
                f"{str(path)!r} is not a GGUF file (it does not start with the 'GGUF' magic)"
            )
    return path.resolve()


def resolve_gguf_path(
    model: str,
    gguf_file: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
) -> Path | None:
    """The GGUF file to load, or None when `model` is a regular (safetensors) model.

    - `model` is a `.gguf` file (or any file starting with the GGUF magic);
    - `model` is a directory and `gguf_file` a file name in it, or the directory has no
      config.json and exactly one `.gguf` file;
    - `model` is a hub id and `gguf_file` a file of that repo (downloaded if needed).
    Raises FileNotFoundError / ValueError saying what is missing or wrong.
    """
    local = _local(model)
    if local is not None and local.is_file():
        if gguf_file is not None:
            raise ValueError(
                f"gguf_file={gguf_file!r} needs model= to be a directory or hub id, but "
                f"{model!r} is a file; pass model={model!r} alone"
            )
        if local.suffix == GGUF_SUFFIX or is_gguf_file(local):
            return _check_magic(local)
        return None
    if local is not None:
        if not local.exists():
            if local.suffix == GGUF_SUFFIX:
                raise FileNotFoundError(f"no such GGUF file: {model!r}")
            return None
        found = sorted(p.name for p in local.glob(f"*{GGUF_SUFFIX}"))
        if gguf_file is not None:
            path = local / gguf_file
            if not path.is_file():
                listing = ", ".join(found) if found else "none"
                raise FileNotFoundError(
                    f"gguf_file {gguf_file!r} is not in {str(local)!r} (GGUF files there: "
                    f"{listing})"
                )
            return _check_magic(path)
        if found and not (local / "config.json").is_file():
            if len(found) > 1:
                raise ValueError(
                    f"{str(local)!r} holds several GGUF files ({', '.join(found)}); "
                    "choose one with gguf_file=..."
                )
            return _check_magic(local / found[0])
        return None
    if gguf_file is None:
        return None
    return _check_magic(_download(model, gguf_file, revision, download_dir))


def _download(repo_id: str, filename: str, revision: str | None, cache: str | None) -> Path:
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    try:
        return Path(
            hf_hub_download(
                repo_id,
                filename,
                revision=revision,
                cache_dir=cache,
                local_files_only=offline or constants.HF_HUB_OFFLINE,
            )
        )
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"GGUF file {filename!r} of {repo_id!r} is not in the local Hugging Face cache and "
            "could not be downloaded; pass a local path to the .gguf file instead"
        ) from None
    except EntryNotFoundError:
        raise FileNotFoundError(f"hub repo {repo_id!r} has no file {filename!r}") from None
    except (HfHubHTTPError, ValueError) as exc:
        raise FileNotFoundError(f"cannot fetch {filename!r} from {repo_id!r}: {exc}") from None
