"""The model catalog (`models.toml`), finding models on disk and fetching them.

`load_catalog()` reads the shipped catalog plus the user's; `locate(entry)` says what is on
disk without the network; `resolve_model(spec)` turns a catalog name, hub id, directory or
.gguf file into files to load, downloading when needed. Nothing here imports torch.
"""

from __future__ import annotations

from tinyvllm.catalog.download import DownloadProgress, progress_bar
from tinyvllm.catalog.entries import (
    Catalog,
    CatalogEntry,
    CatalogError,
    HubSource,
    PackageSource,
    load_catalog,
)
from tinyvllm.catalog.locate import LocalModel, locate
from tinyvllm.catalog.resolve import (
    ModelNotAvailable,
    ResolvedModel,
    resolve_catalog_name,
    resolve_model,
)
from tinyvllm.utils.dirs import user_cache_dir, user_catalog_path, user_config_dir, user_data_dir

__all__ = [
    "Catalog",
    "CatalogEntry",
    "CatalogError",
    "DownloadProgress",
    "HubSource",
    "LocalModel",
    "ModelNotAvailable",
    "PackageSource",
    "ResolvedModel",
    "load_catalog",
    "locate",
    "progress_bar",
    "resolve_catalog_name",
    "resolve_model",
    "user_cache_dir",
    "user_catalog_path",
    "user_config_dir",
    "user_data_dir",
]
