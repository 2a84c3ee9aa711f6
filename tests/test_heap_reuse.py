"""The CPU step's activations reuse heap pages instead of faulting fresh ones in each step."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Each round: six 20 MB activations live at once, then all freed, like the large temporaries
# of one prefill step (a SmolLM2-135M-shaped model's gate/up output of 4,096 tokens is
# 25 MB); prints the page faults of the rounds after the first.
_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import torch
    from tinyvllm.utils.memory import keep_freed_heap_mapped
    if sys.argv[1] == "keep":
        assert keep_freed_heap_mapped(256 << 20)
    def step():
        bufs = [torch.empty(20 << 20, dtype=torch.uint8).fill_(1) for _ in range(6)]
        del bufs
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_stay_mapped_for_the_next_step() -> None:
    pages = 5 * 6 * (20 << 20) // 4096
    # By default glibc unmaps or trims the freed blocks and every round faults them in again.
    assert _faults("default") > pages // 2
    assert _faults("keep") < pages // 10
