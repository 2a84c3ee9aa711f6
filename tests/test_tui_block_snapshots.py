"""The TUI block map marks blocks that end a prefix with a recurrent-state snapshot."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from tinyvllm.stats import BlockInfo
from tinyvllm_tui.widgets.block_map import snapshot_cells


def test_snapshot_cells_follow_the_folding() -> None:
    blocks = [BlockInfo(i, "cached", 0, ()) for i in range(6)]
    blocks[4] = BlockInfo(4, "cached", 0, (), state_snapshot=True)
    assert snapshot_cells(blocks, 1) == [False] * 4 + [True, False]
    assert snapshot_cells(blocks, 4) == [False, True]
    assert snapshot_cells([], 3) == []
