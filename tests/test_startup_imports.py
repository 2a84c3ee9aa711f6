"""What a start pays for: the first engine imports torch without the cyclic collector scanning
it over and over, and freezes only those imports, never an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest
from gguf_writer import write_tiny_gguf

from tinyvllm.gguf.tokenizer_cache import load_gguf_tokenizer


@pytest.fixture(scope="module")
def tiny_gguf(tiny_models: Mapping[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_gguf(tiny_models["llama"], tmp_path_factory.mktemp("startup") / "l.gguf")
    load_gguf_tokenizer(path)  # converted once (with transformers), as before any later start
    return path


def _python(script: str) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh interpreter; it must exit 0."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _run(script: str) -> dict:
    """The JSON object `script` prints last."""
    return json.loads(_python(script).stdout.strip().splitlines()[-1])


def test_first_engine_freezes_its_imports_not_the_engine(tiny_gguf: Path) -> None:
    """Torch's ~250k objects are frozen by the first engine (before: hundreds of collections,
    full ones rescanning torch, ~0.5 s of a start); a second engine freezes nothing more, and
    a dropped engine is still collected."""
    result = _run(
        f"""
        import gc, json, sys, weakref
        from tinyvllm import LLM
        assert "torch" not in sys.modules
        llm = LLM({str(tiny_gguf)!r}, max_model_len=64, max_num_seqs=2)
        first = gc.get_freeze_count()
        engine = weakref.ref(llm.engine)
        del llm
        gc.collect()
        llm = LLM({str(tiny_gguf)!r}, max_model_len=64, max_num_seqs=2)
        print(json.dumps({{"first": first, "second": gc.get_freeze_count(),
                          "dropped": engine() is None, "enabled": gc.isenabled()}}))
        """
    )
    assert result["first"] > 100_000, result
    assert result["second"] <= result["first"], result  # frozen objects still die
    assert result["dropped"], result
    assert result["enabled"], result


# Imported only where they are used: jinja2 by chat templates (LLM.chat), Pillow and the
# vision model by images, the other model states by their models. `import tinyvllm` and a
# text model's engine never need them (~60 ms of a start together).
LAZY_MODULES = (
    "jinja2",
    "PIL",
    "transformers",
    "tinyvllm.models.qwen2_5_vl",
    "tinyvllm.runner.model_states.mrope",
    "tinyvllm.runner.model_states.realtime",
)


def test_text_engine_leaves_chat_and_image_modules_unimported(tiny_gguf: Path) -> None:
    result = _run(
        f"""
        import json, sys
        lazy = {LAZY_MODULES!r}
        import tinyvllm
        after_import = [m for m in lazy if m in sys.modules]
        from tinyvllm import LLM, SamplingParams
        llm = LLM({str(tiny_gguf)!r}, max_model_len=64, max_num_seqs=2)
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        print(json.dumps({{"import": after_import,
                          "engine": [m for m in lazy if m in sys.modules]}}))
        """
    )
    assert result == {"import": [], "engine": []}, result


def test_a_failed_runtime_import_raises_here_and_reenables_the_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    from tinyvllm.engine import runtime_imports

    monkeypatch.setattr(runtime_imports, "RUNTIME_MODULES", ("tinyvllm._no_such_module",))
    frozen = gc.get_freeze_count()
    with pytest.raises(ModuleNotFoundError, match="_no_such_module"):
        runtime_imports.import_runtime()
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


def test_frozen_imports_are_collected_again_at_exit(tiny_gguf: Path) -> None:
    """The freeze ends at exit: shutdown's collections free the frozen cycles as before. Left
    frozen, triton's bindings (imported here as the GPU backend would) reported hundreds of
    "leaked" objects on stderr at every exit."""
    pytest.importorskip("triton")
    script = f"""
        import triton  # noqa: F401
        from tinyvllm import LLM
        LLM({str(tiny_gguf)!r}, dtype="float32", max_model_len=64)
    """
    stderr = _python(script).stderr
    assert "leaked" not in stderr, stderr[-2000:]
