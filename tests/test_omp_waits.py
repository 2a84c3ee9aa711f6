"""torch's OpenMP workers must not spin on the cores the native kernels' pool runs on:
`import tinyvllm` before torch makes them sleep between regions, and an engine built after
torch came first says how to fix it (utils/omp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

from tinyvllm.native.build import unsupported_reason

SCRIPT = """
import json, sys, warnings
{imports}
from tinyvllm import LLM
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    LLM(sys.argv[1], dtype="float32", max_model_len=32, skip_tokenizer_init=True)
import os
print(json.dumps({{
    "policy": os.environ.get("OMP_WAIT_POLICY"),
    "warnings": [str(w.message) for w in caught if "OpenMP" in str(w.message)],
}}))
"""


def _run(model: Path, imports: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT.format(imports=imports)), str(model)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(unsupported_reason() is not None, reason="native kernels unavailable")
def test_wait_policy_follows_import_order(tiny_models: Mapping[str, Path]) -> None:
    model = tiny_models["llama"]
    first = _run(model, "import tinyvllm\nimport torch")
    assert first == {"policy": "PASSIVE", "warnings": []}
    late = _run(model, "import torch")
    assert late["policy"] is None
    assert len(late["warnings"]) == 1
    assert "Import tinyvllm before torch" in late["warnings"][0]
    # The user's own choice stands, and is not warned about.
    chosen = _run(model, "import torch", OMP_WAIT_POLICY="ACTIVE")
    assert chosen == {"policy": "ACTIVE", "warnings": []}
