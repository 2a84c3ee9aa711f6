"""`tinyvllm models`: the catalog as a table or JSON, with what is on disk."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tinyvllm.catalog.entries import Catalog, CatalogEntry, load_catalog
from tinyvllm.catalog.locate import LocalModel, locate
from tinyvllm.utils.dirs import user_catalog_path

_COLUMNS = ("NAME", "PARAMS", "FAMILY", "CONTEXT", "CHAT", "ON DISK")


def _rows(catalog: Catalog, search: str) -> list[tuple[CatalogEntry, LocalModel | None]]:
    entries = catalog.search(search) if search.strip() else catalog.entries
    return [(entry, locate(entry)) for entry in entries]


def catalog_table(search: str = "", catalog: Catalog | None = None) -> str:
    """One line per entry (the default marked with *), then where the user catalog lives."""
    catalog = catalog if catalog is not None else load_catalog()
    default = catalog.default.name
    lines = [list(_COLUMNS)]
    for entry, local in _rows(catalog, search):
        lines.append(
            [
                entry.name + (" *" if entry.name == default else ""),
                entry.params,
                entry.family,
                str(entry.context_length),
                "yes" if entry.chat else "no",
                local.where if local is not None else "not downloaded",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(_COLUMNS))]
    text = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in lines
    ]
    if len(lines) == 1:
        text.append(f"(no catalog entry matches {search!r})")
    user = user_catalog_path()
    note = "" if user.is_file() else " (not present)"
    text.append("")
    text.append(f"* default. Your own entries go in {user}{note}.")
    text.append("Not downloaded: `tinyvllm chat --model NAME` fetches it on first use.")
    return "\n".join(text)


def catalog_json(search: str = "", catalog: Catalog | None = None) -> str:
    """A JSON list of entries: every catalog field plus `default`, `on_disk` and `path`."""
    catalog = catalog if catalog is not None else load_catalog()
    default = catalog.default.name
    items: list[dict[str, Any]] = []
    for entry, local in _rows(catalog, search):
        item = dataclasses.asdict(entry)
        item["default"] = entry.name == default
        item["on_disk"] = local.where if local is not None else None
        item["path"] = local.model if local is not None else None
        items.append(item)
    return json.dumps(items, indent=2)
