"""Import tinyvllm before anything imports torch, as a user's `from tinyvllm import LLM` at the
top of a script does: torch's OpenMP wait policy (tinyvllm/utils/omp.py) is read once, when
torch loads its OpenMP runtime, so a benchmark that imported torch first would measure torch's
workers spinning on the cores tinyvllm's kernels use. Every benchmark imports this first."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("tinyvllm") is None:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tinyvllm  # noqa: F401
